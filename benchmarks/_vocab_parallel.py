"""What the two vocabulary-parallel benchmarks (``bench_vocab_parallel``, ``bench_linear_vocab_parallel``)
share: WORLD NCCL ranks spawned with a file store, fixed-count timings (the same number of calls on every
rank, eager and CUDA-graph replays), the slowest rank's time per case, and the markdown tables.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import capture_graph, environment, write_json

WORLD = 2


# NVLink multicast stays off on the shared hosts (device notes): also in these spawned processes.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def start_rank(rank: int, store_path: str) -> tuple[str, dist.ProcessGroup]:
    """Join the NCCL group of WORLD ranks as ``rank`` (one GPU each): (its device, the group)."""
    os.environ.update(NCCL_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    return f"cuda:{rank}", dist.group.WORLD


def keep_slowest_rank(parallel: dict, device: str, group) -> None:
    """Replace each case's eager and graph times by the slowest rank's (a collective: every rank calls it)."""
    for row in parallel.values():
        for key in ("eager_ms", "graph_ms"):
            if key in row:
                value = torch.tensor([row[key]], device=device)
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
                row[key] = float(value)


def finish_rank(
    rank: int, single: dict | None, parallel: dict, copy_tbs: float | None, result_path: str
) -> None:
    """Rank 0 saves the results for :func:`run_ranks`; every rank leaves the group."""
    if rank == 0:
        torch.save({"single": single, "parallel": parallel, "copy_tbs": copy_tbs}, result_path)
    dist.destroy_process_group()


def enough_gpus(name: str) -> bool:
    """True with WORLD GPUs or more; else prints that ``name`` is skipped."""
    if torch.cuda.device_count() >= WORLD:
        return True
    print(f"{name}: needs {WORLD} GPUs, found {torch.cuda.device_count()}; skipped")
    return False


def timed_ms(fn, group, calls: int, warmup: int = 5) -> float:
    """ms per call over ``calls`` calls after ``warmup``, the same counts on every rank."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def graph_timed_ms(fn, group, replays: int, calls_per_graph: int = 10) -> float:
    """GPU ms per call: a CUDA graph of ``calls_per_graph`` calls, replayed ``replays`` times."""
    graph = capture_graph(fn, calls_per_graph)
    return timed_ms(graph.replay, group, replays, warmup=2) / calls_per_graph


def run_ranks(worker, args: argparse.Namespace) -> dict:
    """Spawn WORLD NCCL ranks of ``worker(rank, args, store_path, result_path)``; rank 0 saves its
    result there, which is returned."""
    os.environ.update(NCCL_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        store_path, result_path = os.path.join(tmp, "store"), os.path.join(tmp, "result.pt")
        mp.start_processes(worker, args=(args, store_path, result_path), nprocs=WORLD, start_method="spawn")
        return torch.load(result_path)


def print_tables(
    single: dict, parallel: dict, metric: str, cell, vocab: int, shard: int, ms_digits: int
) -> None:
    """Eager and graph tables of the cases in ``parallel``: 1-GPU and per-rank ms, each with
    ``cell(case, ms, vocab width)`` under ``metric``, and the speedup; then any capture errors."""
    for mode in ("eager", "graph"):
        key = f"{mode}_ms"
        what = "host launches included" if mode == "eager" else "CUDA-graph replay, GPU time"
        print(f"### {mode} ({what})\n")
        print(f"| case | 1 GPU ms | {metric} | 2 GPUs ms per rank | {metric} per rank | speedup |")
        print("|---|---|---|---|---|---|")
        for name, row in parallel.items():
            one = single.get(name, {})
            cells = [name]
            for value, width in ((one.get(key), vocab), (row.get(key), shard)):
                cells.append(f"{value:.{ms_digits}f}" if value else "-")
                cells.append(cell(name, value, width) if value else "-")
            speedup = one.get(key) / row[key] if one.get(key) and row.get(key) else None
            cells.append(f"{speedup:.2f}x" if speedup else "-")
            print("| " + " | ".join(cells) + " |")
        print()
    report_graph_errors(single, parallel)


def report_graph_errors(single: dict, parallel: dict) -> None:
    for name, row in [*(("1 GPU " + k, v) for k, v in single.items()), *parallel.items()]:
        if "graph_error" in row:
            print(f"CUDA-graph capture failed, {name}: {row['graph_error']}")


def run_benchmark(name: str, doc: str, worker, report, *, calls: int, hidden: bool) -> None:
    """A vocabulary-parallel benchmark's command line: parse ``--rows --vocab --calls --no-graphs``
    (and ``--hidden`` when ``hidden``), spawn the ranks, print ``report(args, single, parallel,
    copy_tbs)`` and write ``<name>.json``; skipped (exit 0) with fewer than WORLD GPUs."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    if hidden:
        parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--calls", type=int, default=calls)
    parser.add_argument("--no-graphs", dest="graphs", action="store_false")
    args = parser.parse_args()
    if not enough_gpus(name):
        return
    result = run_ranks(worker, args)
    report(args, result["single"], result["parallel"], result["copy_tbs"])
    write_json(f"{name}.json", {"environment": environment(), "world": WORLD, **vars(args), **result})
