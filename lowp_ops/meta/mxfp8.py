"""Argument checks and output allocation for ``lowp::mxfp8_quantize`` / ``lowp::mxfp8_dequantize``.

The fake implementations and the Triton launchers both allocate through these functions, so they
cannot disagree on shapes, dtypes or strides.
"""

from __future__ import annotations

import torch

from ..formats import (
    FP8_DTYPE_NAMES,
    FP8_DTYPES,
    HIGH_PRECISION_DTYPES,
    MXFP8_BLOCK_SIZE,
    MXFP8_USES,
    SCALE_LAYOUTS,
    SCALE_TILE_COLS,
    SCALE_TILE_ROWS,
    ceil_div,
    round_up,
)
from .checks import check_bool, require
from .split_sizes import check_group_end_values


def flat_2d_dims(shape) -> tuple[int, int]:
    """(rows, cols) of a tensor viewed as 2-D: rows are all leading dims."""
    rows = 1
    for size in shape[:-1]:
        rows = rows * size
    return rows, shape[-1]


def row_scale_shape(rows, cols) -> tuple[int, int]:
    """Compact row-wise scale shape ``[roundup(rows, 128), roundup(ceil(cols / 32), 4)]``."""
    col_blocks = ceil_div(cols, MXFP8_BLOCK_SIZE)
    return round_up(rows, SCALE_TILE_ROWS), round_up(col_blocks, SCALE_TILE_COLS)


def col_scale_shape(rows, cols) -> tuple[int, int]:
    """Compact column-wise scale shape ``[roundup(ceil(rows / 32), 4), roundup(cols, 128)]``."""
    row_blocks = ceil_div(rows, MXFP8_BLOCK_SIZE)
    return round_up(row_blocks, SCALE_TILE_COLS), round_up(cols, SCALE_TILE_ROWS)


def normalize_fp8_dtype(fp8_dtype, name: str = "fp8_dtype") -> str:
    """``"e4m3"`` / ``"e5m2"`` from that name or from ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``;
    anything else raises a ValueError naming ``name``."""
    if isinstance(fp8_dtype, torch.dtype):
        fp8_dtype = FP8_DTYPE_NAMES.get(fp8_dtype, fp8_dtype)
    require(
        isinstance(fp8_dtype, str) and fp8_dtype in FP8_DTYPES,
        lambda: (
            f"{name} must be one of {sorted(FP8_DTYPES)}, torch.float8_e4m3fn or torch.float8_e5m2, "
            f"got {fp8_dtype!r}"
        ),
    )
    return fp8_dtype


def check_fp8_dtype(fp8_dtype: str, name: str = "fp8_dtype") -> None:
    """``fp8_dtype`` is a format name, ``"e4m3"`` or ``"e5m2"`` (what the ops take; the public functions
    turn torch dtypes into names with :func:`normalize_fp8_dtype` first), else a ValueError naming
    ``name``."""
    normalized = normalize_fp8_dtype(fp8_dtype, name)
    require(
        normalized == fp8_dtype,
        lambda: (
            f"{name} must be the format name {normalized!r} here, got {fp8_dtype!r} "
            "(lowp_ops.meta.mxfp8.normalize_fp8_dtype converts it)"
        ),
    )


def check_scale_layout(scale_layout: str) -> None:
    require(
        scale_layout in SCALE_LAYOUTS,
        lambda: f"scale_layout must be one of {list(SCALE_LAYOUTS)}, got {scale_layout!r}",
    )


def check_quantize_args(
    x: torch.Tensor, fp8_dtype: str, rowwise: bool, columnwise: bool, scale_layout: str
) -> None:
    require(
        x.dtype in HIGH_PRECISION_DTYPES, lambda: f"x must be float32, bfloat16 or float16, got {x.dtype}"
    )
    require(x.dim() >= 1, lambda: "x must have at least one dimension, got a 0-d tensor")
    check_fp8_dtype(fp8_dtype)
    check_scale_layout(scale_layout)
    check_bool(rowwise, "rowwise")
    check_bool(columnwise, "columnwise")
    require(rowwise or columnwise, lambda: "at least one of rowwise and columnwise must be True")


MXFP8_ROW_ALIGN = 16
"""Bytes a row of MXFP8 data is padded to (:func:`mxfp8_data_pitch`)."""


