"""Where a compiled cross entropy's host time goes: ``torch.compile`` of ``lowp_ops.cross_entropy`` and
of ``F.cross_entropy`` (512 x 32000 bf16, fwd+bwd as ``bench_host_overhead.py`` times it): host us per
call (median of 5 loops of 200, ``bench_host_overhead.host_and_wall_us``), the forward alone, and
``torch.profiler``'s CPU table of 50 calls of each, sorted by self time, with the backward on the
calling thread (the profiler then sees all of it).

    python benchmarks/probe_compiled_profile.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import gpu_script_args
from bench_host_overhead import fwd_bwd, host_and_wall_us
from torch.profiler import ProfilerActivity, profile

import lowp_ops


def main() -> None:
    gpu_script_args(__doc__)
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(512, 32000, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, 32000, (512,), device="cuda", generator=gen)
    ours = torch.compile(lambda lg, t: lowp_ops.cross_entropy(lg, t))
    theirs = torch.compile(lambda lg, t: F.cross_entropy(lg, t))
    cases = {
        "compiled lowp": fwd_bwd(lambda: ours(logits, target), logits),
        "compiled F.cross_entropy": fwd_bwd(lambda: theirs(logits, target), logits),
        "eager lowp": fwd_bwd(lambda: lowp_ops.cross_entropy(logits, target), logits),
    }
    for name, step in cases.items():
        print(f"{name:26s} fwd+bwd host us per call: {host_and_wall_us(step, 200, 5)[0]:.1f}")
    for name, f in (("compiled lowp", ours), ("compiled F.cross_entropy", theirs)):
        forward_us = host_and_wall_us(lambda f=f: f(logits, target), 200, 5)[0]
        print(f"{name:26s} forward host us per call: {forward_us:.1f}")
    with torch.autograd.set_multithreading_enabled(False):
        for name in ("compiled lowp", "compiled F.cross_entropy"):
            step = cases[name]
            for _ in range(10):
                step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(50):
                    step()
            torch.cuda.synchronize()
            print(f"===== {name}: torch.profiler, 50 calls")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=28)
            print(table)


if __name__ == "__main__":
    main()
