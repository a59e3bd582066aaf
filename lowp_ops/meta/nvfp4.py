"""Argument checks and output allocation for ``lowp::nvfp4_quantize`` / ``lowp::nvfp4_dequantize``."""

from __future__ import annotations

import torch

from ..formats import (
    HIGH_PRECISION_DTYPES,
    NVFP4_BLOCK_SIZE,
    SCALE_TILE_COLS,
    SCALE_TILE_ROWS,
    ceil_div,
    round_up,
)
from .checks import check_bool, require, require_tensor
from .mxfp8 import flat_2d_dims
from .split_sizes import check_split_size_values, check_split_sizes, host_check_wanted


def scale_shape(rows, cols) -> tuple[int, int]:
    """Padded E4M3 scale shape of a ``(rows, cols)`` operand quantized in 1x16 blocks along ``cols``."""
    blocks = ceil_div(cols, NVFP4_BLOCK_SIZE)
    return round_up(rows, SCALE_TILE_ROWS), round_up(blocks, SCALE_TILE_COLS)


def _check_amax(amax: torch.Tensor | None, name: str, device: torch.device, given: bool = True) -> None:
    """An fp32 one-element amax on ``device`` (the data's); a ``given`` one (a quantizer's argument, not a
    container's) as :func:`_check_given_amax_values`."""
    if amax is None:
        return
    require_tensor(amax, name)
    require(
        amax.dtype == torch.float32 and amax.numel() == 1,
        lambda: f"{name} must be a float32 tensor with one element, got {amax.dtype} {tuple(amax.shape)}",
    )
    _require_on(amax, name, device)
    if given:
        _check_given_amax_values(amax, name)


def _require_on(t: torch.Tensor, name: str, device: torch.device) -> None:
    require(t.device == device, lambda: f"{name} must be on the data's device {device}, got {t.device}")


def _check_given_amax_values(amax: torch.Tensor, name: str) -> None:
    """A given amax is not negative, which would flip the scales' signs (inf and NaN are the amaxes of
    data holding them: defined results); read where ``meta.split_sizes`` reads device values on the host
    (CPU tensors by default: no sync on CUDA)."""
    if host_check_wanted(amax):
        require(not bool((amax < 0).any()), lambda: f"{name} must be >= 0, got {amax.tolist()}")


def check_given_amax_values(amax_rowwise: torch.Tensor | None, amax_columnwise: torch.Tensor | None) -> None:
    """The value check of :func:`_check_given_amax_values` for each given amax: every call (a launcher's
    plan checks the rest of its arguments once per specialization, and values vary between calls)."""
    for amax, name in ((amax_rowwise, "amax_rowwise"), (amax_columnwise, "amax_columnwise")):
        if amax is not None:
            _check_given_amax_values(amax, name)


def check_quantize_args(
    x: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    block_2d: bool,
    sr_seed: torch.Tensor | None = None,
) -> None:
    require(
        x.dtype in HIGH_PRECISION_DTYPES, lambda: f"x must be float32, bfloat16 or float16, got {x.dtype}"
    )
    require(x.dim() >= 1, lambda: "x must have at least one dimension, got a 0-d tensor")
    check_bool(rowwise, "rowwise")
    check_bool(columnwise, "columnwise")
    check_bool(rht, "rht")
    check_bool(block_2d, "block_2d")
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
    _check_amax(amax_rowwise, "amax_rowwise", x.device)
    _check_amax(amax_columnwise, "amax_columnwise", x.device)
    check_sr_seed(sr_seed, x.device)


def check_sr_seed(sr_seed: torch.Tensor | None, device: torch.device) -> None:
    if sr_seed is not None:
        require_tensor(sr_seed, "sr_seed")
        _require_on(sr_seed, "sr_seed", device)
        require(
            sr_seed.dtype == torch.int64 and sr_seed.numel() == 2,
            lambda: f"sr_seed must be int64 [seed, offset], got {sr_seed.dtype} {tuple(sr_seed.shape)}",
        )


