"""Host time of a custom op inside a ``torch.compile`` graph: ``torch.library.custom_op`` (the graph
calls the op through the dispatcher and its Python kernel) against ``torch.library.triton_op`` (Inductor
launches the op's Triton kernel itself), and where a compiled lowp cross entropy spends its host time.

    python benchmarks/probe_compiled_dispatch.py
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import lowp_ops


@triton.jit
def double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)


def _double_into(x: torch.Tensor, launch) -> torch.Tensor:
    x = x.contiguous()  # the gradient of a sum arrives expanded
    y = torch.empty_like(x)
    n = x.numel()
    launch[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
    return y


@torch.library.custom_op("probe::double_custom", mutates_args=())
def double_custom(x: torch.Tensor) -> torch.Tensor:
    return _double_into(x, double_kernel)


@double_custom.register_fake
def _(x):
    return torch.empty_like(x)


def _no_context(ctx, inputs, output) -> None:
    pass


double_custom.register_autograd(lambda ctx, g: double_custom(g), setup_context=_no_context)


@torch.library.triton_op("probe::double_triton", mutates_args=())
def double_triton(x: torch.Tensor) -> torch.Tensor:
    return _double_into(x, torch.library.wrap_triton(double_kernel))


double_triton.register_autograd(lambda ctx, g: double_triton(g), setup_context=_no_context)


def host_us(fn, calls=100, repeats=7) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def fwd_bwd(f, *args, leaf):
    def step():
        leaf.grad = None
        f(*args).backward()

    return step


def top(fn, calls=50, n=25) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    x = torch.randn(256, 4096, device="cuda", requires_grad=True)
    chains = {
        "3 custom_op": lambda t: double_custom(double_custom(double_custom(t))).sum(),
        "3 triton_op": lambda t: double_triton(double_triton(double_triton(t))).sum(),
        "plain torch": lambda t: (t * 2 * 2 * 2).sum(),
    }
    for mode in ("worker thread", "caller thread"):
        torch.autograd.set_multithreading_enabled(mode == "worker thread")
        for name, f in chains.items():
            compiled = torch.compile(f)
            us = host_us(fwd_bwd(compiled, x, leaf=x), args.calls)
            print(f"{mode:14s} compiled {name:12s} fwd+bwd {us:8.1f} us")

    logits = torch.randn(512, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 32000, (512,), device="cuda")
    losses = {
        "lowp cross_entropy": lambda lg, t: lowp_ops.cross_entropy(lg, t),
        "F.cross_entropy": lambda lg, t: F.cross_entropy(lg.float(), t),
    }
    compiled_losses = {name: torch.compile(f) for name, f in losses.items()}
    for mode in ("worker thread", "caller thread"):
        torch.autograd.set_multithreading_enabled(mode == "worker thread")
        for name, f in compiled_losses.items():
            step = fwd_bwd(f, logits, target, leaf=logits)
            print(f"{mode:14s} compiled {name:20s} fwd+bwd {host_us(step, args.calls):8.1f} us")
            with torch.no_grad():
                us = host_us(lambda f=f: f(logits, target), args.calls)
                print(f"{mode:14s} compiled {name:20s} no_grad  {us:8.1f} us")
    torch.autograd.set_multithreading_enabled(False)
    for name, f in compiled_losses.items():
        print(f"==== cProfile, caller thread, compiled {name} fwd+bwd")
        print(top(fwd_bwd(f, logits, target, leaf=logits)))
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
