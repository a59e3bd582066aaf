"""Where the host time of one loss call goes: the same call cut into phases, ours next to PyTorch's.

For ``cross_entropy`` (512 x 32000 bf16) and ``cross_entropy_with_mxfp8_grad``, host us per call of:
the forward under ``torch.no_grad()``, the forward recording the autograd graph (no backward), the
forward and backward, and the forward and backward with autograd's multithreading off (the backward on
the calling thread, not autograd's CUDA worker thread). Method as ``bench_host_overhead.py`` (calls back
to back, one synchronize at the end, median of loops).

    python benchmarks/probe_host_phases.py [--calls 200] [--repeats 7] [--one-core]

``--one-core`` runs every thread on one CPU core: if the backward's cost on autograd's worker thread
falls to the caller-thread figure there, what it pays is the hand-off between cores (caches, wake-ups),
not the work.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import lowp_ops

try:
    from bench_host_overhead import host_and_wall_us
except ImportError:  # run from the repository root
    from benchmarks.bench_host_overhead import host_and_wall_us


def phases(loss_fn, logits: torch.Tensor) -> dict[str, object]:
    """Host-time callables of the phases of ``loss_fn(logits)`` (a scalar loss)."""

    def no_grad():
        with torch.no_grad():
            loss_fn(logits)

    def forward_only():
        loss_fn(logits)

    def forward_backward():
        logits.grad = None
        loss_fn(logits).backward()

    def forward_backward_one_thread():
        with torch.autograd.set_multithreading_enabled(False):
            forward_backward()

    return {
        "fwd, no_grad": no_grad,
        "fwd, graph recorded": forward_only,
        "fwd+bwd": forward_backward,
        "fwd+bwd, backward on the caller's thread": forward_backward_one_thread,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--one-core", action="store_true", help="pin the process (autograd's worker thread too) to one core"
    )
    args = parser.parse_args()
    if args.one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(f"pinned to core {min(os.sched_getaffinity(0))}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(512, 32000, device=device, generator=gen).bfloat16().requires_grad_()
    target = torch.randint(0, 32000, (512,), device=device, generator=gen)
    grad_loss = torch.ones((), device=device)
    losses = {
        "F.cross_entropy": lambda x: F.cross_entropy(x, target),
        "lowp cross_entropy": lambda x: lowp_ops.cross_entropy(x, target),
    }
    print(f"{'loss':<22} {'phase':<42} {'host us':>9} {'wall us':>9}")
    for name, loss_fn in losses.items():
        for phase, fn in phases(loss_fn, logits).items():
            host, wall = host_and_wall_us(fn, args.calls, args.repeats)
            print(f"{name:<22} {phase:<42} {host:9.1f} {wall:9.1f}")
    detached = logits.detach()
    host, wall = host_and_wall_us(
        lambda: lowp_ops.cross_entropy_with_mxfp8_grad(detached, target, grad_loss), args.calls, args.repeats
    )
    print(f"{'lowp ce_with_mxfp8':<22} {'loss and MXFP8 gradient (no autograd)':<42} {host:9.1f} {wall:9.1f}")
    host, wall = host_and_wall_us(lambda: torch.empty_like(detached), args.calls, args.repeats)
    print(f"{'torch.empty_like':<22} {'one allocation (no launch)':<42} {host:9.1f} {wall:9.1f}")
    host, wall = host_and_wall_us(lambda: detached.abs().amax(), args.calls, args.repeats)
    print(f"{'x.abs().amax()':<22} {'two aten launches':<42} {host:9.1f} {wall:9.1f}")


if __name__ == "__main__":
    main()
