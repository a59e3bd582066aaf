"""Argument checks and output allocation for ``lowp::mxfp8_gemm``: ``out = op(A) @ B``.

``A`` is one MXFP8 copy whose 32-element blocks run along the GEMM's K dimension:

- ``a_use="rowwise"``: ``a_data`` is ``(M, K)`` with row-wise (1x32) scales; ``op(A) = A``;
- ``a_use="columnwise"``: ``a_data`` is ``(K, M)`` with column-wise (32x1) scales; ``op(A) = A^T``.

``B`` is ``(K, N)``: bf16/fp16/fp32 (``b_scale`` None), or MXFP8 data (uint8) with column-wise scales,
i.e. 32x1 blocks along K. Scales are compact (docs/mxfp8.md#scale-layouts).
"""

from __future__ import annotations

import torch

from ..formats import HIGH_PRECISION_DTYPES, MXFP8_USES
from .checks import require
from .mxfp8 import check_fp8_dtype, col_scale_shape, row_scale_shape

OTHER_OPERANDS = ("bf16", "mxfp8")
"""How the GEMM treats the operand that is not dY: as given (``"bf16"``: the input's own dtype) or
MXFP8-quantized with its blocks along K, as TransformerEngine's MXFP8 recipe does (``"mxfp8"``)."""


def check_other_operand(other_operand: str) -> None:
    require(
        other_operand in OTHER_OPERANDS,
        lambda: f"other_operand must be one of {list(OTHER_OPERANDS)}, got {other_operand!r}",
    )


def gemm_dims(a_data: torch.Tensor, a_use: str, b: torch.Tensor) -> tuple[int, int, int]:
    """(M, N, K) of ``op(A) @ B``."""
    rows, cols = a_data.shape
    m, k = (rows, cols) if a_use == "rowwise" else (cols, rows)
    return m, b.shape[1], k


def _check_scale(name: str, scale: torch.Tensor, expected) -> None:
    require(scale.dtype == torch.uint8, lambda: f"{name} must be uint8 E8M0 codes, got {scale.dtype}")
    require(
        tuple(scale.shape) == tuple(expected),
        lambda: f"{name} must have the compact shape {tuple(expected)}, got {tuple(scale.shape)}",
    )


def check_mxfp8_gemm_args(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_use: str,
    a_fp8_dtype: str,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    b_fp8_dtype: str,
    out_dtype: torch.dtype,
) -> None:
    require(a_use in MXFP8_USES, lambda: f"a_use must be one of {list(MXFP8_USES)}, got {a_use!r}")
    require(a_data.dtype == torch.uint8, lambda: f"a_data must be uint8 FP8 bit patterns, got {a_data.dtype}")
    require(a_data.dim() == 2, lambda: f"a_data must be 2-D, got {a_data.dim()}-D")
    require(b.dim() == 2, lambda: f"b must be 2-D (K, N), got {b.dim()}-D")
    check_fp8_dtype(a_fp8_dtype)
    m, n, k = gemm_dims(a_data, a_use, b)
    require(b.shape[0] == k, lambda: f"b must have K = {k} rows (op(a) is {m} x {k}), got {tuple(b.shape)}")
    rows, cols = a_data.shape
    a_expected = row_scale_shape(rows, cols) if a_use == "rowwise" else col_scale_shape(rows, cols)
    _check_scale("a_scale", a_scale, a_expected)
    if b_scale is None:
        require(
            b.dtype in HIGH_PRECISION_DTYPES,
            lambda: f"b without b_scale must be float32, bfloat16 or float16, got {b.dtype}",
        )
    else:
        require(
            b.dtype == torch.uint8, lambda: f"b with b_scale must be uint8 FP8 bit patterns, got {b.dtype}"
        )
        check_fp8_dtype(b_fp8_dtype)
        _check_scale("b_scale", b_scale, col_scale_shape(k, n))
    require(
        out_dtype in HIGH_PRECISION_DTYPES,
        lambda: f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}",
    )


def mxfp8_gemm_output(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_use: str,
    a_fp8_dtype: str,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    b_fp8_dtype: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(M, N)`` contiguous in ``out_dtype``."""
    check_mxfp8_gemm_args(a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, out_dtype)
    m, n, _ = gemm_dims(a_data, a_use, b)
    return a_data.new_empty((m, n), dtype=out_dtype)
