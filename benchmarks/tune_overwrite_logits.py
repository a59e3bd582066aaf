"""The one-pass in-place cross entropy (``lowp::cross_entropy_overwrite_``) against the two passes it
replaces (``cross_entropy_fwd``, ``cross_entropy_reduce``, ``cross_entropy_bwd_``), GPU time in CUDA-graph
replays over rotating logits copies, as a ratio to a same-run device copy at the one-pass byte floor
(4 B/element: read the logits, write the gradient; the two passes move 6). Sweeps the persistent grid
(programs per SM, or one program per row), the gradient pass's direction and block, the warps (the
forward's bytes depend on them: only the forward kernel's count, 4 at these widths, gives its bytes;
the forward alone is timed at each count); checks every variant's bytes against the two passes'.

    PYTHONPATH=. python3 benchmarks/tune_overwrite_logits.py [--shapes 4096x129280,8192x32768]
"""

from __future__ import annotations

import argparse

import torch
from _common import copy_bandwidth_tbs, graph_ms, rotating

from lowp_ops.kernels import cross_entropy as ce
from lowp_ops.kernels import cross_entropy_overwrite as ow


def two_passes(logits, target):
    loss_rows, stats = ce.launch_cross_entropy_fwd(logits, target, 0.0, -100)
    loss, grad_scale = ce.launch_cross_entropy_reduce(loss_rows, target, -100, True)
    ce.launch_cross_entropy_bwd_(logits, target, stats, grad_scale.expand(logits.shape[0]), 0.0, -100)
    return loss, stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x129280,8192x32768,16384x131072,4096x262144")
    args = parser.parse_args()
    _, copy_tbs = copy_bandwidth_tbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy {copy_tbs:.3f} TB/s, {sms} SMs")
    for shape in args.shapes.split(","):
        rows, vocab = (int(v) for v in shape.split("x"))
        sweep(rows, vocab, copy_tbs, sms)
        torch.cuda.empty_cache()


def sweep(rows: int, vocab: int, copy_tbs: float, sms: int) -> None:
    """Every variant at one shape, printed as it is timed."""
    torch.manual_seed(0)
    base = (torch.randn(rows, vocab, device="cuda") * 3).bfloat16()
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[::7] = -100
    reference = base.clone()
    ref_loss, ref_stats = two_passes(reference, target)
    copies = [base.clone() for _ in range(3)]

    def report(name, fn, floor_bytes):
        ms = graph_ms(rotating(copies, fn))
        pct = 100 * floor_bytes * rows * vocab / ms / 1e9 / copy_tbs
        print(f"{rows}x{vocab} {name}: {ms:.4f} ms, {pct:.1f}% of copy at {floor_bytes} B/elem", flush=True)

    report("two passes (fwd, reduce, bwd_)", lambda x: two_passes(x, target), 6)
    for warps in (4, 8, 16):
        report(
            f"forward alone, {warps} warps",
            lambda x, w=warps: ce.launch_cross_entropy_fwd(x, target, 0.0, -100, num_warps=w),
            2,
        )
    variants = [(p, True, 4096, 4) for p in (1, 2, 3, 4, 6, 8, 0)]
    variants += [(2, False, 4096, 4), (1, False, 4096, 4), (2, True, 2048, 4), (2, True, 8192, 4)]
    variants += [(p, True, 4096, 8) for p in (1, 2, 4)] + [(p, True, 4096, 16) for p in (1, 2)]
    for per_sm, reverse, block, warps in variants:
        programs = min(rows, per_sm * sms) if per_sm else rows
        kwargs = {"programs": programs, "reverse": reverse, "grad_block": block, "num_warps": warps}
        out = base.clone()
        loss, stats = ow.launch_cross_entropy_overwrite_(out, target, 0.0, -100, "mean", **kwargs)
        same = (
            torch.equal(out.view(torch.int16), reference.view(torch.int16))
            and torch.equal(loss.view(torch.int32), ref_loss.view(torch.int32))
            and torch.equal(stats.view(torch.int32), ref_stats.view(torch.int32))
        )
        name = f"one pass, {per_sm or 'row'} per SM, {'reverse' if reverse else 'forward'}, block {block}"
        name += f", {warps} warps"
        report(
            f"{name} (bytes equal: {same})",
            lambda x, kw=kwargs: ow.launch_cross_entropy_overwrite_(x, target, 0.0, -100, "mean", **kw),
            4,
        )


if __name__ == "__main__":
    main()
