"""``linear_cross_entropy`` forward + backward per token-chunk size, and one chunk's three GEMMs alone.

The loss of an LM head over N tokens runs in chunks of ``chunk_size`` tokens: per chunk the logits GEMM
``h_c W^T`` ((c, H) x (H, V)), the cross entropy, the hidden gradient ``dlogits_c W`` ((c, V) x (V, H):
a (c, H) output over a K of V) and the weight gradient ``dW += dlogits_c^T h_c`` (a (V, H) output read and
written per chunk over a K of c). Small chunks bound the logits' memory (c V elements); this shows what
they cost in time at a shape (default: Gemma 3 1B's head, N 4096, H 1152, V 262144, bf16). Eager, CUDA
events around ``--iters`` steps after two warm-up steps, median of ``--repeats``. Run (H200):
``python benchmarks/probe_loss_chunks.py --shape 4096,1152,262144 --chunks 256,512,1024,2048,4096``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import lowp_ops


def timed(fn, iters: int, repeats: int) -> float:
    """Median ms per call of ``fn`` over ``repeats`` runs of ``iters`` calls (CUDA events)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4096,1152,262144", help="N,H,V")
    parser.add_argument("--chunks", default="256,512,1024,2048,4096", help="tokens per chunk")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokens, width, vocab = (int(v) for v in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(tokens, width, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    w = weight.detach()
    print(f"N {tokens}, H {width}, V {vocab}, bf16, {torch.cuda.get_device_name()}")
    columns = ["chunk (tokens)", "chunks", "fwd+bwd ms", "logits GEMM ms", "dgrad GEMM ms", "wgrad addmm_ ms"]
    print("| " + " | ".join([*columns, "peak extra GiB"]) + " |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for chunk in (int(c) for c in args.chunks.split(",")):

        def step(chunk=chunk):
            hidden.grad = weight.grad = None
            lowp_ops.linear_cross_entropy(hidden, weight, target, chunk_size=chunk).backward()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        total = timed(step, args.iters, args.repeats)
        h_c = hidden.detach()[:chunk]
        logits = torch.mm(h_c, w.t())
        dweight = torch.zeros_like(w)
        pieces = (
            lambda h_c=h_c, logits=logits: torch.mm(h_c, w.t(), out=logits),
            lambda logits=logits: torch.mm(logits, w),
            lambda h_c=h_c, logits=logits, dweight=dweight: dweight.addmm_(logits.t(), h_c),
        )
        gemms = [timed(piece, args.iters, args.repeats) for piece in pieces]
        del logits, dweight, pieces
        row = [
            str(chunk),
            str(-(-tokens // chunk)),
            f"{total:.3f}",
            *(f"{g:.3f}" for g in gemms),
            f"{peak:.3f}",
        ]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
