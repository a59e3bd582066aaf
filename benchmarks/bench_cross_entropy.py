"""Cross-entropy benchmark on the H200: ours (forward, backward to bf16, backward to MXFP8 row+col,
forward+backward) next to eager, torch.compile, Liger and the unfused path (our bf16 backward, then our
mxfp8_quantize), with a device-to-device copy measured in the same run as the ceiling.

Effective bandwidth = byte floor x N x V / time: forward 2 B/elem (read logits), backward to bf16
4 B/elem (read + write), backward to MXFP8 row+col 4.0625 B/elem, forward+backward 6 / 6.0625 B/elem.
Each case is timed twice: eager calls (host launch overhead included: do_bench) and replays of a CUDA
graph of the same calls (GPU time only: what a CUDA-graph-captured training step pays). Every case
cycles through ROTATE copies of the logits, a new one each call, so no call finds the previous call's
logits in L2 (our MXFP8 backward loads them with an evict_last hint: on one buffer its back-to-back
figures rose by up to 5 points,).
``--sustained SECONDS`` adds our three kernels run back to back for that long each (CUDA-graph replays),
next to a copy run the same way: the steady state under the GPU's power cap, with the median SM clock.
``--features`` adds forward+backward rows with the LM-loss features on (z-loss, soft-capping, both with
label smoothing) for ours (bf16 and MXFP8 gradients), torch.compile of the same loss in PyTorch and Liger.
The ``overwrite_logits=True`` row writes the gradient over (scratch copies of) the logits.
``--te-site DIR`` (or ``LOWP_BENCH_TE_SITE``) adds TransformerEngine's Triton cross entropy from a TE
wheel installed there (``pip install --no-deps --target DIR transformer_engine-*.whl``; kept off
``sys.path``), called as TE's ``CrossEntropyFunction`` calls it: its forward copies the logits (the
backward writes the gradient over that copy) or, with ``overwrite_input``, writes over them.
Run: ``PYTHONPATH=. python3 benchmarks/bench_cross_entropy.py`` (Liger from a wheel on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import traceback

import torch
import torch.nn.functional as F
from _common import (
    ClockWatch,
    copy_bandwidth_tbs,
    environment,
    graph_ms,
    import_liger,
    import_te_triton_cross_entropy,
    median_ms,
    rotating,
    sustained_ms,
    write_json,
)

import lowp_ops

SHAPES = [(4096, 129280), (8192, 32768), (16384, 131072)]
ROTATE = 3
# The LM-loss features (``--features``): each timed forward+backward next to the same loss in PyTorch
# under torch.compile and in Liger (its lse_square_scale is the z-loss coefficient).
FEATURES = {
    "z_loss 1e-4": {"z_loss": 1e-4},
    "softcap 30": {"softcap": 30.0},
    "z_loss+softcap+smoothing": {"z_loss": 1e-4, "softcap": 30.0, "label_smoothing": 0.1},
}


def load_liger():
    """Liger's CE autograd Function, or None."""
    return import_liger("ops.cross_entropy", "LigerCrossEntropyFunction")


def ce_inputs(n_rows: int, vocab: int, device: str = "cuda"):
    """(ROTATE equal copies of the bf16 logits, targets, lse, dloss/drow = 1/N) at one shape."""
    torch.manual_seed(0)
    logits = (torch.randn(n_rows, vocab, device=device) * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n_rows,), device=device)
    _, lse = torch.ops.lowp.cross_entropy_fwd(logits, target, 0.0, -100)
    grad_rows = torch.full((n_rows,), 1.0 / n_rows, device=device)
    return [logits] + [logits.clone() for _ in range(ROTATE - 1)], target, lse, grad_rows


def our_kernels(copies, target, lse, grad_rows) -> dict:
    """phase -> (call of our op on the next logits copy, byte floor per element): forward, backward to
    bf16, fused MXFP8."""

    def forward(x):
        return torch.ops.lowp.cross_entropy_fwd(x, target, 0.0, -100)

    def backward(x):
        return torch.ops.lowp.cross_entropy_bwd(x, target, lse, grad_rows, 0.0, -100)

    def backward_mxfp8(x):
        return torch.ops.lowp.cross_entropy_bwd_mxfp8(
            x, target, lse, grad_rows, 0.0, -100, "e4m3", True, True, "compact"
        )

    return {
        "fwd": (rotating(copies, forward), 2),
        "bwd->bf16": (rotating(copies, backward), 4),
        "bwd->mxfp8 row+col": (rotating(copies, backward_mxfp8), 4.0625),
    }


