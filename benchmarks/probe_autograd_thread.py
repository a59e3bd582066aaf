"""Probe: where a Triton launch inside a Python autograd backward on the CUDA engine thread spends
host time (``python benchmarks/probe_autograd_thread.py`` on a CUDA machine)."""

import cProfile
import io
import pstats
import time

import torch

from lowp_ops import library

PROFILE = cProfile.Profile()
INSIDE = []


class LaunchesSoftmaxBwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = library.softmax_fwd.launcher()(x, False, "nan")
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        start = time.perf_counter()
        PROFILE.enable()
        out = library.softmax_bwd.launcher()(y, g, False)
        PROFILE.disable()
        INSIDE.append(time.perf_counter() - start)
        return out


x = torch.randn(256, 4096, device="cuda", requires_grad=True)
g = torch.ones(256, 4096, device="cuda")


def step():
    x.grad = None
    LaunchesSoftmaxBwd.apply(x).backward(g)


for _ in range(20):
    step()
torch.cuda.synchronize()
INSIDE.clear()
n = 300
s = time.perf_counter()
for _ in range(n):
    step()
e = time.perf_counter()
torch.cuda.synchronize()
inside_us = sum(INSIDE) / len(INSIDE) * 1e6
print(f"fwd+bwd {(e - s) / n * 1e6:.1f} us; launcher inside backward {inside_us:.1f} us")
s = time.perf_counter()
for _ in range(n):
    library.softmax_bwd.launcher()(x.detach(), g, False)
e = time.perf_counter()
torch.cuda.synchronize()
print(f"launcher in main thread {(e - s) / n * 1e6:.1f} us")
out = io.StringIO()
pstats.Stats(PROFILE, stream=out).sort_stats("tottime").print_stats(20)
print(out.getvalue())
