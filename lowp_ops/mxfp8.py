"""Public MXFP8 functions (thin wrappers over ``torch.ops.lowp``)."""

from __future__ import annotations

import torch

from . import library
from .formats import FP8_DTYPES, MXFP8Tensor
from .meta.checks import check_float_dtype, require_tensor
from .meta.mxfp8 import normalize_fp8_dtype

__all__ = ["mxfp8_dequantize", "mxfp8_quantize"]


def mxfp8_quantize(
    x: torch.Tensor,
    fp8_dtype: str | torch.dtype = "e4m3",
    rowwise: bool = True,
    columnwise: bool = True,
    scale_layout: str = "compact",
) -> MXFP8Tensor:
    """Quantize ``x`` (bf16/fp16/fp32, any shape with >= 1 dim) to MXFP8, bit for bit as TransformerEngine.

    Args:
        x: the tensor; viewed as ``(rows, cols)`` with rows = all leading dims. Any rows/cols work: a
            partial 32-block quantizes its valid elements.
        fp8_dtype: ``"e4m3"`` (max 448) or ``"e5m2"`` (max 57344), or ``torch.float8_e4m3fn`` /
            ``torch.float8_e5m2``.
        rowwise / columnwise: which copies to write (1x32 blocks along the last dim / 32x1 along rows),
            both from one read of ``x``.
        scale_layout: ``"compact"`` or ``"swizzled"`` (the GEMM tile order of TE's ``optimize_for_gemm``).

    Returns an :class:`~lowp_ops.formats.MXFP8Tensor`. Numerics: per block ``e = roundup_pow2(amax *
    R)`` as E8M0 and ``q = rne_satfinite(x * 2^(127 - e))``. As TE, the block amax drops NaN: a NaN
    element encodes as 0x7F and its block keeps the scale of its finite elements; Inf saturates to
    +-max in a block with scale code 254.
    """
    require_tensor(x, "x")
    fp8_dtype = normalize_fp8_dtype(fp8_dtype)
    # The op checks its arguments (check_quantize_args) where it allocates its outputs, eager or traced.
    row_data, row_scale, col_data, col_scale = library.mxfp8_quantize(
        x, fp8_dtype, rowwise, columnwise, scale_layout
    )
    data_dtype = FP8_DTYPES[fp8_dtype]
    return MXFP8Tensor.of_op_outputs(
        row_data.view(data_dtype) if rowwise else None,
        row_scale if rowwise else None,
        col_data.view(data_dtype) if columnwise else None,
        col_scale if columnwise else None,
        fp8_dtype,
        scale_layout,
        x.shape,
    )


def mxfp8_dequantize(
    q: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16, use: str = "rowwise"
) -> torch.Tensor:
    """Dequantize one copy of ``q`` (``use="rowwise"`` or ``"columnwise"``) to ``dtype`` in ``q.shape``.

    Each element is ``dtype(fp32(q) * 2^(e - 127))`` (code 0 is 2^-127, 255 is NaN).
    """
    if not isinstance(q, MXFP8Tensor):
        raise TypeError(f"q must be an MXFP8Tensor, got {type(q).__name__}")
    check_float_dtype(dtype)
    if use not in ("rowwise", "columnwise"):
        raise ValueError(f"use must be 'rowwise' or 'columnwise', got {use!r}")
    data, scale = (q.row_data, q.row_scale) if use == "rowwise" else (q.col_data, q.col_scale)
    if data is None:
        raise ValueError(f"use={use!r} but q holds no {use} copy")
    return library.mxfp8_dequantize(data.view(torch.uint8), scale, q.fp8_dtype, use, q.scale_layout, dtype)
