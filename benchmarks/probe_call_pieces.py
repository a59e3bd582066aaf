"""Where one eager call's host time goes: the whole call, the call with its Triton launches stubbed out
(the Python around them: checks, allocations, containers), each of its Triton launches replayed alone
with the arguments it was given, and a CUDA allocation, next to ``x.abs().amax()``:

    python benchmarks/probe_call_pieces.py [--calls 200] [--repeats 7]

Host us per call, ``--calls`` back to back before one sync, median of ``--repeats`` loops
(``bench_host_overhead.host_and_wall_us``). Forward-only calls at the shapes of
``bench_host_overhead.py`` (256 x 4096 bf16).
"""

from __future__ import annotations

import argparse

import torch

import lowp_ops
from lowp_ops.kernels import launch

try:
    from bench_host_overhead import host_and_wall_us
except ImportError:  # run from the repository root
    from benchmarks.bench_host_overhead import host_and_wall_us


def host_us(fn, calls: int, repeats: int) -> float:
    return host_and_wall_us(fn, calls, repeats)[0]


def captured_launches(fn) -> list[tuple]:
    """The (kernel, grid, args, meta, bound launch or None) of each Triton launch a call of ``fn`` makes."""
    real, seen = launch.CachedLaunch.launch, []

    def record(self, grid, args, meta, bound=None):
        seen.append((self, grid, args, meta, bound))
        return real(self, grid, args, meta, bound)

    launch.CachedLaunch.launch = record
    try:
        fn()
    finally:
        launch.CachedLaunch.launch = real
    return seen


def without_launches(fn):
    def call():
        real = launch.CachedLaunch.launch
        launch.CachedLaunch.launch = lambda self, grid, args, meta, bound=None: None
        try:
            fn()
        finally:
            launch.CachedLaunch.launch = real

    return call


def cases() -> dict:
    x = torch.randn(256, 4096, device="cuda").bfloat16()
    given = x.abs().amax().float().reshape(1)
    splits = torch.tensor([64, 0, 96, 32, 0, 32, 16, 16], device="cuda")
    q8, q4 = lowp_ops.mxfp8_quantize(x), lowp_ops.nvfp4_quantize(x, columnwise=True, rht=True)
    return {
        "softmax fwd": lambda: lowp_ops.softmax(x, -1),
        "log_softmax fwd": lambda: lowp_ops.log_softmax(x, -1),
        "mxfp8_quantize row+col": lambda: lowp_ops.mxfp8_quantize(x),
        "mxfp8_dequantize": lambda: lowp_ops.mxfp8_dequantize(q8),
        "nvfp4_quantize RHT, given amax": lambda: lowp_ops.nvfp4_quantize(
            x, columnwise=True, rht=True, amax_rowwise=given, amax_columnwise=given
        ),
        "nvfp4_quantize RHT, amax + SR": lambda: lowp_ops.nvfp4_quantize(
            x, columnwise=True, rht=True, stochastic_rounding=True
        ),
        "nvfp4_group_quantize RHT": lambda: lowp_ops.nvfp4_group_quantize(
            x, splits, columnwise=True, rht=True
        ),
        "nvfp4_dequantize": lambda: lowp_ops.nvfp4_dequantize(q4),
        "x.abs().amax()": lambda: x.abs().amax(),
        "torch.empty (1 KB, CUDA)": lambda: torch.empty(256, device="cuda"),
        "torch.randint (2,) int64": lambda: torch.randint(0, 2**31 - 1, (2,), device="cuda"),
        "zero_ of 1 fp32": lambda: given.zero_(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    for name, fn in cases().items():
        line = f"{name:<32} call {host_us(fn, args.calls, args.repeats):7.1f} us"
        launches = captured_launches(fn)
        if launches:
            python_only = host_us(without_launches(fn), args.calls, args.repeats)
            alone = [
                host_us(
                    lambda k=k, g=g, a=a, m=m, b=b: launch.CachedLaunch.launch(k, g, a, m, b),
                    args.calls,
                    args.repeats,
                )
                for k, g, a, m, b in launches
            ]
            names = [k.jit_function.__name__ for k, *_ in launches]
            line += f" | without launches {python_only:6.1f} | launches " + ", ".join(
                f"{n} {t:.1f} ({len(a)} args)"
                for n, t, (_, _, a, _, _) in zip(names, alone, launches, strict=True)
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
