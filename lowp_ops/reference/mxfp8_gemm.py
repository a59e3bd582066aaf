"""MXFP8 GEMM reference: dequantize (docs/mxfp8.md#dequantization, exact), then one fp32 matmul, one rounding.

``out = out_dtype(op(A) @ B)`` with ``op`` and the operand layouts as in :mod:`lowp_ops.meta.mxfp8_gemm`.
The Triton kernel equals this up to the order of its fp32 accumulation.
"""

from __future__ import annotations

import torch

from ..meta.mxfp8_gemm import mxfp8_gemm_output
from .mxfp8 import mxfp8_dequantize


def dequantized_operands(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_use: str,
    a_fp8_dtype: str,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    b_fp8_dtype: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(op(A) (M, K), B (K, N))``."""
    a = mxfp8_dequantize(a_data, a_scale, a_fp8_dtype, a_use, "compact", torch.float32)
    if a_use == "columnwise":
        a = a.t()
    if b_scale is None:
        return a, b.float()
    return a, mxfp8_dequantize(b, b_scale, b_fp8_dtype, "columnwise", "compact", torch.float32)


def mxfp8_gemm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_use: str,
    a_fp8_dtype: str,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    b_fp8_dtype: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reference of ``lowp::mxfp8_gemm``: ``(M, N)`` in ``out_dtype``."""
    out = mxfp8_gemm_output(a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, out_dtype)
    a, b32 = dequantized_operands(a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype)
    out.copy_(a @ b32)
    return out