def plain_loss(x, target, z_loss: float = 0.0, softcap: float | None = None, label_smoothing: float = 0.0):
    """The features' loss in plain PyTorch (fp32): soft-capped logits, cross entropy, z · mean(lse²)."""
    x = x.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(x, target, label_smoothing=label_smoothing)
    return loss + z_loss * torch.logsumexp(x, -1).square().mean() if z_loss else loss


def run_shape(n_rows: int, vocab: int, copy_tbs: float, liger, features: bool = False, te=None) -> list[dict]:
    copies, target, lse, grad_rows = ce_inputs(n_rows, vocab)
    elems = n_rows * vocab
    rows = []

    def record(impl: str, phase: str, fn, floor_bytes: float, capturable: bool = True):
        try:
            with ClockWatch() as clock:
                ms = median_ms(fn)
                # A failed capture poisons the process (the H200 run died on the next randn after
                # Liger's), so only cases known to be capturable are captured.
                gpu_ms = graph_ms(fn) if capturable else float("nan")
        except Exception as error:
            print(f"{impl} {phase} failed: {type(error).__name__}: {str(error)[:300]}")
            traceback.print_exc(limit=2)
            return
        tbs = floor_bytes * elems / ms / 1e9
        gpu_pct = 100 * floor_bytes * elems / gpu_ms / 1e9 / copy_tbs
        rows.append(
            {
                "shape": f"{n_rows}x{vocab}",
                "impl": impl,
                "phase": phase,
                "ms": round(ms, 4),
                "graph_ms": round(gpu_ms, 4),
                "floor_B_per_elem": floor_bytes,
                "TBps": round(tbs, 3),
                "pct_copy": round(100 * tbs / copy_tbs, 1),
                "graph_pct_copy": round(gpu_pct, 1),
                "sm_clock_min_mhz": clock.min_mhz,
                "power_capped": clock.power_capped,
            }
        )
        pct = 100 * tbs / copy_tbs
        print(
            f"{n_rows}x{vocab} {impl:14s} {phase:20s} eager {ms:7.3f} ms {tbs:5.2f} TB/s {pct:5.1f}%"
            f" | graph {gpu_ms:7.3f} ms {gpu_pct:5.1f}% | {clock.note()}"
        )

    # ours, op level (no autograd overhead)
    for phase, (fn, floor_bytes) in our_kernels(copies, target, lse, grad_rows).items():
        record("lowp", phase, fn, floor_bytes)

    def unfused(x):
        grad = torch.ops.lowp.cross_entropy_bwd(x, target, lse, grad_rows, 0.0, -100)
        return lowp_ops.mxfp8_quantize(grad)

    record("lowp unfused", "bwd->bf16->mxfp8", rotating(copies, unfused), 4.0625)

    leaves = [x.requires_grad_() for x in copies]  # the same storage: the autograd cases read them only

    def fwd_bwd(loss_fn):
        return rotating(leaves, lambda x: torch.autograd.grad(loss_fn(x, target), x))

    record("lowp", "fwd+bwd bf16", fwd_bwd(lowp_ops.cross_entropy), 6)
    record(
        "lowp",
        "fwd+bwd mxfp8",
        rotating(copies, lambda x: lowp_ops.cross_entropy_with_mxfp8_grad(x.detach(), target)),
        6.0625,
    )

    record("eager", "fwd", rotating(leaves, lambda x: F.cross_entropy(x, target)), 2)
    record("eager", "fwd+bwd bf16", fwd_bwd(F.cross_entropy), 6)

    compiled = torch.compile(lambda x, t: F.cross_entropy(x.float(), t), dynamic=False)
    record("torch.compile", "fwd", rotating(leaves, lambda x: compiled(x, target)), 2)
    record("torch.compile", "fwd+bwd bf16", fwd_bwd(compiled), 6)

    for name, kwargs in FEATURES.items() if features else ():
        record(
            "lowp",
            f"fwd+bwd bf16, {name}",
            fwd_bwd(lambda x, t, kw=kwargs: lowp_ops.cross_entropy(x, t, **kw)),
            6,
        )
        mxfp8 = rotating(
            copies, lambda x, kw=kwargs: lowp_ops.cross_entropy_with_mxfp8_grad(x.detach(), target, **kw)
        )
        record("lowp", f"fwd+bwd mxfp8, {name}", mxfp8, 6.0625)
        plain = torch.compile(lambda x, t, kw=kwargs: plain_loss(x, t, **kw), dynamic=False)
        record("torch.compile", f"fwd+bwd bf16, {name}", fwd_bwd(plain), 6)

    # overwrite_logits=True writes the gradient over the logits (scratch copies; a view as the non-leaf,
    # whose gradient autograd hands to its base after the in-place write)
    overwritten = [x.detach().clone().requires_grad_() for x in copies]

    def overwrite_fwd_bwd(x):
        return torch.autograd.grad(lowp_ops.cross_entropy(x.view_as(x), target, overwrite_logits=True), x)

    record("lowp", "fwd+bwd bf16, overwrite_logits", rotating(overwritten, overwrite_fwd_bwd), 6)
    del overwritten

    if te is not None:
        # TE's forward saves a copy of the logits (or, overwrite_input, the logits themselves) and its
        # backward writes the gradient over it; grad_output 1 as a loss's.
        one = torch.ones((), device="cuda")

        def te_fwd_bwd(x, overwrite=False):
            _loss, saved, stats, tgt, count, rank, world = te.cross_entropy_forward(
                x.view(1, n_rows, vocab), target, 0.0, True, None, -100, overwrite
            )
            return te.cross_entropy_backward(saved, stats, tgt, count, one, 0.0, True, rank, world, -100)

        record("TE 2.20.2", "fwd+bwd bf16", rotating(copies, te_fwd_bwd), 6)
        te_scratch = [x.detach().clone() for x in copies]
        te_over = rotating(te_scratch, lambda x: te_fwd_bwd(x, overwrite=True))
        record("TE 2.20.2", "fwd+bwd bf16, overwrite_input", te_over, 6)
        del te_scratch

    if liger is not None:
        # Liger computes the gradient in the forward, in place into its input: time forward+backward,
        # on scratch copies (its in-place writes must not reach the logits above).
        del leaves
        scratch = [x.detach().clone().requires_grad_() for x in copies]

        def liger_fwd_bwd(x, z_loss=0.0, softcap=None, label_smoothing=0.0):
            loss = liger.apply(x, target, None, -100, z_loss, label_smoothing, "mean", softcap)[0]
            return torch.autograd.grad(loss, x)

        # Liger's forward synchronizes with the host: not capturable, eager timing only.
        record("liger", "fwd+bwd bf16", rotating(scratch, liger_fwd_bwd), 6, capturable=False)
        for name, kwargs in FEATURES.items() if features else ():
            liger_case = rotating(scratch, lambda x, kw=kwargs: liger_fwd_bwd(x, **kw))
            record("liger", f"fwd+bwd bf16, {name}", liger_case, 6, capturable=False)
    return rows


