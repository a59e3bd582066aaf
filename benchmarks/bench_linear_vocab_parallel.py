"""Vocabulary-parallel LM head + cross entropy on two GPUs (NCCL) against one GPU holding the whole head.

One GPU: ``lowp_ops.linear_cross_entropy`` with hidden 4096 x 4096 and weight 129280 x 4096 bf16 (the
fused path: three GEMMs per chunk, gradients formed in the forward). Two GPUs: each rank holds 64640
weight rows and calls it with ``process_group=``: per chunk its logits and per-row packet, one NCCL
all-gather, the merge; the backward recomputes each chunk (four GEMMs per chunk in all, on half the
vocabulary) and all-reduces the hidden gradient in fp32 (64 MiB). Cases: forward only, forward +
backward with a bf16 and with an MXFP8 (E4M3) logits gradient, and the all-reduce alone.

Timings as ``bench_vocab_parallel.py``: a fixed number of calls on every rank, eager and CUDA-graph
replays, the slowest rank's time. GEMM-bound, so the table reports useful TFLOP/s (2 N H V per GEMM:
1 GEMM forward, 3 forward + backward; the parallel path's recomputed GEMM is not counted) next to the
copy ceiling measured in the same run.

Run on a machine with two GPUs: ``PYTHONPATH=. python3 benchmarks/bench_linear_vocab_parallel.py``
(skips, exit 0, with fewer than two GPUs). Prints markdown tables; JSON to
$OUT/bench_linear_vocab_parallel.json.
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

GEMMS = {"forward": 1, "forward + backward (bf16 grad)": 3, "forward + backward (MXFP8 e4m3 grad)": 3}


def make_cases(hidden, weight, target, group) -> dict:
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()

    def forward():
        with torch.no_grad():
            return lowp_ops.linear_cross_entropy(hidden, weight, target, process_group=group)

    def forward_backward(grad_format):
        def step():
            loss = lowp_ops.linear_cross_entropy(h, w, target, grad_format=grad_format, process_group=group)
            return torch.autograd.grad(loss, (h, w))

        return step

    cases = {
        "forward": forward,
        "forward + backward (bf16 grad)": forward_backward(None),
        "forward + backward (MXFP8 e4m3 grad)": forward_backward("mxfp8_e4m3"),
    }
    if group is not None:
        grad = torch.empty(hidden.shape, device=hidden.device, dtype=torch.float32)
        cases["fp32 all-reduce of the hidden gradient alone"] = lambda: dist.all_reduce(grad, group=group)
    return cases


def measure(hidden, weight, target, group, calls: int, graphs: bool) -> dict:
    results = {}
    for name, fn in make_cases(hidden, weight, target, group).items():
        row = {"eager_ms": timed_ms(fn, group, calls, warmup=2)}
        if graphs:
            try:
                row["graph_ms"] = graph_timed_ms(fn, group, max(2, calls // 5), calls_per_graph=2)
            except Exception as error:  # a failed capture is a finding, not a crash of the table
                row["graph_error"] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
        results[name] = row
        torch.cuda.empty_cache()
    return results


def inputs(rows: int, hidden_size: int, vocab: int, device: str, vocab_rows: slice | None = None):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, hidden_size, device=device, generator=gen, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden_size, device=device, generator=gen, dtype=torch.bfloat16)
    weight *= hidden_size**-0.5
    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    if vocab_rows is not None:
        weight = weight[vocab_rows].contiguous()
    return hidden, weight, target


def worker(rank: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    device, group = start_rank(rank, store_path)
    single = copy = None
    if rank == 0:  # the one-GPU baseline and the copy ceiling, while rank 1 waits
        _, copy = copy_bandwidth_tbs(device)
        single = measure(*inputs(args.rows, args.hidden, args.vocab, device), None, args.calls, args.graphs)
        torch.cuda.empty_cache()
    dist.barrier(group)
    shard = args.vocab // WORLD
    rows = slice(rank * shard, (rank + 1) * shard)
    parallel = measure(
        *inputs(args.rows, args.hidden, args.vocab, device, rows), group, args.calls, args.graphs
    )
    keep_slowest_rank(parallel, device, group)
    finish_rank(rank, single, parallel, copy, result_path)


def report(args, single: dict, parallel: dict, copy_tbs: float) -> None:
    shard = args.vocab // WORLD
    print(f"\ncopy ceiling (GPU 0, 2 GiB): {copy_tbs:.3f} TB/s; hidden {args.rows} x {args.hidden}, weight")
    print(f"{args.vocab} x {args.hidden} bf16 on one GPU, {shard} rows per rank on {WORLD} GPUs (NCCL)\n")

    def tflops(name: str, ms: float, vocab: int) -> str:
        flops = 2 * args.rows * args.hidden * vocab * GEMMS.get(name, 0)
        return f"{flops / ms / 1e9:.0f}" if flops else "-"

    print_tables(single, parallel, "TFLOP/s", tflops, args.vocab, shard, ms_digits=3)


def main() -> None:
    run_benchmark("bench_linear_vocab_parallel", __doc__, worker, report, calls=10, hidden=True)


if __name__ == "__main__":
    main()
