"""The cross entropy with the gradient written over the logits (``overwrite_logits=True``): the one-pass
kernel (``cross_entropy_single_pass``, rows of at most 8192 classes) against the forward, reduction and
in-place backward it replaces. CUDA-graph GPU time and % of a same-run copy at each variant's byte
floor (bf16: forward 2, two passes 6, one pass 4 bytes per element); wider rows show the fallback.

    python benchmarks/probe_single_pass.py [--shapes 16384x8192,8192x8000]
"""

from __future__ import annotations

import argparse

import torch
from _common import copy_bandwidth_tbs, graph_ms, rotating

from lowp_ops.kernels import cross_entropy as ce
from lowp_ops.kernels import cross_entropy_single_pass as single


def variants(target):
    return {
        "forward alone": (lambda v: ce.launch_cross_entropy_fwd(v, target, 0.0, -100), 2.0),
        "two passes, mean": (lambda v: single._two_passes(v, target, 0.0, -100, "mean", None, 0.0, 0.0), 6.0),
        "one pass, mean": (lambda v: single.launch_cross_entropy_fwd_bwd_(v, target, 0.0, -100, "mean"), 4.0),
        "one pass, none": (lambda v: single.launch_cross_entropy_fwd_bwd_(v, target, 0.0, -100, "none"), 4.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="16384x8192,8192x8000,65536x2048,32768x4096,8192x32000")
    args = parser.parse_args()
    _, copy_tbs = copy_bandwidth_tbs()
    print(f"copy {copy_tbs:.3f} TB/s")
    for shape in args.shapes.split(","):
        n, v = map(int, shape.split("x"))
        torch.manual_seed(0)
        x = (torch.randn(n, v, device="cuda") * 3).to(torch.bfloat16)
        target = torch.randint(0, v, (n,), device="cuda")
        copies = [x] + [x.clone() for _ in range(3)]
        for name, (fn, bytes_per_elem) in variants(target).items():
            ms = graph_ms(rotating(copies, fn))
            tbs = bytes_per_elem * n * v / ms / 1e9
            print(f"{shape:>12} {name:<20} {ms:8.4f} ms {100 * tbs / copy_tbs:6.1f}% of copy", flush=True)
    name = single.cross_entropy_fwd_bwd_kernel.jit_function.fn.__name__
    for key, entry in single.cross_entropy_fwd_bwd_kernel._binaries.items():
        if entry is not None:
            binary = entry[0]
            print(f"{name} {dict(key[2])}: {binary.n_regs} registers, {binary.n_spills} spilled")


if __name__ == "__main__":
    main()
