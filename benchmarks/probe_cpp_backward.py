"""Host time of ``cross_entropy`` fwd+bwd with its eager recorded backward (C++ autograd nodes,
docs/dispatch.md#recorded-backward) against the same call on the kernels' backward (a Python node) and
``F.cross_entropy``, in one run (CUDA, bf16, mean).

Rows: the public call each way; each way's backward alone (``retain_graph=True`` is not used: a fresh
forward per call, the forward timed alone and subtracted is the reader's); and a floor, an
``autograd.Function`` whose forward makes no launch and whose backward returns a saved tensor.

    python benchmarks/probe_cpp_backward.py [--rows 512] [--classes 32000] [--calls 100] [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import lowp_ops
from lowp_ops import library

try:
    from bench_host_overhead import alternating_host_and_wall_us
except ImportError:  # run from the repository root
    from benchmarks.bench_host_overhead import alternating_host_and_wall_us


class _SavedGradient(torch.autograd.Function):
    """The floor of a Python loss node: no launch either way, the backward returns a saved tensor."""

    @staticmethod
    def forward(ctx, logits, grad, loss):
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, _g):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--classes", type=int, default=32000)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.rows, args.classes)
    leaf = torch.randn(shape, device="cuda", generator=gen).bfloat16().requires_grad_()
    target = torch.randint(0, args.classes, (args.rows,), device="cuda", generator=gen)
    saved_grad, zero = torch.empty_like(leaf.detach()), torch.zeros((), device="cuda")

    def fwd_bwd(forward):
        def call():
            leaf.grad = None
            forward().backward()

        return call

    def kernel_backward():
        limit = library.RECORDED_BACKWARD_MAX_ELEMENTS
        library.RECORDED_BACKWARD_MAX_ELEMENTS = -1
        try:
            return lowp_ops.cross_entropy(leaf, target)
        finally:
            library.RECORDED_BACKWARD_MAX_ELEMENTS = limit

    cases = {
        "F.cross_entropy fwd+bwd": fwd_bwd(lambda: F.cross_entropy(leaf, target)),
        "lowp cross_entropy fwd+bwd, recorded backward": fwd_bwd(
            lambda: lowp_ops.cross_entropy(leaf, target)
        ),
        "lowp cross_entropy fwd+bwd, kernel backward": fwd_bwd(kernel_backward),
        "floor: Python node, no launch, fwd+bwd": fwd_bwd(
            lambda: _SavedGradient.apply(leaf, saved_grad, zero)
        ),
        "F.cross_entropy fwd": lambda: F.cross_entropy(leaf, target),
        "lowp cross_entropy fwd, recorded backward": lambda: lowp_ops.cross_entropy(leaf, target),
        "lowp cross_entropy fwd, kernel backward": kernel_backward,
    }
    names = list(cases)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {shape} bf16, host us per call")
    results = alternating_host_and_wall_us([cases[k] for k in names], args.calls, args.repeats)
    for name, (host, wall) in zip(names, results, strict=True):
        print(f"{name:48s} host {host:8.1f}  wall {wall:8.1f}")


if __name__ == "__main__":
    main()
