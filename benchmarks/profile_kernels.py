"""Which GPU kernels one call launches and how long each runs (torch.profiler), to find the small
kernels around the big ones (not a timed benchmark):

    python benchmarks/profile_kernels.py [--shape 4096x129280] ce_mxfp8 | ce_fwd_bwd
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import lowp_ops

CASES = {
    "ce_mxfp8": lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t),
    "ce_fwd_bwd": lambda x, t: lowp_ops.cross_entropy(x, t, classes_last=True).backward(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"any of {', '.join(CASES)} (default: all)")
    parser.add_argument("--shape", default="4096x129280", help="rows x classes of the bf16 logits")
    args = parser.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {list(CASES)}")
    rows, classes = map(int, args.shape.split("x"))
    x = (torch.randn(rows, classes, device="cuda") * 3).to(torch.bfloat16)
    t = torch.randint(0, classes, (rows,), device="cuda")
    for name in args.cases or list(CASES):
        logits = x.clone().requires_grad_(name == "ce_fwd_bwd")
        for _ in range(3):
            CASES[name](logits, t)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            CASES[name](logits, t)
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time for e in events)
        print(f"== {name}: {len(events)} GPU activities, {total:.1f} us")
        for e in events:
            print(f"  {e.device_time:9.1f} us  {e.name[:110]}")


if __name__ == "__main__":
    main()
