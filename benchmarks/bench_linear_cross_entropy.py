"""LM head + cross entropy on the H200: forward+backward time and peak memory of
``lowp_ops.linear_cross_entropy`` (bf16 gradient, MXFP8 gradient with a bf16 or MXFP8 other operand,
the recomputing ``reduction="none"`` path) next to eager and ``torch.compile`` of
``F.cross_entropy(F.linear(h, w), t)`` and Liger's fused linear cross entropy; then the two backward GEMMs
alone (cuBLAS bf16, our Triton MXFP8 GEMM in its variants and a few tile configs, dequantize + cuBLAS).

Peak memory is the allocator's peak during one forward+backward minus what was allocated before (inputs),
so it includes the gradients (dweight is V x H). A device-to-device copy measured in the same run is the
ceiling for memory-bound work; GEMM-bound rows also report TFLOP/s of the useful GEMMs (6 N H V flops).
Run: ``PYTHONPATH=. python3 benchmarks/bench_linear_cross_entropy.py [--quick] [--no-gemms]
[--interleaved ROUNDS]``; ``--interleaved`` also times the bf16-gradient contenders in rotation.
"""

from __future__ import annotations

import argparse
import statistics
import traceback

import torch
import torch.nn.functional as F
from _common import copy_bandwidth_tbs, environment, import_liger, median_ms, write_json

import lowp_ops
from lowp_ops.kernels import mxfp8_gemm as gemm_kernels

N_TOKENS, HIDDEN, VOCAB = 4096, 4096, 129280


def load_liger_flce():
    """Liger's fused linear cross-entropy loss module, or None."""
    loss_class = import_liger("transformers", "LigerFusedLinearCrossEntropyLoss")
    return None if loss_class is None else loss_class()


def measure(name: str, loss_fn, h, w, target, copy_ms: float, rows: list) -> None:
    """Median forward+backward time and the peak memory of one step above the inputs."""
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()

    def step():
        h.grad = w.grad = None
        loss_fn(h, w, target).backward()

    try:
        step()  # compile / warm up
        torch.cuda.synchronize()
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
        ms = median_ms(step)
    except Exception as error:
        print(f"{name} failed: {type(error).__name__}: {str(error)[:300]}")
        traceback.print_exc(limit=2)
        return
    tflops = 6 * h.numel() / h.shape[-1] * HIDDEN * VOCAB / ms / 1e9
    rows.append({"impl": name, "ms": round(ms, 3), "peak_GiB": round(peak_gib, 3), "TFLOPs": round(tflops, 1),
                 "x_copy": round(ms / copy_ms, 2)})  # fmt: skip
    print(f"{name:44s} {ms:8.3f} ms  peak +{peak_gib:6.3f} GiB  {tflops:6.1f} TFLOP/s")


def end_to_end(copy_ms: float, quick: bool) -> list:
    torch.manual_seed(0)
    h = torch.randn(N_TOKENS, HIDDEN, device="cuda").bfloat16()
    w = (torch.randn(VOCAB, HIDDEN, device="cuda") * HIDDEN**-0.5).bfloat16()
    target = torch.randint(0, VOCAB, (N_TOKENS,), device="cuda")
    rows = []

    def lowp(**kwargs):
        return lambda h, w, t: lowp_ops.linear_cross_entropy(h, w, t, **kwargs)

    measure("lowp bf16 grad (default: logits in dweight)", lowp(), h, w, target, copy_ms, rows)
    for chunk in (2048, 4096) if quick else (1024, 2048, 4096):
        measure(f"lowp bf16 grad chunk={chunk}", lowp(chunk_size=chunk), h, w, target, copy_ms, rows)
    if not quick:
        measure(
            "lowp bf16 grad, reduction=none (recompute)",
            lambda h, w, t: lowp_ops.linear_cross_entropy(h, w, t, reduction="none").mean(),
            h, w, target, copy_ms, rows,
        )  # fmt: skip
    measure("lowp mxfp8_e4m3, other bf16", lowp(grad_format="mxfp8_e4m3"), h, w, target, copy_ms, rows)
    measure(
        "lowp mxfp8_e4m3, other mxfp8 (TE recipe)",
        lowp(grad_format="mxfp8_e4m3", other_operand="mxfp8"),
        h, w, target, copy_ms, rows,
    )  # fmt: skip
    measure("eager F.linear + F.cross_entropy", lambda h, w, t: F.cross_entropy(F.linear(h, w), t),
            h, w, target, copy_ms, rows)  # fmt: skip
    compiled = torch.compile(lambda h, w, t: F.cross_entropy(F.linear(h, w), t))
    measure("torch.compile(F.linear + F.cross_entropy)", compiled, h, w, target, copy_ms, rows)
    liger = load_liger_flce()
    if liger is not None:
        measure(
            "liger fused linear cross entropy", lambda h, w, t: liger(w, h, t), h, w, target, copy_ms, rows
        )
    return rows


