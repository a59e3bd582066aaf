"""The host time of ``cross_entropy``'s pieces, each timed alone (512 x 32000 bf16, CUDA).

Each row is one callable timed as ``bench_host_overhead.py`` times a call (calls back to back, one
synchronize at the end, median of loops): the public call, the launchers the op runs, their output
allocation, the bare Triton launch, the backward alone (``retain_graph=True``, on the caller's thread and
on autograd's worker thread), and floors: an ``autograd.Function`` whose forward makes one Triton launch
(a copy kernel) and whose backward makes one Triton launch, one aten launch, or none, each launch made
through Triton's own launch path and, as the library makes it, through a bound launch
(``kernels.launch.CachedLaunch.bind``).
``probe_autograd_thread.py`` times such backwards around a view (softmax shapes, no forward launch);
these floors are loss-shaped and timed in the same run as ``F.cross_entropy``, which the targets name.

    python benchmarks/probe_ce_host_pieces.py [--calls 200] [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import lowp_ops
from lowp_ops import library
from lowp_ops.kernels import cross_entropy as ce
from lowp_ops.kernels.launch import CachedLaunch
from lowp_ops.meta.cross_entropy import cross_entropy_fwd_outputs

try:
    from bench_host_overhead import host_and_wall_us
except ImportError:  # run from the repository root
    from benchmarks.bench_host_overhead import host_and_wall_us


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def _copy(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _copy_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


_BOUND_COPIES: dict = {}


def _bound_copy(x: torch.Tensor) -> torch.Tensor:
    """``_copy`` through a bound launch, one per element count (the library's launch path)."""
    out = torch.empty_like(x)
    launch = _BOUND_COPIES.get(x.numel())
    if launch is None:
        launch = CachedLaunch(_copy_kernel).bind((triton.cdiv(x.numel(), 1024),), BLOCK=1024)
        _BOUND_COPIES[x.numel()] = launch
    launch(x, out, x.numel())
    return out


def _one_launch_each(copy, name: str) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` whose forward and backward each make one launch of ``copy`` (``_copy``:
    Triton's launch path; ``_bound_copy``: the library's): the floor of a Python loss node."""

    def forward(ctx, x):
        return copy(x[:1].float()).sum()

    def backward(ctx, grad):
        return copy(torch.empty((512, 32000), device="cuda", dtype=torch.bfloat16))

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), namespace)


_OneLaunchEach = _one_launch_each(_copy, "_OneLaunchEach")
_BoundLaunchEach = _one_launch_each(_bound_copy, "_BoundLaunchEach")


class _LaunchInForwardOnly(torch.autograd.Function):
    """Forward: one Triton launch; backward: returns a tensor made in the forward (no launch)."""

    @staticmethod
    def forward(ctx, x):
        ctx.grad = torch.empty((512, 32000), device="cuda", dtype=torch.bfloat16)
        return _copy(x[:1].float()).sum()

    @staticmethod
    def backward(ctx, grad):
        return ctx.grad


class _AtenInBackward(_LaunchInForwardOnly):
    """Forward: one Triton launch; backward: one aten launch (``mul``) from Python."""

    @staticmethod
    def backward(ctx, grad):
        return ctx.grad.mul(grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(512, 32000, device="cuda", generator=gen).bfloat16().requires_grad_()
    plain = logits.detach()
    target = torch.randint(0, 32000, (512,), device="cuda", generator=gen)
    loss_rows, stats = ce.launch_cross_entropy_fwd(plain, target, 0.0, -100)
    _, grad_scale = ce.launch_cross_entropy_reduce(loss_rows, target, -100, True)
    grad_rows = grad_scale.expand(512)
    ours = lowp_ops.cross_entropy(logits, target)
    theirs = F.cross_entropy(logits, target)
    floor = _OneLaunchEach.apply(logits)

    def backward(loss):
        def call():
            logits.grad = None
            loss.backward(retain_graph=True)

        return call

    def one_thread(fn):
        def call():
            with torch.autograd.set_multithreading_enabled(False):
                fn()

        return call

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()

        return call

    def fwd_bwd(fn):
        def call():
            logits.grad = None
            fn().backward()

        return call

    pieces = {
        "F.cross_entropy fwd, no_grad": no_grad(lambda: F.cross_entropy(logits, target)),
        "F.cross_entropy fwd+bwd": fwd_bwd(lambda: F.cross_entropy(logits, target)),
        "F.cross_entropy bwd alone": backward(theirs),
        "F.cross_entropy bwd alone, caller thread": one_thread(backward(theirs)),
        "lowp cross_entropy fwd, no_grad": no_grad(lambda: lowp_ops.cross_entropy(logits, target)),
        "lowp cross_entropy fwd, graph": lambda: lowp_ops.cross_entropy(logits, target),
        "lowp cross_entropy fwd+bwd": fwd_bwd(lambda: lowp_ops.cross_entropy(logits, target)),
        "lowp cross_entropy_loss (library)": lambda: library.cross_entropy_loss(
            logits, target, 0.0, -100, "mean"
        ),
        "lowp bwd alone": backward(ours),
        "lowp bwd alone, caller thread": one_thread(backward(ours)),
        "launch_cross_entropy_fwd": lambda: ce.launch_cross_entropy_fwd(plain, target, 0.0, -100),
        "cross_entropy_fwd_outputs (allocation)": lambda: cross_entropy_fwd_outputs(
            plain, target, 0.0, -100, None, 0.0, 0.0
        ),
        "launch_cross_entropy_reduce": lambda: ce.launch_cross_entropy_reduce(loss_rows, target, -100, True),
        "launch_cross_entropy_bwd": lambda: ce.launch_cross_entropy_bwd(
            plain, target, stats, grad_rows, 0.0, -100
        ),
        "grad_loss.float() * grad_scale": lambda: torch.ones((), device="cuda").float() * grad_scale,
        "torch.empty_like(logits)": lambda: torch.empty_like(plain),
        "floor: Function, 1 launch fwd + 1 bwd, fwd+bwd": fwd_bwd(lambda: _OneLaunchEach.apply(logits)),
        "floor bwd alone": backward(floor),
        "floor bwd alone, caller thread": one_thread(backward(floor)),
        "floor fwd alone, graph": lambda: _OneLaunchEach.apply(logits),
        "floor, bound launches: fwd+bwd": fwd_bwd(lambda: _BoundLaunchEach.apply(logits)),
        "floor, bound launches: fwd+bwd, caller thread": one_thread(
            fwd_bwd(lambda: _BoundLaunchEach.apply(logits))
        ),
        "floor, bound launches: fwd, no_grad": no_grad(lambda: _BoundLaunchEach.apply(logits)),
        "no launch in bwd: fwd+bwd": fwd_bwd(lambda: _LaunchInForwardOnly.apply(logits)),
        "no launch in bwd: fwd+bwd, caller thread": one_thread(
            fwd_bwd(lambda: _LaunchInForwardOnly.apply(logits))
        ),
        "aten mul in bwd: fwd+bwd": fwd_bwd(lambda: _AtenInBackward.apply(logits)),
        "aten mul in bwd: fwd+bwd, caller thread": one_thread(fwd_bwd(lambda: _AtenInBackward.apply(logits))),
        "floor fwd+bwd, caller thread": one_thread(fwd_bwd(lambda: _OneLaunchEach.apply(logits))),
        "lowp cross_entropy fwd+bwd, caller thread": one_thread(
            fwd_bwd(lambda: lowp_ops.cross_entropy(logits, target))
        ),
        "one Triton launch (copy kernel)": lambda: _copy(plain),
        "one bound launch (copy kernel)": lambda: _bound_copy(plain),
    }
    print(f"{'piece':<48} {'host us':>9} {'wall us':>9}")
    for name, fn in pieces.items():
        host, wall = host_and_wall_us(fn, args.calls, args.repeats)
        print(f"{name:<48} {host:9.1f} {wall:9.1f}", flush=True)


if __name__ == "__main__":
    main()
