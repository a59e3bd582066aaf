"""Cross-entropy kernels on rows that are not 16-byte aligned (V % 8 != 0) next to an aligned neighbour
vocabulary: CUDA-graph GPU time and % of a same-run copy, per kernel and launch variant.

    python benchmarks/probe_unaligned_rows.py [--shapes 8192x50257,8192x50264] [--ncu]

``--ncu``: one launch of each kernel after a warm-up, for ``ncu -k regex:cross_entropy``.
"""

from __future__ import annotations

import argparse

import torch
from _common import ce_probe_inputs, copy_bandwidth_tbs, graph_ms, rotating

from lowp_ops.kernels import cross_entropy as ce


def variants(x, target, stats, grad_rows):
    return {
        "fwd": (lambda v: ce.launch_cross_entropy_fwd(v, target, 0.0, -100), 2.0),
        "bwd->bf16": (lambda v: ce.launch_cross_entropy_bwd(v, target, stats, grad_rows, 0.0, -100), 4.0),
        "bwd->bf16 tile": (
            lambda v: ce.launch_cross_entropy_bwd(v, target, stats, grad_rows, 0.0, -100, by_row=False),
            4.0,
        ),
        "bwd->mxfp8 gluon": (
            lambda v: ce.launch_cross_entropy_bwd_mxfp8(
                v, target, stats, grad_rows, 0.0, -100, "e4m3", True, True, "compact", gluon=True
            ),
            4.0625,
        ),
        "bwd->mxfp8 gluon swizzled": (
            lambda v: ce.launch_cross_entropy_bwd_mxfp8(
                v, target, stats, grad_rows, 0.0, -100, "e4m3", True, True, "swizzled", gluon=True
            ),
            4.0625,
        ),
        "bwd->mxfp8 triton": (
            lambda v: ce.launch_cross_entropy_bwd_mxfp8(
                v, target, stats, grad_rows, 0.0, -100, "e4m3", True, True, "compact", gluon=False
            ),
            4.0625,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x50257,8192x50264,8192x32001,8192x32000,4096x129280")
    parser.add_argument("--ncu", action="store_true")
    args = parser.parse_args()
    _, copy_tbs = (0.0, 0.0) if args.ncu else copy_bandwidth_tbs()
    print(f"copy {copy_tbs:.3f} TB/s")
    for shape in args.shapes.split(","):
        n, v, x, target, stats = ce_probe_inputs(shape)
        grad_rows = torch.full((n,), 1.0 / n, device="cuda")
        copies = [x] + [x.clone() for _ in range(3)]
        for name, (fn, bytes_per_elem) in variants(x, target, stats, grad_rows).items():
            if args.ncu:
                fn(x)
                torch.cuda.synchronize()
                fn(x)
                torch.cuda.synchronize()
                continue
            ms = graph_ms(rotating(copies, fn))
            tbs = bytes_per_elem * n * v / ms / 1e9
            print(f"{shape:>14} {name:<20} {ms:8.4f} ms {100 * tbs / copy_tbs:6.1f}% of copy", flush=True)


if __name__ == "__main__":
    main()
