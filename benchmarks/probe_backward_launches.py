"""What each Triton launch in a Python backward costs the host.

Rows: an ``autograd.Function`` whose backward makes 0, 1, 2, 4 or 8 launches of a one-block copy kernel
(``cached_launch``, as the library's kernels), fwd+bwd on autograd's worker thread and on the caller's
thread (``torch.autograd.set_multithreading_enabled(False)``).

    python benchmarks/probe_backward_launches.py [--calls 100] [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from lowp_ops.kernels.launch import cached_launch

try:
    from bench_host_overhead import host_and_wall_us
except ImportError:  # run from the repository root
    from benchmarks.bench_host_overhead import host_and_wall_us


@cached_launch
@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def _launches_in_backward(count: int):
    class _Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sum()

        @staticmethod
        def backward(ctx, grad):
            src = torch.empty(1024, device="cuda")
            for _ in range(count):
                _copy_kernel[(1,)](src, src, 1024, BLOCK=1024)
            return grad.expand(256, 1024)

    return _Node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    x = torch.zeros(256, 1024, device="cuda", requires_grad=True)

    def run(fn) -> float:
        return host_and_wall_us(fn, args.calls, args.repeats)[0]

    print("launches in the backward | fwd+bwd us, worker thread | caller's thread")
    for count in (0, 1, 2, 4, 8):
        node = _launches_in_backward(count)

        def step(node=node):
            x.grad = None
            node.apply(x).backward()

        worker = run(step)
        with torch.autograd.set_multithreading_enabled(False):
            caller = run(step)
        print(f"{count} | {worker:.1f} | {caller:.1f}")


if __name__ == "__main__":
    main()
