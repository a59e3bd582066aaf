"""Probe: host cost of a Triton launch made inside a Python autograd backward, which runs on autograd's
CUDA worker thread (``python benchmarks/probe_autograd_thread.py`` on a CUDA machine).

Variants of one softmax forward + backward: the backward calls the launcher (Python work: checks,
allocation, key, launch); or only allocates and calls the compiled binary's launcher with arguments
bound in the forward; or does nothing (identity). Also the same launcher on the main thread."""

import time

import torch
from _common import gpu_script_args

from lowp_ops import library
from lowp_ops.kernels import softmax as softmax_kernels

gpu_script_args(__doc__)


def us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) / n * 1e6


class FullLauncher(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = library.softmax_fwd.launcher()(x, False, "nan")
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return library.softmax_bwd.launcher()(y, g, False)


def bound_backward_launch(y):
    """Everything but the gradient and output pointers, resolved on the main thread."""
    kernel = softmax_kernels.softmax_bwd_kernel
    dx = torch.empty_like(y)
    block = softmax_kernels.row_block(y.shape[1])
    kernel[(y.shape[0],)](y, y, dx, y.shape[1], BLOCK=block, LOG=False)  # compiles / caches the binary
    binary, run, function = next(v for v in kernel._binaries.values() if v is not None)
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    rows, cols = y.shape
    return lambda g, out: run(
        rows, 1, 1, stream, function, binary.packed_metadata, None, None, None, y, g, out, cols, block, False
    )


class BoundLaunch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = library.softmax_fwd.launcher()(x, False, "nan")
        ctx.launch = bound_backward_launch(y)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        out = torch.empty_like(y)
        ctx.launch(g, out)
        return out


def identity_with_backward(body):
    """``apply`` of an autograd Function whose forward is a view of its input and whose backward
    returns ``body(grad)`` (a Python backward, run where autograd runs it)."""

    class ViewWithBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v.view_as(v)

        @staticmethod
        def backward(ctx, grad):
            return body(grad)

    return ViewWithBackward.apply


x = torch.randn(256, 4096, device="cuda", requires_grad=True)
g = torch.ones(256, 4096, device="cuda")


def step(fn):
    def run():
        x.grad = None
        fn(x).backward(g)

    return run


for name, fn in (
    ("torch.softmax", lambda v: torch.softmax(v, -1)),
    ("identity backward", identity_with_backward(lambda grad: grad)),
    ("launcher in backward", FullLauncher.apply),
    ("bound launch in backward", BoundLaunch.apply),
):
    print(f"{name:28s} fwd+bwd {us(step(fn)):7.1f} us")
y = torch.softmax(x.detach(), -1)
print(f"{'launcher, main thread':28s} {us(lambda: library.softmax_bwd.launcher()(y, g, False)):7.1f} us")
launch = bound_backward_launch(y)
print(f"{'bound launch, main thread':28s} {us(lambda: launch(g, torch.empty_like(y))):7.1f} us")

# Where the worker thread's time goes: the same three pieces timed from inside the backward (autograd's
# CUDA worker thread) and on the main thread. Pure Python slower there too points at the interpreter
# (thread switches, GIL hand-offs), not at CUDA or Triton.
segments = {"python loop": lambda: sum(range(300)), "torch.empty_like": lambda: torch.empty_like(y)}
segments["launcher"] = lambda: library.softmax_bwd.launcher()(y, g, False)
inside: dict[str, list[float]] = {name: [] for name in segments}


def time_segments(grad):
    for name, piece in segments.items():
        start = time.perf_counter()
        piece()
        inside[name].append(time.perf_counter() - start)
    return grad


us(step(identity_with_backward(time_segments)))
for name, piece in segments.items():
    worker = sorted(inside[name])[len(inside[name]) // 2] * 1e6
    print(f"{name:28s} worker thread {worker:7.1f} us, main thread {us(piece):7.1f} us (medians / means)")
with torch.autograd.set_multithreading_enabled(False):
    print(f"{'launcher in backward, no worker thread':40s} fwd+bwd {us(step(FullLauncher.apply)):7.1f} us")

# Where around the backward the time goes: timestamps before ``.backward()`` (main thread), at the
# start and at the end of the Python backward (the thread it runs on), after ``.backward()`` returns.
# The medians of the three gaps, for backwards that launch nothing, an aten kernel, a Triton kernel.
marks: dict[str, float] = {}


def stamped(body):
    def with_marks(grad):
        marks["begin"] = time.perf_counter()
        out = body(grad)
        marks["end"] = time.perf_counter()
        return out

    return identity_with_backward(with_marks)


def gaps(fn, n=300) -> str:
    rows = []
    for i in range(n + 20):
        x.grad = None
        out = fn(x)
        start = time.perf_counter()
        out.backward(g)
        done = time.perf_counter()
        if i >= 20:
            rows.append((marks["begin"] - start, marks["end"] - marks["begin"], done - marks["end"]))
    torch.cuda.synchronize()
    medians = [sorted(col)[len(col) // 2] * 1e6 for col in zip(*rows, strict=True)]
    return "to the backward {:7.1f} us, inside {:7.1f} us, back to the caller {:7.1f} us".format(*medians)


bodies = {
    "nothing": lambda grad: grad,
    "aten mul": lambda grad: grad * 2,
    "Triton launcher": lambda grad: library.softmax_bwd.launcher()(y, grad, False),
}
print("threads:", [t.name for t in __import__("threading").enumerate()])
for threads in (True, False):
    with torch.autograd.set_multithreading_enabled(threads):
        for name, body in bodies.items():
            where = "worker thread" if threads else "caller thread"
            print(f"{name:16s} {where:14s} {gaps(stamped(body))}")