def nvfp4_quantize_outputs(
    x: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    block_2d: bool,
    sr_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(row_data, row_scale, col_data, col_scale, amax_rowwise, amax_columnwise)``: uint8 data
    ``(M, K/2)`` / ``(K, M/2)``, uint8 E4M3 scales zero-padded to 128x4 tiles, fp32 ``(1,)`` amaxes; a copy
    not asked for is a 0-element tensor."""
    check_quantize_args(x, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d, sr_seed)
    rows, cols = flat_2d_dims(x.shape)
    return allocate_outputs(x, quantize_output_layout(rows, cols, rowwise, columnwise), 1)


def quantize_output_layout(rows: int, cols: int, rowwise: bool, columnwise: bool) -> tuple:
    """``(shape, zero-filled)`` of :func:`nvfp4_quantize_outputs`'s four uint8 outputs."""

    def copy(wanted: bool, outer, inner):
        if not wanted:
            return ((0, 0), False), ((0, 0), False)
        shape = scale_shape(outer, inner)
        # Only the padding needs zeros: the kernel writes every scale of the data (no fill launch else).
        padded = shape != (outer, ceil_div(inner, NVFP4_BLOCK_SIZE))
        return ((outer, inner // 2), False), (shape, padded)

    return (*copy(rowwise, rows, cols), *copy(columnwise, cols, rows))


def allocate_outputs(x: torch.Tensor, layout: tuple, experts: int) -> tuple[torch.Tensor, ...]:
    """The four uint8 outputs of ``layout`` (``(shape, zero-filled)`` each) on x's device, then the two
    fp32 ``(experts,)`` amaxes."""
    outputs = [(x.new_zeros if zero else x.new_empty)(shape, dtype=torch.uint8) for shape, zero in layout]
    amax = x.new_empty((experts,), dtype=torch.float32)
    return (*outputs, amax, torch.empty_like(amax))


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
    _check_amax(amax, "amax", data.device, given=False)
    require(
        dtype in HIGH_PRECISION_DTYPES, lambda: f"dtype must be float32, bfloat16 or float16, got {dtype}"
    )
    return data.new_empty((rows, cols), dtype=dtype)


# ------------------------------------------------------------------------------------- grouped form


def group_col_scale_cols(tokens, experts) -> int:
    """Columns of the grouped column-wise scale matrix: expert e's ``roundup(ceil(m_e/16), 4)`` columns
    for any split of ``tokens`` rows over ``experts`` fit in ``tokens // 16 + 4 * experts``."""
    return tokens // NVFP4_BLOCK_SIZE + SCALE_TILE_COLS * experts


def group_split_multiple(columnwise: bool, rht: bool, block_2d: bool = False) -> int:
    """What every expert's row count must be a multiple of: 16 for 16x16 blocks or the column-wise copy
    with the RHT (16-row blocks), 2 for the column-wise copy (two E2M1 per byte along the rows), else 1."""
    if block_2d:
        return NVFP4_BLOCK_SIZE
    if not columnwise:
        return 1
    return NVFP4_BLOCK_SIZE if rht else 2


def _check_group_amax(amax: torch.Tensor | None, experts: int, name: str, device: torch.device) -> None:
    if amax is not None:
        require_tensor(amax, name)
        require(
            amax.dtype == torch.float32 and amax.dim() == 1 and amax.shape[0] == experts,
            lambda: f"{name} must be float32 of shape ({experts},), got {amax.dtype} {tuple(amax.shape)}",
        )
        _require_on(amax, name, device)
        _check_given_amax_values(amax, name)


def check_group_quantize_args(
    x: torch.Tensor,
    split_sizes: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    sr_seed: torch.Tensor | None = None,
    block_2d: bool = False,
) -> None:
    check_split_sizes(split_sizes, device=x.device)
    require(x.dim() == 2, lambda: f"x must be 2-D (tokens, hidden), got {x.dim()}-D")
    check_quantize_args(x, rowwise, columnwise, rht, None, None, block_2d, sr_seed)
    experts = split_sizes.shape[0]
    _check_group_amax(amax_rowwise, experts, "amax_rowwise", x.device)
    _check_group_amax(amax_columnwise, experts, "amax_columnwise", x.device)
    check_group_split_values(split_sizes, x.shape[0], columnwise, rht, block_2d)


def nvfp4_group_dequantize_output(
    data: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    split_sizes: torch.Tensor,
    dtype: torch.dtype,
    use: str,
    tokens: int,
    hidden: int,
    multiple: int,
) -> torch.Tensor:
    """``(tokens, hidden)`` (``use="rowwise"``) or ``(hidden, tokens)`` (``"columnwise"``) in ``dtype`` of
    one copy of ``lowp::nvfp4_group_quantize``'s outputs (their layout: :func:`nvfp4_group_quantize_outputs`;
    ``multiple``: the :func:`group_split_multiple` the quantization used)."""
    require(use in ("rowwise", "columnwise"), lambda: f"use must be 'rowwise' or 'columnwise', got {use!r}")
    check_split_sizes(split_sizes, device=data.device, of="data")
    experts = split_sizes.shape[0]
    require(
        data.dtype == torch.uint8 and scale.dtype == torch.uint8,
        lambda: f"data and scale must be uint8, got {data.dtype} and {scale.dtype}",
    )
    if use == "rowwise":
        data_shape, scale_shape_ = (tokens, hidden // 2), scale_shape(tokens, hidden)
    else:
        data_shape = (hidden * tokens // 2,)
        scale_shape_ = (round_up(hidden, SCALE_TILE_ROWS), group_col_scale_cols(tokens, experts))
    require(
        tuple(data.shape) == data_shape and tuple(scale.shape) == tuple(scale_shape_),
        lambda: (
            f"data and scale must have shapes {data_shape} and {tuple(scale_shape_)}, got "
            f"{tuple(data.shape)} and {tuple(scale.shape)}"
        ),
    )
    require(
        amax.dtype == torch.float32 and tuple(amax.shape) == (experts,) and amax.device == data.device,
        lambda: (
            f"amax must be float32 of shape ({experts},) on the data's device, got {amax.dtype} "
            f"{tuple(amax.shape)} on {amax.device}"
        ),
    )
    require(
        dtype in HIGH_PRECISION_DTYPES, lambda: f"dtype must be float32, bfloat16 or float16, got {dtype}"
    )
    require(multiple in (1, 2, NVFP4_BLOCK_SIZE), lambda: f"multiple must be 1, 2 or 16, got {multiple}")
    return data.new_empty((tokens, hidden) if use == "rowwise" else (hidden, tokens), dtype=dtype)


def check_group_split_values(
    split_sizes: torch.Tensor, tokens: int, columnwise: bool, rht: bool, block_2d: bool
) -> None:
    """The values of the split sizes, where ``meta.split_sizes`` checks them on the host: they sum to
    ``tokens``, each a multiple of :func:`group_split_multiple`."""
    multiple = group_split_multiple(columnwise, rht, block_2d)
    why = (
        "block_2d: 16x16 blocks"
        if block_2d
        else "columnwise with rht: 16-row blocks"
        if rht
        else "columnwise: two rows per byte"
    )
    check_split_size_values(split_sizes, tokens, multiple=multiple, why=why)


def nvfp4_group_quantize_outputs(
    x: torch.Tensor,
    split_sizes: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    sr_seed: torch.Tensor | None = None,
    block_2d: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Outputs of ``lowp::nvfp4_group_quantize`` for x (T, K) and E experts; shapes depend on T, K, E only.

    - ``row_data`` (T, K/2) and ``row_scale`` [roundup(T, 128), roundup(ceil(K/16), 4)]: the row-wise
      copy of all rows in token order (each row with its expert's amax), as for an ungrouped x.
    - ``col_data`` (K * T / 2,) flat: expert e's (K, m_e / 2) matrix, contiguous, at byte offset
      ``K * row0_e / 2`` (``row0_e = sum_{i<e} m_i``), experts in order (TE's grouped layout).
    - ``col_scale`` [roundup(K, 128), T // 16 + 4E]: expert e's [roundup(K, 128), roundup(ceil(m_e/16), 4)]
      block in the columns from ``sum_{i<e} roundup(ceil(m_i/16), 4)``; every other byte is 0.
    - ``amax_rowwise``, ``amax_columnwise``: fp32 (E,).
    A copy not asked for is a 0-element tensor. Split sizes: >= 0, summing to T, multiples of
    :func:`group_split_multiple` (checked on the host where ``meta.split_sizes`` says); others take
    their effective boundaries with that multiple, and the rows of no expert get row-wise scales 0
    (they decode to +-0; their data bytes, and the column-wise bytes past the experts, are unspecified)."""
    check_group_quantize_args(
        x, split_sizes, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, sr_seed, block_2d
    )
    tokens, hidden = x.shape
    experts = split_sizes.shape[0]
    return allocate_outputs(
        x, group_quantize_output_layout(tokens, hidden, experts, rowwise, columnwise), experts
    )


def group_quantize_output_layout(
    tokens: int, hidden: int, experts: int, rowwise: bool, columnwise: bool
) -> tuple:
    """``(shape, zero-filled)`` of :func:`nvfp4_group_quantize_outputs`'s four uint8 outputs."""
    none = ((0, 0), False)  # a copy not asked for
    row = (((tokens, hidden // 2), False), (scale_shape(tokens, hidden), True)) if rowwise else (none, none)
    col_scale_shape = (round_up(hidden, SCALE_TILE_ROWS), group_col_scale_cols(tokens, experts))
    col = (((hidden * tokens // 2,), False), (col_scale_shape, True)) if columnwise else (none, none)
    return (*row, *col)
