"""Launch-configuration sweeps on the H200 (not a test), each case as % of a same-run device copy:

- ``mxfp8``: the MXFP8 quantizer at 16384 x 16384 bf16, row+col, row only and col only;
- ``nvfp4``: the NVFP4 quantizer at 16384 x 16384 bf16 (given amaxes), row+col with RHT and col only
  with RHT, over tile heights (the transposed column-wise bytes per column and program are
  TILE_ROWS / 2), widths, warps and grid order; outputs checked byte-identical to the default's;
- ``ce``: the cross-entropy forward and fused MXFP8 backward (the Gluon kernel, then Triton's
  configurations) at 4096 x 129280.

    python benchmarks/tune_kernels.py [mxfp8] [nvfp4] [ce]     # none: all
"""

from __future__ import annotations

import torch
from _common import copy_bandwidth_tbs, environment, gpu_script_args, median_ms, write_json

from lowp_ops.kernels.cross_entropy import (
    launch_cross_entropy_bwd,
    launch_cross_entropy_bwd_mxfp8,
    launch_cross_entropy_fwd,
)
from lowp_ops.kernels.mxfp8 import launch_mxfp8_quantize
from lowp_ops.kernels.nvfp4 import launch_nvfp4_quantize, quantize_config

NVFP4_CONFIGS = [  # (TILE_ROWS, BLOCK_COLS, num_warps, grid along rows[, register cap])
    (16, 128, 1, True),
    (32, 64, 1, False),
    (32, 128, 2, False),
    (64, 32, 1, False),
    (64, 64, 2, False),
    (64, 64, 2, False, 96),
    (64, 64, 2, False, 112),
    (64, 64, 2, False, 128),
    (64, 64, 4, False),
    (64, 128, 4, False),
]


def sweep(name: str, floor_bytes: float, elems: int, copy_tbs: float, configs: dict, results: list) -> None:
    for label, fn in configs.items():
        try:
            ms = median_ms(fn)
        except Exception as error:
            print(f"{name} {label}: failed {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        pct = 100 * floor_bytes * elems / ms / 1e9 / copy_tbs
        results.append({"kernel": name, "config": label, "ms": round(ms, 4), "pct_copy": round(pct, 1)})
        print(f"{name:22s} {label:34s} {ms:7.3f} ms {pct:5.1f}% of copy", flush=True)


def tune_mxfp8(copy_tbs: float, results: list) -> None:
    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    configs = [(64, 1), (128, 1), (128, 2), (256, 1), (256, 2), (256, 4)]
    for mode, rowwise, columnwise, floor in [
        ("row+col", True, True, 4.0625),
        ("row", True, False, 3.03125),
        ("col", False, True, 3.03125),
    ]:
        cases = {
            f"cols={b} warps={w}": (
                lambda b=b, w=w, r=rowwise, c=columnwise: launch_mxfp8_quantize(
                    x, "e4m3", r, c, "compact", b, w
                )
            )
            for b, w in configs
        }
        sweep(f"mxfp8 {mode}", floor, x.numel(), copy_tbs, cases, results)


def tune_nvfp4(copy_tbs: float, results: list) -> None:
    rows = cols = 16384
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    amax = x.abs().max().float().reshape(1)
    amax_rht = amax * 4
    default = quantize_config(rows, cols)
    for mode, rowwise, floor in [("row+col rht", True, 3.125), ("col rht", False, 2.5625)]:
        want = launch_nvfp4_quantize(x, rowwise, True, True, amax, amax_rht, False, config=default)
        cases = {}
        for config in NVFP4_CONFIGS:
            try:
                got = launch_nvfp4_quantize(x, rowwise, True, True, amax, amax_rht, False, config=config)
            except Exception as error:
                print(f"nvfp4 {mode} {config}: failed {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            differ = sum(int((g != w).sum()) for g, w in zip(got[:4], want[:4], strict=True))
            order = "rows" if config[3] else "strips"
            cap = f" regs<={config[4]}" if len(config) > 4 else ""
            label = f"R={config[0]} C={config[1]} w={config[2]} {order}{cap} d={differ}"
            cases[label] = lambda c=config, r=rowwise: launch_nvfp4_quantize(
                x, r, True, True, amax, amax_rht, False, config=c
            )
        sweep(f"nvfp4 {mode}", floor, x.numel(), copy_tbs, cases, results)


def tune_cross_entropy(copy_tbs: float, results: list) -> None:
    n_rows, vocab = 4096, 129280
    logits = (torch.randn(n_rows, vocab, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    forward = {
        f"block={b} warps={w}": (
            lambda b=b, w=w: launch_cross_entropy_fwd(logits, target, 0.0, -100, block=b, num_warps=w)
        )
        for b, w in [(4096, 2), (4096, 4), (8192, 4), (8192, 8), (16384, 8)]
    }
    sweep("ce fwd", 2, logits.numel(), copy_tbs, forward, results)
    _, lse = launch_cross_entropy_fwd(logits, target, 0.0, -100)
    grad_rows = torch.full((n_rows,), 1.0 / n_rows, device="cuda")
    args = (logits, target, lse, grad_rows, 0.0, -100, "e4m3", True, True, "compact")
    want = launch_cross_entropy_bwd_mxfp8(*args, gluon=False)
    got = launch_cross_entropy_bwd_mxfp8(*args)
    differ = sum(
        int((g.view(torch.uint8) != h.view(torch.uint8)).sum()) for g, h in zip(got, want, strict=True)
    )
    backward = {f"gluon (default) d={differ}": lambda: launch_cross_entropy_bwd_mxfp8(*args)}
    for b, w in [(64, 1), (128, 1), (128, 2), (256, 2)]:
        got = launch_cross_entropy_bwd_mxfp8(*args, gluon=False, block_cols=b, num_warps=w)
        pairs = zip(got, want, strict=True)
        differ = sum(int((g.view(torch.uint8) != h.view(torch.uint8)).sum()) for g, h in pairs)
        backward[f"triton cols={b} warps={w} d={differ}"] = lambda b=b, w=w: launch_cross_entropy_bwd_mxfp8(
            *args, gluon=False, block_cols=b, num_warps=w
        )
    sweep("ce bwd mxfp8", 4.0625, logits.numel(), copy_tbs, backward, results)
    bf16 = {"default": lambda: launch_cross_entropy_bwd(logits, target, lse, grad_rows, 0.0, -100)}
    sweep("ce bwd bf16", 4, logits.numel(), copy_tbs, bf16, results)


SECTIONS = {"mxfp8": tune_mxfp8, "nvfp4": tune_nvfp4, "ce": tune_cross_entropy}


def main() -> None:
    def sections(parser):
        parser.add_argument("sections", nargs="*", metavar="SECTION", help=f"of {list(SECTIONS)}")

    names = gpu_script_args(__doc__, sections).sections or list(SECTIONS)
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    _, copy_tbs = copy_bandwidth_tbs()
    print(f"copy {copy_tbs:.3f} TB/s", flush=True)
    results: list = []
    for name in names:
        SECTIONS[name](copy_tbs, results)
    name = "tune_kernels_" + "_".join(names) + ".json"
    write_json(name, {"env": environment(), "copy_TBps": copy_tbs, "results": results})


if __name__ == "__main__":
    main()
