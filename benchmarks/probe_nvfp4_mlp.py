"""Where the NVFP4 grouped MLP's eager fwd+bwd time goes on a CUDA machine: host syncs (torch's sync
debug mode), CUDA kernels per call by name (torch.profiler), and cProfile's top entries by own time.

    python benchmarks/probe_nvfp4_mlp.py [--recipe nvfp4]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time

import torch

import lowp_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="nvfp4")
    args = parser.parse_args()
    tokens, experts, hidden, ffn = 512, 8, 1024, 512
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16().requires_grad_()

    x, w1, w2 = randn(tokens, hidden), randn(experts, 2 * ffn, hidden), randn(experts, hidden, ffn)
    probs = torch.rand(tokens, device="cuda", generator=gen).requires_grad_()
    splits = torch.tensor([64, 0, 96, 32, 0, 32, 16, 272], device="cuda")

    def step():
        y = lowp_ops.grouped_swiglu_mlp(x, w1, w2, splits, probs, recipe=args.recipe)
        y.backward(torch.ones_like(y))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        print("host syncs in one fwd+bwd: none")
    except RuntimeError as error:
        print("host sync:", str(error).splitlines()[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        step()
    host = (time.perf_counter() - start) / 20 * 1e6
    torch.cuda.synchronize()
    print(f"host us per fwd+bwd {host:.1f}, with sync {(time.perf_counter() - start) / 20 * 1e6:.1f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = collections.Counter(
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    gpu_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"CUDA kernels per fwd+bwd: {sum(kernels.values())}, GPU us {gpu_us:.1f}")
    if not kernels:  # this torch's profiler lists no device events: its per-name table instead
        print(prof.key_averages().table(sort_by="count", row_limit=40))
    for name, count in kernels.most_common():
        print(f"  {count:3d} {name[:110]}")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
