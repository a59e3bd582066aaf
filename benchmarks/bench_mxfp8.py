"""MXFP8 quantize benchmark (H200): ``lowp_ops.mxfp8_quantize`` next to a torch.compile'd pure-PyTorch
quantizer of the same algorithm and a device-to-device copy measured in the same run, plus a sweep of the
Triton kernel's launch configuration (BLOCK_COLS x num_warps).

Effective bandwidth = byte floor x elements / time. Floors: row+col 4.0625 B/elem (read 2, write 1 + 1
data and 2/32 scales), row-wise or column-wise only 3.03125 B/elem. Timed calls cycle through ROTATE
copies of the input, a new one each call (our kernel loads it with an L2 evict_last hint: on one buffer
a call could find the previous call's input in L2).

Run:        PYTHONPATH=. python3 benchmarks/bench_mxfp8.py [--json PATH]   (default $OUT/bench_mxfp8.json)
CPU smoke:  TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_mxfp8.py --device cpu --shape 64 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _common import environment, rotating, write_json

import lowp_ops
from lowp_ops.kernels.mxfp8 import launch_mxfp8_quantize, quantize_config

MODES = {"row+col": (True, True), "row": (True, False), "col": (False, True)}
FLOOR_BYTES_PER_ELEM = {"row+col": 2 + 2 * (1 + 1 / 32), "row": 2 + 1 + 1 / 32, "col": 2 + 1 + 1 / 32}
SWEEP = [(block_cols, warps) for block_cols in (64, 128, 256) for warps in (1, 2, 4, 8)]
ROTATE = 3

# ------------------------------------------------------------ pure-PyTorch quantizer (torch.compile peer)
# TE's MXFP8 algorithm (docs/mxfp8.md#quantization) in plain tensor ops, written to fuse under
# Inductor: no Python-side padding copies, one reduction per direction.
FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0, 0x3B124925), "e5m2": (torch.float8_e5m2, 57344.0, 0x37924925)}


def e8m0_code_and_multiplier(amax: torch.Tensor, max_rcp: torch.Tensor):
    """E8M0 code (round v = amax * R up to a power of two) and the fp32 multiplier 2^(127 - code)."""
    v = amax * max_rcp
    bits = v.view(torch.int32)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ((exponent != 0) | (mantissa > 0x400000))
    code = exponent + round_up.to(torch.int32)
    code = torch.where(torch.isinf(v), 0xFE, code)
    code = torch.where(torch.isnan(v), 0xFF, code)
    multiplier_bits = (254 - code) << 23
    multiplier_bits = torch.where(code == 254, 0x00400000, multiplier_bits)
    multiplier_bits = torch.where(code == 255, 0x7FFFFFFF, multiplier_bits)
    return code.to(torch.uint8), multiplier_bits.view(torch.float32)


def cast_satfinite(scaled: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    """RNE cast with +-max saturation, NaN as 0x7F; returns the FP8 bytes as uint8."""
    dtype, fp8_max, _ = FP8[fp8_dtype]
    data = scaled.clamp(-fp8_max, fp8_max).to(dtype).view(torch.uint8)
    return torch.where(torch.isnan(scaled), 0x7F, data).to(torch.uint8)


def torch_mxfp8_quantize(x: torch.Tensor, fp8_dtype: str, rowwise: bool, columnwise: bool):
    """(row_data, row_scale, col_data, col_scale) as uint8, compact scales; a missing copy is None."""
    rows, cols = x.shape
    max_rcp = torch.tensor(FP8[fp8_dtype][2], dtype=torch.int32, device=x.device).view(torch.float32)
    xf = F.pad(x.float(), (0, -cols % 32, 0, -rows % 32))
    padded_rows, padded_cols = xf.shape
    row_data = row_scale = col_data = col_scale = None
    if rowwise:
        blocks = xf.view(padded_rows, padded_cols // 32, 32)
        code, multiplier = e8m0_code_and_multiplier(blocks.abs().amax(2), max_rcp)
        row_data = cast_satfinite(blocks * multiplier[:, :, None], fp8_dtype).view(padded_rows, padded_cols)
        row_data = row_data[:rows, :cols]
        row_scale = F.pad(code[:rows], (0, -code.shape[1] % 4, 0, -rows % 128))
    if columnwise:
        blocks = xf.view(padded_rows // 32, 32, padded_cols)
        code, multiplier = e8m0_code_and_multiplier(blocks.abs().amax(1), max_rcp)
        col_data = cast_satfinite(blocks * multiplier[:, None, :], fp8_dtype).view(padded_rows, padded_cols)
        col_data = col_data[:rows, :cols]
        col_scale = F.pad(code[:, :cols], (0, -cols % 128, 0, -code.shape[0] % 4))
    return row_data, row_scale, col_data, col_scale


# ------------------------------------------------------------------------------------------------ timing


def time_ms(fn, device: str, cpu_reps: int) -> float:
    """Median ms: triton's do_bench (L2 flushed per call) on CUDA, wall clock on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(cpu_reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_ms(n_bytes: int, device: str, cpu_reps: int) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), device, cpu_reps)


