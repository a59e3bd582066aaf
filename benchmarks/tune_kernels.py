"""Launch-configuration sweeps on the H200 (not a test): MXFP8 quantize 16384x16384 row+col, and the
cross-entropy forward / MXFP8 backward at 4096x129280, each as % of a same-run device copy."""

from __future__ import annotations

import torch
from _common import copy_bandwidth_tbs, environment, median_ms, write_json

from lowp_ops.kernels.cross_entropy import (
    launch_cross_entropy_bwd,
    launch_cross_entropy_bwd_mxfp8,
    launch_cross_entropy_fwd,
)
from lowp_ops.kernels.mxfp8 import launch_mxfp8_quantize


def sweep(name: str, floor_bytes: float, elems: int, copy_tbs: float, configs: dict, results: list) -> None:
    for label, fn in configs.items():
        try:
            ms = median_ms(fn)
        except Exception as error:
            print(f"{name} {label}: failed {type(error).__name__}: {str(error)[:200]}")
            continue
        pct = 100 * floor_bytes * elems / ms / 1e9 / copy_tbs
        results.append({"kernel": name, "config": label, "ms": round(ms, 4), "pct_copy": round(pct, 1)})
        print(f"{name:18s} {label:24s} {ms:7.3f} ms {pct:5.1f}% of copy")


def main() -> None:
    _, copy_tbs = copy_bandwidth_tbs()
    results: list = []
    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    quantize = {
        f"cols={b} warps={w}": (
            lambda b=b, w=w: launch_mxfp8_quantize(x, "e4m3", True, True, "compact", b, w)
        )
        for b, w in [(64, 1), (128, 1), (128, 2), (256, 2)]
    }
    sweep("mxfp8 row+col", 4.0625, x.numel(), copy_tbs, quantize, results)

    n_rows, vocab = 4096, 129280
    logits = (torch.randn(n_rows, vocab, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    forward = {
        f"block={b} warps={w}": (lambda b=b, w=w: launch_cross_entropy_fwd(logits, target, 0.0, -100, b, w))
        for b, w in [(4096, 2), (8192, 4)]
    }
    sweep("ce fwd", 2, logits.numel(), copy_tbs, forward, results)
    _, lse = launch_cross_entropy_fwd(logits, target, 0.0, -100)
    grad_rows = torch.full((n_rows,), 1.0 / n_rows, device="cuda")
    backward = {
        f"cols={b} warps={w}": (
            lambda b=b, w=w: launch_cross_entropy_bwd_mxfp8(
                logits,
                target,
                lse,
                grad_rows,
                0.0,
                -100,
                "e4m3",
                True,
                True,
                "compact",
                block_cols=b,
                num_warps=w,
            )
        )
        for b, w in [(64, 1), (128, 1), (64, 2), (128, 2), (256, 2), (256, 4)]
    }
    sweep("ce bwd mxfp8", 4.0625, logits.numel(), copy_tbs, backward, results)
    bf16 = {"default": lambda: launch_cross_entropy_bwd(logits, target, lse, grad_rows, 0.0, -100)}
    sweep("ce bwd bf16", 4, logits.numel(), copy_tbs, bf16, results)
    write_json("tune_kernels.json", {"env": environment(), "copy_TBps": copy_tbs, "results": results})


if __name__ == "__main__":
    main()