def mxfp8_data_pitch(cols):
    """The row stride of MXFP8 data with ``cols`` columns: ``cols`` rounded up to 16 bytes.

    An FP8 GEMM needs its operands' leading dimension in multiples of 16 bytes (cuBLASLt), and a kernel
    whose rows start 16-byte aligned stores whole words; rows of a width such as 50257 (GPT-2's
    vocabulary) would otherwise start at every byte offset. The padding bytes are not part of the
    tensor (a strided view); ``.contiguous()`` gives the unpadded copy."""
    return round_up(cols, MXFP8_ROW_ALIGN)


def mxfp8_quantize_outputs(
    x: torch.Tensor,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    zero_padding: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate ``(row_data, row_scale, col_data, col_scale)``; a copy not asked for is a 0-element tensor.

    Data have x's shape, rows :func:`mxfp8_data_pitch` apart (contiguous when ``cols`` is a multiple of
    16), and hold FP8 bit patterns as uint8 (``opcheck`` cannot compare float8 tensors; the public API
    views them as float8_e4m3fn / float8_e5m2). Scales are uint8 E8M0 codes, padded (row- and
    column-wise shapes above); the padding holds 0. ``zero_padding``: a scale tensor with padding is
    zero-filled here, for writers of the real blocks only (the reference); the GPU kernels write every
    code, the padding's included (``kernels.mxfp8.scale_padded_grid``), and pass False: a fill of both
    scale tensors at 8192 x 50257 took 2 x 4.9 us on the H200.
    """
    check_quantize_args(x, fp8_dtype, rowwise, columnwise, scale_layout)
    outputs = allocate_uint8(x, quantize_output_layout(x.shape, rowwise, columnwise))
    if zero_padding:
        zero_scale_padding(outputs[1], outputs[3], *flat_2d_dims(x.shape))
    return outputs


def quantize_output_layout(shape, rowwise: bool, columnwise: bool) -> tuple:
    """``(buffer shape, columns viewed or None)`` of :func:`mxfp8_quantize_outputs`'s four uint8 outputs.
    Data: a view of a ``(..., pitch)`` buffer (:func:`mxfp8_data_pitch`) to its ``cols``, so the last
    row's padding is allocated too (kernels write whole words up to the padded row's end); scales
    padded; a copy not asked for is 0-element. Launchers that keep a plan per shape allocate from it."""
    rows, cols = flat_2d_dims(shape)
    pitch = mxfp8_data_pitch(cols)
    data = ((*shape[:-1], pitch), None if pitch == cols else cols)
    unwanted = ((0,), None)
    return (
        data if rowwise else unwanted,
        (row_scale_shape(rows, cols) if rowwise else (0, 0), None),
        data if columnwise else unwanted,
        (col_scale_shape(rows, cols) if columnwise else (0, 0), None),
    )


def allocate_uint8(x: torch.Tensor, layout: tuple) -> tuple[torch.Tensor, ...]:
    """Uninitialized uint8 tensors on x's device, one per ``(buffer shape, columns viewed or None)``."""
    outputs = []
    for shape, viewed in layout:
        buffer = x.new_empty(shape, dtype=torch.uint8)
        outputs.append(buffer if viewed is None else buffer[..., :viewed])
    return tuple(outputs)


def zero_scale_padding(row_scale: torch.Tensor, col_scale: torch.Tensor, rows: int, cols: int) -> None:
    """Zero-fill, in place, each scale tensor of :func:`mxfp8_quantize_outputs` that has padding (what
    ``zero_padding=True`` does there), for writers of the data's blocks only; a tensor without padding is
    left for the writer to fill, a 0-element one (a copy not asked for) alone."""
    if row_scale.numel() and tuple(row_scale.shape) != (rows, ceil_div(cols, MXFP8_BLOCK_SIZE)):
        row_scale.zero_()
    if col_scale.numel() and tuple(col_scale.shape) != (ceil_div(rows, MXFP8_BLOCK_SIZE), cols):
        col_scale.zero_()