def mismatches(got, expected) -> int:
    """Bytes that differ between two (row_data, row_scale, col_data, col_scale) tuples."""
    total = 0
    for g, e in zip(got, expected, strict=True):
        if e is None:
            continue
        g = g.view(torch.uint8)
        total += g.numel() if g.shape != e.shape else int((g != e.view(torch.uint8)).sum())
    return total


def lowp_outputs(q) -> tuple:
    return q.row_data, q.row_scale, q.col_data, q.col_scale


# -------------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=(16384, 16384), metavar=("ROWS", "COLS"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--fp8-dtype", default="e4m3", choices=sorted(FP8))
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd quantizer")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    parser.add_argument("--cpu-reps", type=int, default=3, help="timed repetitions per case on CPU")
    parser.add_argument("--json", default=None, help="output path (default: $OUT/bench_mxfp8.json)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device, fp8_dtype = args.device, args.fp8_dtype
    rows, cols = args.shape
    elems = rows * cols
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    kernels_run = device == "cuda" or interpret
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    inputs = [x] + [x.clone() for _ in range(ROTATE - 1)]
    results: list[dict] = []

    same_size_ms = copy_ms(x.nbytes, device, args.cpu_reps)
    copy = {"same_size_bytes": 2 * x.nbytes, "same_size_ms": same_size_ms}
    copy["same_size_TBps"] = 2 * x.nbytes / same_size_ms / 1e9
    if device == "cuda":
        copy["2GiB_ms"] = copy_ms(2**30, device, args.cpu_reps)
        copy["2GiB_TBps"] = 2 * 2**30 / copy["2GiB_ms"] / 1e9
    copy_tbs = copy.get("2GiB_TBps", copy["same_size_TBps"])
    print(f"copy: same size {copy['same_size_TBps']:.3f} TB/s; ceiling used {copy_tbs:.3f} TB/s (read+write)")

    def record(case: str, mode: str, layout: str, fn, note: str = "") -> None:
        try:
            ms = time_ms(fn, device, args.cpu_reps)
        except Exception as error:  # a failed case is reported, the others still run
            print(f"{case} {mode} {layout}: FAILED {type(error).__name__}: {str(error)[:300]}")
            results.append({"case": case, "mode": mode, "layout": layout, "error": repr(error)[:300]})
            return
        tbs = FLOOR_BYTES_PER_ELEM[mode] * elems / ms / 1e9
        row = {
            "case": case,
            "mode": mode,
            "layout": layout,
            "ms": ms,
            "TBps": tbs,
            "pct_copy": 100 * tbs / copy_tbs,
        }
        results.append({**row, "note": note})
        print(f"{case:28s} {mode:8s} {layout:9s} {ms:9.4f} ms {tbs:6.3f} TB/s {row['pct_copy']:6.1f}% {note}")

    for mode, (rowwise, columnwise) in MODES.items():
        record(
            "lowp_ops.mxfp8_quantize",
            mode,
            "compact",
            rotating(inputs, lambda t, r=rowwise, c=columnwise: lowp_ops.mxfp8_quantize(t, fp8_dtype, r, c)),
        )
    record(
        "lowp_ops.mxfp8_quantize",
        "row+col",
        "swizzled",
        rotating(inputs, lambda t: lowp_ops.mxfp8_quantize(t, fp8_dtype, True, True, "swizzled")),
    )

    checks = {}
    if not args.no_compile:
        compiled = torch.compile(torch_mxfp8_quantize, dynamic=False)
        for mode, (rowwise, columnwise) in MODES.items():
            try:
                ours = lowp_outputs(lowp_ops.mxfp8_quantize(x, fp8_dtype, rowwise, columnwise, "compact"))
                theirs = compiled(x, fp8_dtype, rowwise, columnwise)
                checks[mode] = mismatches(ours, theirs)
            except Exception as error:
                print(f"torch.compile quantizer {mode}: FAILED {type(error).__name__}: {str(error)[:300]}")
                checks[mode] = repr(error)[:300]
                continue
            print(f"byte check lowp vs compiled ({mode}): {checks[mode]} mismatching bytes")
            record(
                "torch.compile pure-PyTorch",
                mode,
                "compact",
                rotating(inputs, lambda t, r=rowwise, c=columnwise: compiled(t, fp8_dtype, r, c)),
            )

    if not args.no_sweep and kernels_run:
        for mode, (rowwise, columnwise) in MODES.items():
            default = quantize_config(cols, rowwise, columnwise)
            expected = lowp_outputs(lowp_ops.mxfp8_quantize(x, fp8_dtype, rowwise, columnwise, "compact"))
            for block_cols, warps in SWEEP:
                run = lambda t, r=rowwise, c=columnwise, b=block_cols, w=warps: launch_mxfp8_quantize(
                    t, fp8_dtype, r, c, "compact", block_cols=b, num_warps=w
                )
                try:
                    wrong = mismatches(run(x), expected)
                except Exception as error:
                    wrong = f"{type(error).__name__}: {str(error)[:80]}"
                note = "launcher default; " if (block_cols, warps) == default else ""
                record(
                    f"kernel BLOCK_COLS={block_cols} warps={warps}",
                    mode,
                    "compact",
                    rotating(inputs, run),
                    note=f"{note}{wrong} bytes differ from lowp_ops",
                )
    elif not args.no_sweep:
        print("sweep skipped: the Triton kernels need CUDA or TRITON_INTERPRET=1")

    print(f"\n### MXFP8 quantize {rows}x{cols} bf16 -> {fp8_dtype}, {environment()['gpu']}\n")
    print(
        f"Copy ceiling {copy_tbs:.3f} TB/s (read+write). Byte check lowp vs compiled: {checks or 'skipped'}\n"
    )
    print("| case | mode | scales | ms | TB/s at floor | % of copy | note |")
    print("|---|---|---|---:|---:|---:|---|")
    for row in results:
        if "ms" in row:
            print(
                f"| {row['case']} | {row['mode']} | {row['layout']} | {row['ms']:.4f} | {row['TBps']:.3f} "
                f"| {row['pct_copy']:.1f} | {row['note']} |"
            )
        else:
            print(f"| {row['case']} | {row['mode']} | {row['layout']} | failed | | | {row['error'][:80]} |")
    payload = {
        "env": environment(),
        "shape": [rows, cols],
        "dtype": "bfloat16",
        "fp8_dtype": fp8_dtype,
        "device": device,
        "interpret": interpret,
        "floor_bytes_per_elem": FLOOR_BYTES_PER_ELEM,
        "copy": copy,
        "copy_TBps_used": copy_tbs,
        "byte_mismatches_vs_compiled": checks,
        "results": results,
    }
    path = write_json("bench_mxfp8.json", payload, args.json)
    print(f"\nJSON: {path}" if path else "\nJSON: not written (no --json and no $OUT)")


if __name__ == "__main__":
    main()
