"""Host and GPU time of the LM head's two bf16 schedules at small token counts.

With ``chunk_size=None``, a reduced loss, at most H tokens and at least ``IN_GRADIENT_MIN_LOGITS``
logits, ``linear_cross_entropy`` keeps the logits in ``weight``'s gradient (the in-gradient schedule:
eight cuBLAS calls at V 32000, three cross-entropy kernels; forced here by lowering the threshold to 0);
an explicit ``chunk_size`` takes the chunk schedule (three GEMMs per chunk and the one-pass loss and
gradient). For each shape: host us per fwd+bwd (``--calls`` back to back, then one sync; median of
``--repeats`` alternating loops), GPU us per fwd+bwd (a CUDA graph of 10 calls, median replay), for the
automatic choice, each schedule, and ``F.linear`` + ``F.cross_entropy(x.float())``.

    python benchmarks/probe_lm_head_schedules.py --shapes 512x1024x32000,2048x4096x32000
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import lowp_ops
from lowp_ops.meta import linear_cross_entropy as lce_meta

try:
    from _common import graph_ms
    from bench_host_overhead import alternating_host_and_wall_us
except ImportError:  # run from the repository root
    from benchmarks._common import graph_ms
    from benchmarks.bench_host_overhead import alternating_host_and_wall_us


def fwd_bwd(loss_fn, hidden, weight):
    """One forward and backward, the gradients returned (nothing accumulates between calls)."""

    def call():
        return torch.autograd.grad(loss_fn(hidden, weight), (hidden, weight))

    return call


def with_in_gradient_forced(loss_fn):
    """``loss_fn`` run with the in-gradient schedule's logits threshold at 0 (it serves any N <= H)."""

    def call(*args):
        threshold, lce_meta.IN_GRADIENT_MIN_LOGITS = lce_meta.IN_GRADIENT_MIN_LOGITS, 0
        try:
            return loss_fn(*args)
        finally:
            lce_meta.IN_GRADIENT_MIN_LOGITS = threshold

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="512x1024x32000,1024x1024x32000,2048x4096x32000")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'N x H x V':<18} {'call':<34} {'host us':>9} {'GPU us':>9}")
    for shape in args.shapes.split(","):
        n, h, v = map(int, shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(n, h, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        weight = torch.randn(v, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        weight.requires_grad_()
        target = torch.randint(0, v, (n,), device="cuda", generator=gen)
        calls = {
            "lowp, chunk_size=None (automatic)": fwd_bwd(
                lambda a, b, t=target: lowp_ops.linear_cross_entropy(a, b, t), hidden, weight
            ),
            "lowp, in-gradient schedule": fwd_bwd(
                with_in_gradient_forced(lambda a, b, t=target: lowp_ops.linear_cross_entropy(a, b, t)),
                hidden,
                weight,
            ),
            "lowp, one chunk (chunk_size=N)": fwd_bwd(
                lambda a, b, t=target, c=n: lowp_ops.linear_cross_entropy(a, b, t, chunk_size=c),
                hidden,
                weight,
            ),
            "F.linear + F.cross_entropy(float)": fwd_bwd(
                lambda a, b, t=target: F.cross_entropy(F.linear(a, b).float(), t), hidden, weight
            ),
        }
        times = alternating_host_and_wall_us(list(calls.values()), args.calls, args.repeats)
        for (name, call), (host, _) in zip(calls.items(), times, strict=True):
            gpu = graph_ms(call) * 1e3
            print(f"{shape:<18} {name:<34} {host:>9.1f} {gpu:>9.1f}")


if __name__ == "__main__":
    main()
