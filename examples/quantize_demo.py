"""Quantize a tensor to MXFP8 (row-wise and column-wise copies), dequantize both copies, and print the
errors and the quantize throughput.

    python examples/quantize_demo.py                       # 4096 x 4096 bf16, CUDA if present
    python examples/quantize_demo.py --device cpu --rows 1024 --cols 8192 --fp8-dtype e5m2

On CUDA the Triton kernel runs; on CPU the pure-PyTorch reference (the same bytes).
"""

from __future__ import annotations

import argparse
import time

import torch

import lowp_ops

MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
MIN_NORMAL_EXPONENT = {"e4m3": -6, "e5m2": -14}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="rows of x (default 4096)")
    parser.add_argument("--cols", type=int, default=4096, help="columns of x (default 4096)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--fp8-dtype", default="e4m3", choices=["e4m3", "e5m2"])
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default: 50 on CUDA, 2 on CPU)")
    args = parser.parse_args()
    for name in ("rows", "cols", "iters"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    return args


def block_scales(q: lowp_ops.MXFP8Tensor, use: str, rows: int, cols: int) -> torch.Tensor:
    """Per element, the dequantization scale 2^(e - 127) of its block (compact layout), in fp32."""
    codes = q.row_scale[:rows] if use == "rowwise" else q.col_scale[:, :cols]
    scales = torch.exp2(codes.float() - 127)
    dim = 1 if use == "rowwise" else 0
    scales = scales.repeat_interleave(32, dim=dim)
    return scales[:rows, :cols]


def report_errors(x: torch.Tensor, q: lowp_ops.MXFP8Tensor, fp8_dtype: str) -> None:
    rows, cols = x.shape
    exact = x.float()
    half_ulp = 2.0 ** -(MANTISSA_BITS[fp8_dtype] + 1)
    print(f"relative error bound in the FP8 normal range: half an ulp = {half_ulp:.4%}")
    for use in ("rowwise", "columnwise"):
        x_hat = lowp_ops.mxfp8_dequantize(q, torch.float32, use=use)
        error = (x_hat - exact).abs()
        nonzero = exact != 0
        relative = error[nonzero] / exact.abs()[nonzero]
        # Elements that land in FP8's normal range after scaling; smaller ones are FP8 subnormals or 0.
        normal = exact.abs() >= block_scales(q, use, rows, cols) * 2.0 ** MIN_NORMAL_EXPONENT[fp8_dtype]
        relative_normal = error[normal] / exact.abs()[normal]
        print(
            f"{use:>10}: max rel err (normal range) {relative_normal.max().item():.4%}, "
            f"mean rel err {relative.mean().item():.4%}, "
            f"norm-wise rel err {(error.norm() / exact.norm()).item():.4%}, "
            f"elements below FP8 normal range {(~normal).float().mean().item():.3%}"
        )


def time_quantize(x: torch.Tensor, fp8_dtype: str, iters: int) -> float:
    """Seconds per quantize call (both copies); the caller has already made the warm-up call."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        lowp_ops.mxfp8_quantize(x, fp8_dtype)
    sync()
    return (time.perf_counter() - start) / iters


def main() -> None:
    args = parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols, device=device, dtype=torch.bfloat16)
    print(f"x: {args.rows} x {args.cols} bf16 on {device} -> MXFP8 {args.fp8_dtype} (row-wise + column-wise)")

    q = lowp_ops.mxfp8_quantize(x, args.fp8_dtype)  # also the warm-up call (Triton compiles here)
    print(
        f"row_data {tuple(q.row_data.shape)} {q.row_data.dtype}, row_scale {tuple(q.row_scale.shape)}; "
        f"col_data {tuple(q.col_data.shape)}, col_scale {tuple(q.col_scale.shape)}"
    )
    report_errors(x, q, args.fp8_dtype)

    iters = args.iters if args.iters is not None else (50 if device == "cuda" else 2)
    seconds = time_quantize(x, args.fp8_dtype, iters)
    print(f"quantize: {seconds * 1e3:.3f} ms per call, {x.nbytes / seconds / 1e9:.2f} GB/s of bf16 input")


if __name__ == "__main__":
    main()
