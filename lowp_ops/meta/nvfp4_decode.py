"""Argument checks and output allocation for the NVFP4 local-value decodes (``lowp::nvfp4_decode_rows``,
``lowp::nvfp4_group_decode_columns``): the bf16 ``e2m1(code) * fp32(E4M3 block scale)`` operands of the
emulated NVFP4 GEMMs; and for their outputs' global scales (``lowp::nvfp4_scale_rows``)."""

from __future__ import annotations

import torch

from ..formats import NVFP4_BLOCK_SIZE, ceil_div
from .checks import require
from .nvfp4 import group_col_scale_cols
from .split_sizes import check_split_size_values, check_split_sizes

DECODE_SPLIT_MULTIPLE = 2
"""The grouped column-wise copy holds each expert's tokens two per byte: even split sizes."""


def _check_uint8(t: torch.Tensor, name: str) -> None:
    require(t.dtype == torch.uint8, lambda: f"{name} must be uint8, got {t.dtype}")


def nvfp4_decode_rows_output(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 ``(..., R, C)`` contiguous for packed codes ``data`` ``(R, C/2)`` or ``(B, R, C/2)`` and an E4M3
    scale matrix ``scale`` of the same rank with at least ``R`` rows and ``ceil(C/16)`` columns (the
    padded scales of ``lowp::nvfp4_quantize``, stacked along B for a batch)."""
    _check_uint8(data, "data")
    _check_uint8(scale, "scale")
    require(data.dim() in (2, 3), lambda: f"data must be 2-D (R, C/2) or 3-D (B, R, C/2), got {data.dim()}-D")
    require(
        scale.dim() == data.dim(),
        lambda: f"scale must have the rank of data ({data.dim()}-D), got {scale.dim()}-D",
    )
    rows, cols = data.shape[-2], 2 * data.shape[-1]
    blocks = ceil_div(cols, NVFP4_BLOCK_SIZE)
    require(
        scale.shape[-2] >= rows and scale.shape[-1] >= blocks,
        lambda: (
            f"scale must have at least {rows} rows and {blocks} columns (one per 16 values) for data of "
            f"shape {tuple(data.shape)}, got {tuple(scale.shape)}"
        ),
    )
    require(scale.device == data.device, lambda: "scale must be on the device of data")
    require(
        data.dim() == 2 or scale.shape[0] == data.shape[0],
        lambda: f"scale must have the batch size of data ({data.shape[0]}), got {scale.shape[0]}",
    )
    return data.new_empty((*data.shape[:-1], cols), dtype=torch.bfloat16)


def nvfp4_group_decode_columns_output(
    col_data: torch.Tensor, col_scale: torch.Tensor, split_sizes: torch.Tensor, hidden, tokens
) -> torch.Tensor:
    """bf16 ``(hidden, tokens)`` contiguous for the grouped column-wise copy of
    ``lowp::nvfp4_group_quantize`` (``meta.nvfp4.nvfp4_group_quantize_outputs``): flat ``col_data`` of
    ``hidden * tokens / 2`` bytes, 2-D ``col_scale`` with at least ``hidden`` rows and the grouped
    matrix's ``tokens // 16 + 4 E`` columns. Split sizes: int32/int64 (E,) on col_data's device, >= 0 and
    even (checked on the host where ``meta.split_sizes`` says); any total (tokens past the experts decode
    as 0)."""
    _check_uint8(col_data, "col_data")
    _check_uint8(col_scale, "col_scale")
    require(hidden >= 0 and tokens >= 0, lambda: f"hidden and tokens must be >= 0, got {hidden}, {tokens}")
    require(tokens % 2 == 0, lambda: f"tokens must be even (two E2M1 per byte), got {tokens}")
    require(
        col_data.dim() == 1 and col_data.shape[0] == hidden * tokens // 2,
        lambda: (
            f"col_data must be 1-D with hidden * tokens / 2 = {hidden * tokens // 2} bytes, "
            f"got shape {tuple(col_data.shape)}"
        ),
    )
    check_split_sizes(split_sizes, device=col_data.device, of="col_data")
    check_split_size_values(
        split_sizes, tokens, total="any", multiple=DECODE_SPLIT_MULTIPLE, why="two codes per byte"
    )
    scale_cols = group_col_scale_cols(tokens, split_sizes.shape[0])
    require(
        col_scale.dim() == 2 and col_scale.shape[0] >= hidden and col_scale.shape[1] >= scale_cols,
        lambda: (
            f"col_scale must be 2-D with at least {hidden} rows and {scale_cols} columns, "
            f"got shape {tuple(col_scale.shape)}"
        ),
    )
    require(col_scale.device == col_data.device, lambda: "col_scale must be on the device of col_data")
    return col_data.new_empty((hidden, tokens), dtype=torch.bfloat16)


def nvfp4_scale_rows_output(
    y: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor, ends: torch.Tensor | None
) -> torch.Tensor:
    """bf16 ``(R, C)`` contiguous for a 2-D bf16 GEMM output ``y`` whose rows belong to E experts: fp32
    ``(E,)`` amaxes of both operands and either the int32/int64 ``(E,)`` group ends of its rows (valid
    ends: non-decreasing, within ``[0, R]``; rows past the last end belong to no expert) or None, for E
    equal blocks of ``R / E`` rows (a weight gradient ``(E, N, K)`` viewed as ``(E * N, K)``)."""
    require(
        y.dtype == torch.bfloat16 and y.dim() == 2, lambda: f"y must be 2-D bf16, got {y.dim()}-D {y.dtype}"
    )
    for amax, name in ((amax_a, "amax_a"), (amax_b, "amax_b")):
        require(
            amax.dtype == torch.float32 and amax.dim() == 1 and amax.shape[0] >= 1,
            lambda amax=amax, name=name: f"{name} must be 1-D float32 (E,), got {amax.dim()}-D {amax.dtype}",
        )
        require(amax.device == y.device, lambda name=name: f"{name} must be on the device of y")
    experts = amax_a.shape[0]
    require(
        amax_b.shape[0] == experts,
        lambda: f"amax_b must have amax_a's {experts} experts, got {amax_b.shape[0]}",
    )
    if ends is None:
        require(
            y.shape[0] % experts == 0,
            lambda: f"without ends, y's {y.shape[0]} rows must split evenly over the {experts} experts",
        )
    else:
        require(
            ends.dtype in (torch.int32, torch.int64) and ends.dim() == 1 and ends.shape[0] == experts,
            lambda: (
                f"ends must be 1-D int32/int64 with one end per expert ({experts}), got "
                f"{ends.dim()}-D {ends.dtype} {tuple(ends.shape)}"
            ),
        )
        require(ends.device == y.device, lambda: "ends must be on the device of y")
    return y.new_empty(y.shape)
