"""The cross entropy with the gradient written over the logits (``overwrite_logits=True``): the one-pass
kernels (``cross_entropy_single_pass``, rows of at most 8192 classes; ``cross_entropy_wide_pass``,
wider rows: one program per row up to 32768 classes, one per 32768-class part past that) against the
forward, reduction and in-place backward they replace. CUDA-graph GPU time and % of a same-run copy at
each variant's byte floor (bf16: forward 2, two passes 6, one pass 4 bytes per element); rows that are
not 16-byte aligned show the fallback.
The LM head's chunk step (per-row gradient factors) the same way, and ``--lm-head N,H,V``: the whole
gradient-in-the-forward schedule (three GEMMs a chunk, explicit chunk) with that step against the
forward and backward launches it replaces.

    python benchmarks/probe_single_pass.py [--shapes 16384x8192,8192x8000] [--lm-head 16384,4096,8192]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial

import torch
from _common import ClockWatch, copy_bandwidth_tbs, graph_ms, rotating

from lowp_ops.kernels import cross_entropy as ce
from lowp_ops.kernels import cross_entropy_single_pass as single
from lowp_ops.kernels import cross_entropy_wide_pass as wide
from lowp_ops.kernels import linear_cross_entropy as lce
from lowp_ops.reference import linear_cross_entropy as lce_ref


def chunk_step_two_launches(logits, target, grad_rows, label_smoothing, ignore_index, *features):
    """The LM head's chunk step as the forward then the in-place backward (what the one pass replaces)."""
    loss, stats = ce.launch_cross_entropy_fwd(logits, target, label_smoothing, ignore_index, *features)
    ce.launch_cross_entropy_bwd_(logits, target, stats, grad_rows, label_smoothing, ignore_index, *features)
    return loss, stats, logits


def variants(target):
    rows = torch.rand(target.shape[0], device=target.device) + 0.5
    chunk_args = (target, rows, 0.0, -100)
    return {
        "forward alone": (lambda v: ce.launch_cross_entropy_fwd(v, target, 0.0, -100), 2.0),
        "two passes, mean": (lambda v: single._two_passes(v, target, 0.0, -100, "mean", None, 0.0, 0.0), 6.0),
        "one pass, mean": (lambda v: single.launch_cross_entropy_fwd_bwd_(v, target, 0.0, -100, "mean"), 4.0),
        "one pass, none": (lambda v: single.launch_cross_entropy_fwd_bwd_(v, target, 0.0, -100, "none"), 4.0),
        "LM-head step, two": (lambda v: chunk_step_two_launches(v, *chunk_args), 6.0),
        "LM-head step, one": (lambda v: single.launch_cross_entropy_rows_fwd_bwd_(v, *chunk_args), 4.0),
    }


def lm_head(n: int, h: int, v: int, chunk: int = 4096, rounds: int = 3) -> None:
    """GPU time of ``linear_cross_entropy_fwd_bwd``'s chunk schedule (bf16 gradient, mean) per step, the
    two schedules alternating ``rounds`` times (a GEMM-heavy step heats the GPU: the later run of a pair
    would otherwise pay the power cap alone), with each round's lowest SM clock."""
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda")
    row_weight = torch.full((), 1 / n, device="cuda").expand(n)
    config = (row_weight, 0.0, -100, "none", "bf16", chunk, True, True)
    two_launches = replace(lce.KERNEL_STEPS, ce_fwd_bwd=chunk_step_two_launches)
    schedules = (("two launches", two_launches), ("one pass", lce.KERNEL_STEPS))
    for round_ in range(rounds):
        for name, steps in schedules if round_ % 2 == 0 else schedules[::-1]:
            with ClockWatch() as clock:
                ms = graph_ms(partial(lce_ref.fwd_bwd_chunks, hidden, weight, target, *config, steps=steps))
            print(f"LM head {n}x{h}x{v} chunk {chunk}, {name:<13} {ms:8.4f} ms  {clock.note()}", flush=True)
    # The chunk step alone on one chunk's logits, stride-0 row factors as the schedule passes them.
    logits = (hidden[:chunk].float() @ weight.float().t()).to(torch.bfloat16)
    copies = [logits] + [logits.clone() for _ in range(3)]
    rows = row_weight[:chunk]
    one_pass = single.launch_cross_entropy_rows_fwd_bwd_
    for name, step in (("two launches", chunk_step_two_launches), ("one pass", one_pass)):
        ms = graph_ms(rotating(copies, lambda x, step=step: step(x, target[:chunk], rows, 0.0, -100)))
        print(f"LM head chunk step {chunk}x{v}, {name:<13} {ms:8.4f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shapes", default="16384x8192,8192x8000,65536x2048,32768x4096,8192x32000,8192x32768,4096x129280"
    )
    parser.add_argument("--lm-head", default="16384,4096,8192", help="N,H,V; empty: skip")
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
            pct = 100 * bytes_per_elem * n * v / ms / 1e9 / copy_tbs
            print(f"{shape:>12} {name:<20} {ms:8.4f} ms {pct:6.1f}% of copy", flush=True)
    if args.lm_head:
        lm_head(*map(int, args.lm_head.split(",")))
    kernels = (
        single.cross_entropy_fwd_bwd_kernel,
        wide.cross_entropy_fwd_bwd_wide_kernel,
        wide.cross_entropy_fwd_bwd_parts_kernel,
    )
    for kernel in kernels:
        name = kernel.jit_function.fn.__name__
        for key, entry in kernel._binaries.items():
            if entry is not None:
                binary = entry[0]
                print(f"{name} {dict(key[2])}: {binary.n_regs} registers, {binary.n_spills} spilled")


if __name__ == "__main__":
    main()
