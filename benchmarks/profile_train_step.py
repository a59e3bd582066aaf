"""Where one training step of ``bench_transformers.py`` spends its GPU time, and whether the host keeps up.

Builds one (model, impl, mode) of ``bench_transformers.py``, runs warm-up steps (compilation happens
there), then profiles one step with ``torch.profiler``: the step's wall time, the GPU's busy time (the
sum of kernel times; a wall time well above it means the GPU waits for the host), and the kernels with
the most GPU time, grouped by name.

    python benchmarks/profile_train_step.py --model qwen3moe --impl lowp --compiled
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_transformers as bench


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_probe_arguments(parser)
    parser.add_argument("--timed-steps", type=int, default=5, help="unprofiled steps timed after the warm-up")
    parser.add_argument(
        "--no-autograd-threads",
        action="store_true",
        help="run backwards on the calling thread (torch.autograd.set_multithreading_enabled(False))",
    )
    parser.add_argument("--cpu-top", type=int, default=0, help="also the ops with the most self CPU time")
    parser.add_argument(
        "--sync-debug", action="store_true", help="print where the profiled step synchronizes with the host"
    )
    args = parser.parse_args()
    torch.autograd.set_multithreading_enabled(not args.no_autograd_threads)
    model, optimizer, batch = bench.probe_case(args, warmup=3)
    start = time.perf_counter()
    for _ in range(args.timed_steps):
        bench.train_step(model, optimizer, *batch)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / max(args.timed_steps, 1) * 1e3
    if args.sync_debug:
        warnings.showwarning = show_with_stack
        torch.cuda.set_sync_debug_mode("warn")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        bench.train_step(model, optimizer, *batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    torch.cuda.set_sync_debug_mode("default")
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        # GPU events only, user annotations (the optimizer's range) left out: they are not kernels.
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(
            event, "is_user_annotation", False
        ):
            entry = kernels[event.name[:90]]
            entry[0] += event.device_time_total
            entry[1] += 1
    busy = sum(total for total, _ in kernels.values())
    mode = "compiled" if args.compiled else "eager"
    threads = ", backward on the caller's thread" if args.no_autograd_threads else ""
    print(
        f"{args.model} {args.impl} {mode}{threads}: step {step_ms:.1f} ms ({args.timed_steps} unprofiled), "
        f"{wall * 1e3:.1f} ms (profiled), GPU busy "
        f"{busy / 1e3:.1f} ms in {sum(n for _, n in kernels.values())} kernels"
    )
    for name, (total, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[: args.top]:
        print(f"  {total / 1e3:8.2f} ms {count:6d}x  {name}")
    if args.cpu_top:
        print(
            prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.cpu_top, max_name_column_width=70
            )
        )


def show_with_stack(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning's message and the innermost frames that raised it (sync debug mode's warnings)."""
    print(f"WARNING {category.__name__}: {str(message)[:200]}")
    traceback.print_stack(limit=14, file=sys.stdout)


if __name__ == "__main__":
    main()
