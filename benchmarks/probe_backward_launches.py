"""What one more Triton launch in a Python backward costs the host, and what the grouped MLP's backward
would save without its bookkeeping launches (group ends, zeroing of rows past the last end).

Rows: an ``autograd.Function`` whose backward makes 0, 1, 2, 4 or 8 launches of a one-block copy kernel
(``cached_launch``, as the library's kernels), fwd+bwd on autograd's worker thread and on the caller's
thread; then ``grouped_swiglu_mlp`` bf16 fwd+bwd (the ``bench_host_overhead.py`` case) as it is and with
those launches skipped in its backward only (stubs: the numbers are a bound, not a result).

    python benchmarks/probe_backward_launches.py [--calls 100] [--repeats 7]
"""

from __future__ import annotations

import argparse
import threading

import torch
import triton
import triton.language as tl

import lowp_ops
from lowp_ops.kernels import grouped_mm, split_sizes
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

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, experts, hidden, ffn = 512, 8, 1024, 512

    def randn(*shape):
        t = torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
        return t.requires_grad_(True)

    xt, w1, w2 = randn(tokens, hidden), randn(experts, 2 * ffn, hidden), randn(experts, hidden, ffn)
    probs = torch.rand(tokens, device="cuda", generator=gen).requires_grad_(True)
    splits = torch.tensor([64, 32, 96, 64, 0, 128, 64, 64], device="cuda", dtype=torch.int32)

    def mlp_step():
        for leaf in (xt, w1, w2, probs):
            leaf.grad = None
        y = lowp_ops.grouped_swiglu_mlp(xt, w1, w2, splits, probs)
        y.backward(torch.ones_like(y))

    main_thread = threading.main_thread()
    real_zero, real_ends = grouped_mm.zero_rows_past, split_sizes.launch_group_ends
    last_ends: dict = {}

    def zero_in_forward_only(out, ends):
        return real_zero(out, ends) if threading.current_thread() is main_thread else out

    def ends_once(sizes, rows):
        if threading.current_thread() is main_thread:
            last_ends["ends"] = real_ends(sizes, rows)
        return last_ends["ends"]

    print("grouped_swiglu_mlp bf16 fwd+bwd T512 E8 | host us")
    print(f"as it is | {run(mlp_step):.1f}")
    grouped_mm.zero_rows_past = zero_in_forward_only
    print(f"no zeroing launch in the backward | {run(mlp_step):.1f}")
    split_sizes.launch_group_ends = ends_once
    print(f"... and no group-ends launch in the backward | {run(mlp_step):.1f}")
    grouped_mm.zero_rows_past, split_sizes.launch_group_ends = real_zero, real_ends
    print(f"as it is, again | {run(mlp_step):.1f}")


if __name__ == "__main__":
    main()