def run_sustained(n_rows: int, vocab: int, seconds: float) -> list[dict]:
    """Our forward and both backwards, each back to back for ``seconds``, against a copy of as many
    bytes as the MXFP8 backward moves, run back to back as eager calls (replayed from a CUDA graph the
    same copy_ measured 2.7 TB/s against 4.27 eager on the H200, 2026-11-30)."""
    copies, target, lse, grad_rows = ce_inputs(n_rows, vocab)
    elems = n_rows * vocab
    src = torch.empty(int(4.0625 * elems) // 4, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms, copy_clock = sustained_ms(lambda: dst.copy_(src), seconds, graph=False)
    copy_tbs = 2 * src.numel() * 2 / copy_ms / 1e9
    print(
        f"{n_rows}x{vocab} sustained copy {copy_ms:.4f} ms {copy_tbs:.3f} TB/s,"
        f" median {copy_clock.median_mhz} MHz"
    )
    rows = []
    for phase, (fn, floor_bytes) in our_kernels(copies, target, lse, grad_rows).items():
        ms, clock = sustained_ms(fn, seconds)
        pct = 100 * floor_bytes * elems / ms / 1e9 / copy_tbs
        rows.append(
            {
                "shape": f"{n_rows}x{vocab}",
                "phase": phase,
                "sustained_ms": round(ms, 4),
                "sustained_pct_copy": round(pct, 1),
                "copy_TBps": round(copy_tbs, 3),
                "median_sm_mhz": clock.median_mhz,
                "min_sm_mhz": clock.min_mhz,
                "power_capped": clock.power_capped,
            }
        )
        print(
            f"{n_rows}x{vocab} sustained {phase:20s} {ms:.4f} ms {pct:5.1f}%"
            f" | median {clock.median_mhz} MHz, lowest {clock.note()}"
        )
    return rows


def check_contract(n_rows: int = 1024, vocab: int = 32768) -> bool:
    """The fused MXFP8 gradient equals mxfp8_quantize(bf16 gradient), byte for byte, on this GPU."""
    logits = (torch.randn(n_rows, vocab, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    leaf = logits.clone().requires_grad_()
    (grad,) = torch.autograd.grad(lowp_ops.cross_entropy(leaf, target, classes_last=True), leaf)
    expected = lowp_ops.mxfp8_quantize(grad)
    _, fused = lowp_ops.cross_entropy_with_mxfp8_grad(logits, target)
    pairs = [
        (fused.row_data, expected.row_data),
        (fused.row_scale, expected.row_scale),
        (fused.col_data, expected.col_data),
        (fused.col_scale, expected.col_scale),
    ]
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", default=None, help="e.g. 4096x129280,8192x32768")
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS", help="also back to back")
    parser.add_argument("--sustained-only", action="store_true", help="only the back-to-back measurements")
    parser.add_argument("--features", action="store_true", help="also z-loss, softcap and smoothing rows")
    parser.add_argument(
        "--te-site",
        default=os.environ.get("LOWP_BENCH_TE_SITE"),
        help="a folder with a TransformerEngine wheel installed (pip --target): adds TE's Triton CE",
    )
    args = parser.parse_args()
    shapes = (
        SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    )
    seconds = args.sustained or (2.0 if args.sustained_only else 0.0)

    def run_all_sustained() -> list[dict]:
        if not seconds:
            return []
        return [row for n_rows, vocab in shapes for row in run_sustained(n_rows, vocab, seconds)]

    if args.sustained_only:
        sustained = run_all_sustained()
        write_json(
            "bench_cross_entropy_sustained.json", {"env": environment(), "sustained": sustained}, args.json
        )
        return
    copy_ms, copy_tbs = copy_bandwidth_tbs()
    print(f"copy 2 GiB: {copy_ms:.3f} ms = {copy_tbs:.2f} TB/s")
    contract = check_contract()
    print(f"fused MXFP8 gradient == mxfp8_quantize(bf16 gradient): {contract}")
    liger = load_liger()
    te = import_te_triton_cross_entropy(args.te_site)
    rows = []
    for n_rows, vocab in shapes:
        rows += run_shape(n_rows, vocab, copy_tbs, liger, args.features, te)
        torch.cuda.empty_cache()
    sustained = run_all_sustained()
    print(
        "\n| shape | impl | phase | eager ms | eager % copy | CUDA-graph ms | graph % copy (floor B/elem) "
        "| lowest SM clock |"
        "\n|---|---|---|---:|---:|---:|---:|---|"
    )
    for r in rows:
        clock = "" if r["sm_clock_min_mhz"] is None else f"{r['sm_clock_min_mhz']} MHz"
        clock += " capped" if r["power_capped"] else ""
        print(
            f"| {r['shape']} | {r['impl']} | {r['phase']} | {r['ms']:.3f} | {r['pct_copy']:.1f} "
            f"| {r['graph_ms']:.3f} | {r['graph_pct_copy']:.1f} ({r['floor_B_per_elem']}) | {clock} |"
        )
    write_json(
        "bench_cross_entropy.json",
        {
            "env": environment(),
            "copy_TBps": copy_tbs,
            "copy_ms": copy_ms,
            "contract_bytes_equal": contract,
            "rows": rows,
            "sustained": sustained,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
