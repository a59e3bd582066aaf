"""Argument checks and output allocation for ``lowp::nvfp4_quantize`` / ``lowp::nvfp4_dequantize``."""

from __future__ import annotations

import torch

from ..formats import HIGH_PRECISION_DTYPES, NVFP4_BLOCK_SIZE, SCALE_TILE_COLS, SCALE_TILE_ROWS
from .checks import require
from .mxfp8 import flat_2d_dims


def _round_up(a, b):
    return (a + b - 1) // b * b


def scale_shape(rows, cols) -> tuple[int, int]:
    """Padded E4M3 scale shape of a ``(rows, cols)`` operand quantized in 1x16 blocks along ``cols``."""
    blocks = (cols + NVFP4_BLOCK_SIZE - 1) // NVFP4_BLOCK_SIZE
    return _round_up(rows, SCALE_TILE_ROWS), _round_up(blocks, SCALE_TILE_COLS)


def _check_amax(amax: torch.Tensor | None, name: str) -> None:
    if amax is not None:
        require(
            amax.dtype == torch.float32 and amax.numel() == 1,
            lambda: f"{name} must be a float32 tensor with one element, got {amax.dtype} {tuple(amax.shape)}",
        )


def check_quantize_args(
    x: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    block_2d: bool,
) -> None:
    require(
        x.dtype in HIGH_PRECISION_DTYPES, lambda: f"x must be float32, bfloat16 or float16, got {x.dtype}"
    )
    require(x.dim() >= 1, lambda: "x must have at least one dimension, got a 0-d tensor")
    require(rowwise or columnwise, lambda: "at least one of rowwise and columnwise must be True")
    rows, cols = flat_2d_dims(x.shape)
    require(
        not rowwise or cols % 2 == 0,
        lambda: f"rowwise needs an even last dim (two E2M1 per byte), got {cols}",
    )
    require(not columnwise or rows % 2 == 0, lambda: f"columnwise needs an even row count, got {rows}")
    require(
        not (rht and block_2d), lambda: "rht and block_2d cannot be combined (2-D blocks are for weights)"
    )
    if rht and columnwise:
        require(x.dtype == torch.bfloat16, lambda: f"rht needs bfloat16 x (a bf16 transform), got {x.dtype}")
        require(rows % NVFP4_BLOCK_SIZE == 0, lambda: f"rht needs rows divisible by 16, got {rows}")
    _check_amax(amax_rowwise, "amax_rowwise")
    _check_amax(amax_columnwise, "amax_columnwise")


def nvfp4_quantize_outputs(
    x: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    block_2d: bool,
) -> tuple[torch.Tensor, ...]:
    """``(row_data, row_scale, col_data, col_scale, amax_rowwise, amax_columnwise)``: uint8 data
    ``(M, K/2)`` / ``(K, M/2)``, uint8 E4M3 scales zero-padded to 128x4 tiles, fp32 ``(1,)`` amaxes; a copy
    not asked for is a 0-element tensor."""
    check_quantize_args(x, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d)
    rows, cols = flat_2d_dims(x.shape)

    def copy(wanted: bool, outer, inner):
        if not wanted:
            return x.new_empty((0, 0), dtype=torch.uint8), x.new_zeros((0, 0), dtype=torch.uint8)
        data = x.new_empty((outer, inner // 2), dtype=torch.uint8)
        return data, x.new_zeros(scale_shape(outer, inner), dtype=torch.uint8)

    row_data, row_scale = copy(rowwise, rows, cols)
    col_data, col_scale = copy(columnwise, cols, rows)
    amax = x.new_empty((1,), dtype=torch.float32)
    return row_data, row_scale, col_data, col_scale, amax, torch.empty_like(amax)


def nvfp4_dequantize_output(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``(R, 2 * data.shape[1])`` in ``dtype``, contiguous."""
    require(
        data.dtype == torch.uint8 and data.dim() == 2, lambda: "data must be 2-D uint8 (two E2M1 per byte)"
    )
    require(scale.dtype == torch.uint8, lambda: f"scale must be uint8 E4M3 bits, got {scale.dtype}")
    rows, cols = data.shape[0], 2 * data.shape[1]
    expected = scale_shape(rows, cols)
    require(
        tuple(scale.shape) == tuple(expected),
        lambda: (
            f"scale must have shape {tuple(expected)} for data of shape {tuple(data.shape)}, "
            f"got {tuple(scale.shape)}"
        ),
    )
    _check_amax(amax, "amax")
    require(
        dtype in HIGH_PRECISION_DTYPES, lambda: f"dtype must be float32, bfloat16 or float16, got {dtype}"
    )
    return data.new_empty((rows, cols), dtype=dtype)
