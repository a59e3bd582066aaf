"""Vocabulary-parallel cross entropy on two GPUs (NCCL) against one GPU holding the whole vocabulary.

One GPU: ``lowp_ops.cross_entropy`` on 4096 x 129280 bf16 logits. Two GPUs: each rank holds 4096 x 64640
(its half of the vocabulary) and calls it with ``process_group=``: one Triton pass over the shard, one
NCCL all-gather of a (5, 4096) fp32 packet, the merge, and a local backward. Cases: forward only,
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
import traceback

import torch
import torch.distributed as dist
from _common import copy_bandwidth_tbs
from _vocab_parallel import (
    WORLD,
    finish_rank,
    graph_timed_ms,
    keep_slowest_rank,
    print_tables,
    run_benchmark,
    start_rank,
    timed_ms,
)

import lowp_ops

FLOORS = {"forward": 2.0, "forward + backward (bf16 grad)": 6.0, "forward + backward (MXFP8 row+col)": 6.0625}


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
        cases["all-gather of the (5, N) packet alone"] = lambda: dist.all_gather_into_tensor(
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
    device, group = start_rank(rank, store_path)
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
    keep_slowest_rank(parallel, device, group)
    finish_rank(rank, single, parallel, copy, result_path)


def report(args, single: dict, parallel: dict, copy_tbs: float) -> None:
    shard = args.vocab // WORLD
    print(f"\ncopy ceiling (GPU 0, 2 GiB): {copy_tbs:.3f} TB/s; {args.rows} x {args.vocab} bf16 on one GPU,")
    print(f"{args.rows} x {shard} per rank on {WORLD} GPUs (NCCL); times of the slowest rank\n")

    def pct_of_copy(name: str, ms: float, vocab: int) -> str:
        floor = FLOORS.get(name)
        return f"{floor * args.rows * vocab / ms / 1e9 / copy_tbs * 100:.1f}" if floor else "-"

    print_tables(single, parallel, "% copy", pct_of_copy, args.vocab, shard, ms_digits=4)


def main() -> None:
    run_benchmark("bench_vocab_parallel", __doc__, worker, report, calls=100, hidden=False)


if __name__ == "__main__":
    main()
