"""NVFP4 quantize benchmark (H200): ``lowp_ops`` Triton kernels at 16384 x 16384 bf16 (row-wise + column-wise
with the RHT, and the copies alone) and grouped over 8 experts, next to a device-to-device copy measured in
the same run, plus a sweep of the launch configuration (TILE_ROWS x BLOCK_COLS x num_warps).

Byte floors per element (bf16 in): read 2; each copy writes 0.5 (E2M1) + 1/16 (E4M3 scales). Row + column
3.125 B/elem, one copy 2.5625 B/elem. With amaxes computed (no ``amax_*`` given) the separate amax pass
reads x once more: floor + 2 B/elem; the table reports both the single-pass floor ratio ("% copy") and, for
those rows, the two-pass one. Given amaxes (the dGLU epilogue / PR #3755 path) run one pass.

Run:        PYTHONPATH=. python3 benchmarks/bench_nvfp4.py [--json PATH]   (default $OUT/bench_nvfp4.json)
CPU smoke:  TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_nvfp4.py --device cpu --shape 64 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _common import environment, write_json

from lowp_ops.kernels.nvfp4 import launch_nvfp4_group_quantize, launch_nvfp4_quantize, quantize_config

SINGLE_PASS_FLOOR = {"row+col": 2 + 2 * (0.5 + 1 / 16), "row": 2 + 0.5 + 1 / 16, "col": 2 + 0.5 + 1 / 16}
AMAX_PASS_BYTES = 2.0
# (TILE_ROWS, BLOCK_COLS, num_warps, 1-D grid along rows); False = 2-D grid walking down column strips.
SWEEP = [
    (16, 128, 1, True),
    (16, 128, 1, False),
    (16, 64, 1, True),
    (16, 128, 2, True),
    (16, 256, 2, True),
    (32, 64, 1, True),
    (32, 128, 2, True),
    (16, 256, 1, True),
]


def time_ms(fn, device: str, reps: int) -> float:
    """Median ms: triton's do_bench on CUDA, wall clock on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_tbs(device: str, reps: int) -> float:
    """Read + write TB/s of a 2 GiB device copy (the x-sized copy on CPU)."""
    n_bytes = 2**31 if device == "cuda" else 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / time_ms(lambda: dst.copy_(src), device, reps) / 1e9


