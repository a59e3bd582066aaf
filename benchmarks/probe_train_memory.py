"""Where a training step of ``bench_transformers.py`` peaks in memory, and what is alive then.

Builds one (model, impl) of ``bench_transformers.py``, runs warm-up steps, then records one step with
the CUDA caching allocator's history and replays it: the peak of allocated bytes, the phase it falls in
(forward, backward, optimizer), and the allocations made during the step that are alive at the peak,
largest first, each with the innermost Python frames outside torch that made it.

    python benchmarks/probe_train_memory.py --model qwen3moe --impl lowp [--compiled]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_transformers as bench


def origin(frames: list[dict], depth: int = 3) -> str:
    """The innermost ``depth`` frames that are not torch's own, as ``file:line name``."""
    mine = [f for f in frames if "/torch/" not in f["filename"] and "<" not in f["filename"]]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in mine[:depth])


def replay(trace: list[dict]) -> tuple[int, int, list[dict]]:
    """(peak bytes over the step's start, event index of the peak, live allocations at the peak)."""

    def walk(stop: int | None = None) -> tuple[int, int, dict[int, dict]]:
        live: dict[int, dict] = {}
        level = peak = peak_index = 0
        for index, event in enumerate(trace[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = event
                level += event["size"]
            elif event["action"] == "free_completed":
                level -= event["size"]
                live.pop(event["addr"], None)
            if level > peak:
                peak, peak_index = level, index
        return peak, peak_index, live

    peak, peak_index, _ = walk()
    return peak, peak_index, list(walk(peak_index + 1)[2].values())


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_probe_arguments(parser)
    args = parser.parse_args()
    model, optimizer, batch = bench.probe_case(args, warmup=2)
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    marks = []

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        marks.append((name, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))

    loss = model(input_ids=batch[0], labels=batch[1], use_cache=False).loss
    mark("forward")
    loss.backward()
    mark("backward")
    optimizer.step()
    mark("optimizer step")
    optimizer.zero_grad(set_to_none=True)
    mark("zero_grad")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, peak_index, peak_live = replay(trace)
    gib = 2**30
    print(
        f"{args.model} {args.impl} {'compiled' if args.compiled else 'eager'}: state {start / gib:.3f} GiB, "
        f"peak {torch.cuda.max_memory_allocated() / gib:.3f} GiB (replayed {(start + peak) / gib:.3f}), "
        f"peak at event {peak_index} of {len(trace)}"
    )
    for name, now, high in marks:
        print(f"  after {name:<15} allocated {now / gib:7.3f} GiB, peak so far {high / gib:7.3f} GiB")
    print(f"allocations of this step alive at the peak: {sum(e['size'] for e in peak_live) / gib:.3f} GiB")
    grouped = collections.defaultdict(lambda: [0, 0])
    for event in peak_live:
        key = origin(event["frames"])
        grouped[key][0] += event["size"]
        grouped[key][1] += 1
    for key, (size, count) in sorted(grouped.items(), key=lambda item: -item[1][0])[: args.top]:
        print(f"  {size / 2**20:9.1f} MiB in {count:4d}  {key}")
    where = trace[peak_index]
    print(
        f"the allocation that reached the peak: {where['size'] / 2**20:.1f} MiB  {origin(where['frames'], 6)}"
    )


if __name__ == "__main__":
    main()