def gemm_row(name: str, fn, m: int, n: int, k: int, rows: list) -> None:
    try:
        ms = median_ms(fn)
    except Exception as error:
        print(f"{name} failed: {type(error).__name__}: {str(error)[:300]}")
        return
    tflops = 2 * m * n * k / ms / 1e9
    rows.append({"gemm": name, "M": m, "N": n, "K": k, "ms": round(ms, 3), "TFLOPs": round(tflops, 1)})
    print(f"{name:60s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s")


CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
]


def backward_gemms(chunk: int, quick: bool) -> list:
    """dgrad dX[C, H] = dY[C, V] W[V, H] (row-wise dY) and wgrad dW[V, H] = dY^T X[C, H] (column-wise dY)
    at one chunk of the default schedule."""
    torch.manual_seed(0)
    logits = (torch.randn(chunk, VOCAB, device="cuda") * 3).bfloat16()
    target = torch.randint(0, VOCAB, (chunk,), device="cuda")
    _, payload = lowp_ops.cross_entropy_with_mxfp8_grad(logits, target)
    dy = torch.ops.lowp.cross_entropy_bwd(
        logits, target, torch.logsumexp(logits.float(), 1), torch.full((chunk,), 1.0 / chunk, device="cuda"),
        0.0, -100,
    )  # fmt: skip
    w = (torch.randn(VOCAB, HIDDEN, device="cuda") * HIDDEN**-0.5).bfloat16()
    x = torch.randn(chunk, HIDDEN, device="cuda").bfloat16()
    row_data, row_scale = payload.row_data.view(torch.uint8), payload.row_scale
    col_data, col_scale = payload.col_data.view(torch.uint8), payload.col_scale
    w_q = lowp_ops.mxfp8_quantize(w, rowwise=False)
    x_q = lowp_ops.mxfp8_quantize(x, rowwise=False)
    dx = torch.empty(chunk, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dw = torch.empty(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = []
    shapes = {"dgrad": (chunk, HIDDEN, VOCAB), "wgrad": (VOCAB, HIDDEN, chunk)}
    gemm_row("dgrad cuBLAS bf16 (grad_format=None)", lambda: torch.mm(dy, w, out=dx), *shapes["dgrad"], rows)
    gemm_row(
        "wgrad cuBLAS bf16 (grad_format=None)", lambda: torch.mm(dy.t(), x, out=dw), *shapes["wgrad"], rows
    )
    dgrad_others = {"bf16": (w, None), "mxfp8": (w_q.col_data.view(torch.uint8), w_q.col_scale)}
    wgrad_others = {"bf16": (x, None), "mxfp8": (x_q.col_data.view(torch.uint8), x_q.col_scale)}
    operands = {
        "dgrad": (dx, row_data, row_scale, "rowwise", dgrad_others),
        "wgrad": (dw, col_data, col_scale, "columnwise", wgrad_others),
    }
    for gemm, (out, a_data, a_scale, use, others) in operands.items():
        for other, (b, b_scale) in others.items():
            for dot_scaled in (False, True):
                for index, config in enumerate(CONFIGS[:1] if quick else CONFIGS):
                    variant = "dot_scaled" if dot_scaled else "registers"

                    def run(out=out, a=(a_data, a_scale, use), b=(b, b_scale), flags=(dot_scaled, config)):
                        gemm_kernels.mxfp8_gemm_into(
                            out, *a, "e4m3", b[0], b[1], "e4m3", False, dot_scaled=flags[0], config=flags[1]
                        )

                    gemm_row(f"{gemm} triton mxfp8 x {other} {variant} cfg{index}", run, *shapes[gemm], rows)
    copy = lowp_ops.MXFP8Tensor(
        payload.row_data, row_scale, payload.col_data, col_scale, "e4m3", "compact", dy.shape
    )

    def dequantize_then_cublas_dgrad():
        return torch.mm(lowp_ops.mxfp8_dequantize(copy, use="rowwise"), w, out=dx)

    def dequantize_then_cublas_wgrad():
        return torch.mm(lowp_ops.mxfp8_dequantize(copy, use="columnwise").t(), x, out=dw)

    gemm_row("dgrad dequantize + cuBLAS bf16", dequantize_then_cublas_dgrad, *shapes["dgrad"], rows)
    gemm_row("wgrad dequantize + cuBLAS bf16", dequantize_then_cublas_wgrad, *shapes["wgrad"], rows)
    return rows


def interleaved(rounds: int, steps: int = 25) -> list:
    """Median step time of the bf16-gradient contenders measured in rotation, so that clock changes (the
    power cap engages during these GEMM-heavy steps) fall on all of them alike: each measurement times
    ``steps`` back-to-back steps between CUDA events after one warm step; the order rotates each round."""
    torch.manual_seed(0)
    h = torch.randn(N_TOKENS, HIDDEN, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(VOCAB, HIDDEN, device="cuda") * HIDDEN**-0.5).bfloat16().requires_grad_()
    target = torch.randint(0, VOCAB, (N_TOKENS,), device="cuda")
    compiled = torch.compile(lambda h, w, t: F.cross_entropy(F.linear(h, w), t))
    contenders = {
        "lowp default": lambda: lowp_ops.linear_cross_entropy(h, w, target),
        "lowp chunk=4096": lambda: lowp_ops.linear_cross_entropy(h, w, target, chunk_size=4096),
        "torch.compile": lambda: compiled(h, w, target),
    }

    def step(loss_fn):
        h.grad = w.grad = None
        loss_fn().backward()

    for loss_fn in contenders.values():
        step(loss_fn)
        step(loss_fn)
    names = list(contenders)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step(contenders[name])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step(contenders[name])
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / steps)
            print(f"round {r} {name:16s} {times[name][-1]:8.3f} ms/step", flush=True)
    wins = sum(a < b for a, b in zip(times["lowp default"], times["torch.compile"], strict=True))
    print(f"\n| impl | median of {rounds} rounds, ms | min | max |\n|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    print(f"lowp default faster than torch.compile in {wins} of {rounds} rounds")
    return [{"impl": name, "ms_per_round": values} for name, values in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer variants and GEMM configs")
    parser.add_argument("--no-gemms", action="store_true", help="skip the per-chunk GEMM comparison")
    parser.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also time the bf16 contenders in rotation",
    )
    args = parser.parse_args()
    copy_ms_2gib, copy_tbs = copy_bandwidth_tbs()
    logits_copy_ms = copy_ms_2gib * (N_TOKENS * VOCAB * 2) / 2**31
    print(
        f"copy 2 GiB: {copy_ms_2gib:.3f} ms = {copy_tbs:.2f} TB/s; N x V bf16 logits: {logits_copy_ms:.3f} ms"
    )
    print(f"\n== forward+backward, N={N_TOKENS} H={HIDDEN} V={VOCAB} bf16, reduction=mean")
    rows = end_to_end(logits_copy_ms, args.quick)
    torch.cuda.empty_cache()
    gemms = []
    if not args.no_gemms:
        print("\n== backward GEMMs of one chunk (default chunk)")
        from lowp_ops.meta.linear_cross_entropy import default_chunk_size

        gemms = backward_gemms(min(default_chunk_size(VOCAB), N_TOKENS), args.quick)
    print("\n| impl | fwd+bwd ms | peak extra GiB | TFLOP/s (6NHV) | x logits copy |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['impl']} | {r['ms']:.3f} | {r['peak_GiB']:.3f} | {r['TFLOPs']:.1f} | {r['x_copy']:.2f} |"
        )
    print("\n| GEMM | M x N x K | ms | TFLOP/s |\n|---|---|---|---|")
    for r in gemms:
        print(f"| {r['gemm']} | {r['M']} x {r['N']} x {r['K']} | {r['ms']:.3f} | {r['TFLOPs']:.1f} |")
    rotation = interleaved(args.interleaved) if args.interleaved else []
    write_json(
        "bench_linear_cross_entropy.json",
        {
            "env": environment(),
            "copy_TBps": copy_tbs,
            "logits_copy_ms": logits_copy_ms,
            "rows": rows,
            "gemms": gemms,
            "interleaved": rotation,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