def mismatches(got, expected) -> int:
    return sum(
        int((g != e).sum()) if g.shape == e.shape else g.numel() for g, e in zip(got, expected, strict=True)
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=(16384, 16384), metavar=("ROWS", "COLS"))
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per case on CPU")
    parser.add_argument("--json", default=None, help="output path (default: $OUT/bench_nvfp4.json)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = args.device
    rows, cols = args.shape
    elems = rows * cols
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    amax = x.float().abs().amax().reshape(1)
    amax_rht = 4 * amax  # a valid post-RHT bound (docs/nvfp4.md#the-4x-bound), as the dGLU path gives
    experts = args.experts
    split_sizes = torch.full((experts,), rows // experts, device=device, dtype=torch.int64)
    split_sizes[-1] += rows - int(split_sizes.sum())
    group_amax = amax.expand(experts).contiguous()
    copy = copy_tbs(device, args.reps)
    print(f"copy: {copy:.3f} TB/s (read+write); shape {rows}x{cols} bf16, {experts} experts")
    results: list[dict] = []

    def record(case: str, mode: str, fn, amax_pass: bool, note: str = "") -> None:
        try:
            ms = time_ms(fn, device, args.reps)
        except Exception as error:  # a failed case is reported, the others still run
            print(f"{case} {mode}: FAILED {type(error).__name__}: {str(error)[:300]}")
            results.append({"case": case, "mode": mode, "error": repr(error)[:300]})
            return
        floor = SINGLE_PASS_FLOOR[mode]
        row = {"case": case, "mode": mode, "ms": ms, "floor_B_per_elem": floor}
        row["TBps"] = floor * elems / ms / 1e9
        row["pct_copy"] = 100 * row["TBps"] / copy
        if amax_pass:
            row["pct_copy_two_pass_floor"] = 100 * (floor + AMAX_PASS_BYTES) * elems / ms / 1e9 / copy
        results.append({**row, "note": note})
        extra = f" (two-pass floor {row['pct_copy_two_pass_floor']:.1f}%)" if amax_pass else ""
        print(f"{case:44s} {mode:8s} {ms:8.4f} ms {row['pct_copy']:6.1f}%{extra} {note}")

    modes = {"row+col": (True, True), "row": (True, False), "col": (False, True)}
    for mode, (rowwise, columnwise) in modes.items():
        record(
            "quantize, RHT on col, given amaxes",
            mode,
            lambda r=rowwise, c=columnwise: launch_nvfp4_quantize(x, r, c, True, amax, amax_rht, False),
            False,
        )
    record(
        "quantize, RHT on col, computed amaxes",
        "row+col",
        lambda: launch_nvfp4_quantize(x, True, True, True, None, None, False),
        True,
    )
    record(
        "quantize, no RHT, given amax",
        "row+col",
        lambda: launch_nvfp4_quantize(x, True, True, False, amax, amax, False),
        False,
    )
    record(
        "quantize, 16x16 blocks, given amax",
        "row+col",
        lambda: launch_nvfp4_quantize(x, True, True, False, amax, amax, True),
        False,
    )
    record(
        f"group quantize ({experts} experts), RHT, given amaxes",
        "row+col",
        lambda: launch_nvfp4_group_quantize(x, split_sizes, True, True, True, group_amax, 4 * group_amax),
        False,
    )
    record(
        f"group quantize ({experts} experts), RHT, computed",
        "row+col",
        lambda: launch_nvfp4_group_quantize(x, split_sizes, True, True, True, None, None),
        True,
    )
    sr_seed = torch.tensor([1, 0], device=device)
    record(
        "quantize, RHT, given amaxes, stochastic",
        "row+col",
        lambda: launch_nvfp4_quantize(x, True, True, True, amax, amax_rht, False, sr_seed),
        False,
    )

    if not args.no_sweep:
        default = quantize_config(rows, cols, True)
        expected = launch_nvfp4_quantize(x, True, True, True, amax, amax_rht, False)
        for config in SWEEP:
            run = lambda c=config: launch_nvfp4_quantize(x, True, True, True, amax, amax_rht, False, config=c)
            try:
                wrong = mismatches(run(), expected)
            except Exception as error:
                wrong = f"{type(error).__name__}: {str(error)[:80]}"
            note = ("launcher default; " if config == default else "") + f"{wrong} bytes differ from default"
            record(
                f"sweep TILE_ROWS={config[0]} BLOCK_COLS={config[1]} warps={config[2]}",
                "row+col",
                run,
                False,
                note,
            )

    print(f"\n### NVFP4 quantize {rows}x{cols} bf16, {environment()['gpu']}\n")
    print(f"Copy {copy:.3f} TB/s (read+write). Single-pass floors: row+col 3.125 B/elem, one copy 2.5625.\n")
    print("| case | copies | ms | TB/s at floor | % of copy | % at two-pass floor | note |")
    print("|---|---|---:|---:|---:|---:|---|")
    for row in results:
        if "ms" not in row:
            print(f"| {row['case']} | {row['mode']} | failed | | | | {row['error'][:80]} |")
            continue
        two_pass = f"{row['pct_copy_two_pass_floor']:.1f}" if "pct_copy_two_pass_floor" in row else ""
        print(
            f"| {row['case']} | {row['mode']} | {row['ms']:.4f} | {row['TBps']:.3f} | {row['pct_copy']:.1f} "
            f"| {two_pass} | {row['note']} |"
        )
    payload = {
        "env": environment(),
        "shape": [rows, cols],
        "experts": experts,
        "device": device,
        "interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "single_pass_floor_B_per_elem": SINGLE_PASS_FLOOR,
        "copy_TBps": copy,
        "results": results,
    }
    path = write_json("bench_nvfp4.json", payload, args.json)
    print(f"\nJSON: {path}" if path else "\nJSON: not written (no --json and no $OUT)")


if __name__ == "__main__":
    main()