def check_dequantize_args(
    data: torch.Tensor, scale: torch.Tensor, fp8_dtype: str, use: str, scale_layout: str, dtype: torch.dtype
) -> None:
    # One expression for the valid case (a dequantize is a small kernel: its checks are host time).
    valid = (
        data.dtype == torch.uint8
        and scale.dtype == torch.uint8
        and type(fp8_dtype) is str
        and fp8_dtype in FP8_DTYPES
        and use in MXFP8_USES
        and scale_layout in SCALE_LAYOUTS
        and dtype in HIGH_PRECISION_DTYPES
        and data.dim() >= 1
    )
    if not valid:
        _explain_dequantize_args(data, scale, fp8_dtype, use, scale_layout, dtype)
    rows, cols = flat_2d_dims(data.shape)
    expected = row_scale_shape(rows, cols) if use == "rowwise" else col_scale_shape(rows, cols)
    if tuple(scale.shape) != tuple(expected):
        raise ValueError(
            f"scale must have shape {tuple(expected)} for {use} data of shape {tuple(data.shape)}, "
            f"got {tuple(scale.shape)}"
        )


def _explain_dequantize_args(
    data: torch.Tensor, scale: torch.Tensor, fp8_dtype: str, use: str, scale_layout: str, dtype: torch.dtype
) -> None:
    """Raise the ValueError that names the first bad argument of :func:`check_dequantize_args`."""
    require(data.dtype == torch.uint8, lambda: f"data must be uint8 FP8 bit patterns, got {data.dtype}")
    check_fp8_dtype(fp8_dtype)
    require(data.dim() >= 1, lambda: "data must have at least one dimension, got a 0-d tensor")
    require(scale.dtype == torch.uint8, lambda: f"scale must be uint8 E8M0 codes, got {scale.dtype}")
    require(use in MXFP8_USES, lambda: f"use must be one of {list(MXFP8_USES)}, got {use!r}")
    check_scale_layout(scale_layout)
    require(
        dtype in HIGH_PRECISION_DTYPES, lambda: f"dtype must be float32, bfloat16 or float16, got {dtype}"
    )


def mxfp8_dequantize_output(
    data: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: str,
    use: str,
    scale_layout: str,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dequantized tensor: data's shape, contiguous, ``dtype``; ``out`` (launchers only), when given,
    is checked and returned instead of a new allocation."""
    check_dequantize_args(data, scale, fp8_dtype, use, scale_layout, dtype)
    if out is None:
        return data.new_empty(data.shape, dtype=dtype)
    require(
        out.shape == data.shape and out.dtype == dtype and out.is_contiguous(),
        lambda: f"out must be a contiguous {dtype} tensor of shape {tuple(data.shape)}",
    )
    return out


def check_group_ends(group_ends: torch.Tensor | None, x: torch.Tensor) -> None:
    """``group_ends`` of ``lowp::mxfp8_round_trip``: None, or a 1-D int32 tensor on x's device; its values
    checked as every grouped op's (``meta.split_sizes``: on the host for CPU tensors by default, never
    for CUDA ones, where the effective ends apply)."""
    if group_ends is None:
        return
    require(
        isinstance(group_ends, torch.Tensor), lambda: f"group_ends must be a tensor, got {type(group_ends)}"
    )
    require(
        group_ends.dim() == 1 and group_ends.dtype == torch.int32,
        lambda: (
            f"group_ends must be a 1-D int32 tensor, got {group_ends.dtype} of shape"
            f" {tuple(group_ends.shape)}"
        ),
    )
    require(
        group_ends.device == x.device,
        lambda: f"group_ends must be on x's device ({x.device}), got {group_ends.device}",
    )
    check_group_end_values(group_ends, flat_2d_dims(x.shape)[0], "group_ends")


def mxfp8_round_trip_outputs(
    x: torch.Tensor, fp8_dtype: str, rowwise: bool, columnwise: bool, group_ends: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_values, col_values)``: x's values through the row-wise (1x32 blocks) and the column-wise
    (32x1 blocks) MXFP8 copy and back, in x's shape (contiguous) and dtype; a copy not asked for is a
    0-element tensor. ``group_ends``: see ``reference.mxfp8.group_block_rows``."""
    check_quantize_args(x, fp8_dtype, rowwise, columnwise, "compact")
    check_group_ends(group_ends, x)
    return tuple(x.new_empty(x.shape if wanted else (0,)) for wanted in (rowwise, columnwise))
