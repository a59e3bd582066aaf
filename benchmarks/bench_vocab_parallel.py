"""Vocabulary-parallel cross entropy on two GPUs (NCCL) against one GPU holding the whole vocabulary.

One GPU: ``lowp_ops.cross_entropy`` on 4096 x 129280 bf16 logits. Two GPUs: each rank holds 4096 x 64640
(its half of the vocabulary) and calls it with ``process_group=``: one Triton pass over the shard, one
NCCL all-gather of a (4, 4096) fp32 packet, the merge, and a local backward. Cases: forward only,
forward + backward to bf16, forward + backward to MXFP8 row+col, and the all-gather of the packet alone.
Byte floors per rank: forward 2, forward + bf16 backward 6, forward + MXFP8 backward 6.0625 B/elem.

Timings use a FIXED number of calls on every rank (do_bench picks its own count, which would desync the
ranks' collectives): eager calls (host launch overhead included) and replays of a CUDA graph holding 10
calls (GPU time; the NCCL all-gather captured in it). A rank's time is the slowest rank's. The copy
ceiling is measured on GPU 0 in the same run.

Run on a machine with two GPUs: ``PYTHONPATH=. python3 benchmarks/bench_vocab_parallel.py`` (skips, exit
0, with fewer than two GPUs). Prints markdown tables; JSON to $OUT/bench_vocab_parallel.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import capture_graph, copy_bandwidth_tbs, environment, write_json

import lowp_ops

WORLD = 2
# NVLink multicast stays off on the shared hosts (device notes): also in these spawned processes.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FLOORS = {"forward": 2.0, "forward + backward (bf16 grad)": 6.0, "forward + backward (MXFP8 row+col)": 6.0625}


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


def make_cases(logits: torch.Tensor, target: torch.Tensor, group) -> dict:
    leaf = logits.detach().requires_grad_()

    def forward():
        with torch.no_grad():
            return lowp_ops.cross_entropy(logits, target, process_group=group, classes_last=True)

    def forward_backward():
        loss = lowp_ops.cross_entropy(leaf, target, process_group=group, classes_last=True)
        return torch.autograd.grad(loss, leaf)

    def forward_backward_mxfp8():
        return lowp_ops.cross_entropy_with_mxfp8_grad(logits, target, process_group=group)

    cases = {
        "forward": forward,
        "forward + backward (bf16 grad)": forward_backward,
        "forward + backward (MXFP8 row+col)": forward_backward_mxfp8,
    }
    if group is not None:
        stats = torch.ops.lowp.vocab_parallel_ce_stats(logits, target, 0, False)
        cases["all-gather of the (4, N) packet alone"] = lambda: dist.all_gather_into_tensor(
            torch.empty((WORLD * stats.shape[0], stats.shape[1]), device=stats.device), stats, group=group
        )
    return cases


def measure(logits, target, group, calls: int, graphs: bool) -> dict:
    results = {}
    for name, fn in make_cases(logits, target, group).items():
        row = {"eager_ms": timed_ms(fn, group, calls)}
        if graphs:
            try:
                row["graph_ms"] = graph_timed_ms(fn, group, max(2, calls // 10))
            except Exception as error:  # a failed capture is a finding, not a crash of the table
                row["graph_error"] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
        results[name] = row
    return results


def inputs(rows: int, vocab: int, device: str, columns: slice | None = None):
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=gen, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    if columns is not None:
        logits = logits[:, columns].contiguous()
    return logits, target


def worker(rank: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    os.environ.update(NCCL_ENV)
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    single = copy = None
    if rank == 0:  # the one-GPU baseline and the copy ceiling, while rank 1 waits
        _, copy = copy_bandwidth_tbs(device)
        logits, target = inputs(args.rows, args.vocab, device)
        single = measure(logits, target, None, args.calls, args.graphs)
        del logits, target
        torch.cuda.empty_cache()
    dist.barrier(group)
    shard = args.vocab // WORLD
    logits, target = inputs(args.rows, args.vocab, device, slice(rank * shard, (rank + 1) * shard))
    parallel = measure(logits, target, group, args.calls, args.graphs)
    # The slowest rank's time per case.
    for row in parallel.values():
        for key in ("eager_ms", "graph_ms"):
            if key in row:
                value = torch.tensor([row[key]], device=device)
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
                row[key] = float(value)
    if rank == 0:
        torch.save({"single": single, "parallel": parallel, "copy_tbs": copy}, result_path)
    dist.destroy_process_group()


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


def report(args, single: dict, parallel: dict, copy_tbs: float) -> None:
    shard = args.vocab // WORLD
    print(f"\ncopy ceiling (GPU 0, 2 GiB): {copy_tbs:.3f} TB/s; {args.rows} x {args.vocab} bf16 on one GPU,")
    print(f"{args.rows} x {shard} per rank on {WORLD} GPUs (NCCL); times of the slowest rank\n")

    def pct_of_copy(name: str, ms: float, vocab: int) -> str:
        floor = FLOORS.get(name)
        return f"{floor * args.rows * vocab / ms / 1e9 / copy_tbs * 100:.1f}" if floor else "-"

    print_tables(single, parallel, "% copy", pct_of_copy, args.vocab, shard, ms_digits=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--no-graphs", dest="graphs", action="store_false")
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        print(f"bench_vocab_parallel: needs {WORLD} GPUs, found {torch.cuda.device_count()}; skipped")
        return
    result = run_ranks(worker, args)
    report(args, result["single"], result["parallel"], result["copy_tbs"])
    write_json(
        "bench_vocab_parallel.json",
        {"environment": environment(), "rows": args.rows, "vocab": args.vocab, "world": WORLD, **result},
    )


if __name__ == "__main__":
    main()
