"""MXFP8 quantization, bit for bit TransformerEngine's algorithm (docs/mxfp8.md).

Per 32-element block (1x32 along the last dim for the row-wise copy, 32x1 along the rows for the
column-wise copy) of ``x`` viewed as ``(rows, cols)`` in fp32:

1. ``amax = max |x|`` over the block's non-NaN elements, exactly (TE reduces with ``fmaxf`` from 0,
   which drops NaN: an all-NaN block has amax 0);
2. ``v = fp32(amax * R)`` with R the fp32 constant 0x3B124925 (E4M3) or 0x37924925 (E5M2);
3. ``e`` = v rounded up to a power of two, as an E8M0 code (Inf -> 254, 0 -> 0; NaN -> 255, which
   step 1 never produces);
4. multiplier ``s = 2^(127 - e)`` from the bits ``(254 - e) << 23`` (e = 254 -> 2^-127, e = 255 -> NaN);
5. ``q = rne_satfinite(x * s)`` in E4M3 / E5M2 (Inf saturates to +-max, NaN becomes 0x7F).

So a NaN changes only its own byte (0x7F) and leaves its block's scale and other elements as the
finite elements give them; an Inf gives its block code 254, itself +-max and its finite neighbours
times 2^-127 (signed zeros unless near fp32's max). Beyond TE, any shape works: a partial block (rows
or cols not multiples of 32) quantizes its valid elements. Scale padding is zero.
"""

from __future__ import annotations

import torch

from ..formats import FP8_DTYPES, FP8_MAX, FP8_MAX_RCP, MXFP8_BLOCK_SIZE
from ..meta.mxfp8 import (
    flat_2d_dims,
    mxfp8_dequantize_output,
    mxfp8_quantize_outputs,
    mxfp8_round_trip_outputs,
)
from ..meta.split_sizes import valid_group_ends

_BLOCK = MXFP8_BLOCK_SIZE


def e8m0_from_amax(amax: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    """E8M0 code (int32) of the scale for blocks with fp32 ``amax`` (docs/mxfp8.md#quantization steps 2-3)."""
    v = amax.float() * FP8_MAX_RCP[fp8_dtype]
    bits = v.view(torch.int32)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    # Round up to a power of two; fp32 denormals up to 2^-127 stay at code 0 (docs/mxfp8.md step 3).
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + round_up.to(torch.int32)
    code = torch.where(torch.isinf(v), 0xFE, code)
    return torch.where(torch.isnan(v), 0xFF, code)


def quantize_multiplier(code: torch.Tensor) -> torch.Tensor:
    """fp32 multiplier 2^(127 - e) for E8M0 codes ``code`` (docs/mxfp8.md step 4; ``exp2f_rcp``)."""
    bits = (254 - code.to(torch.int32)) << 23
    bits = torch.where(code == 254, 0x00400000, bits)
    bits = torch.where(code == 255, 0x7FFFFFFF, bits)
    return bits.view(torch.float32)


def dequantize_multiplier(code: torch.Tensor) -> torch.Tensor:
    """fp32 value 2^(e - 127) of E8M0 codes (docs/mxfp8.md#dequantization): 0 -> 2^-127, 255 -> NaN."""
    bits = code.to(torch.int32) << 23
    bits = torch.where(code == 0, 0x00400000, bits)
    bits = torch.where(code == 255, 0x7FFFFFFF, bits)
    return bits.view(torch.float32)


def cast_to_fp8_satfinite(scaled: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    """RNE cast; finite overflow and Inf saturate to +-max, NaN becomes 0x7F (``cvt.rn.satfinite``)."""
    fp8_max = FP8_MAX[fp8_dtype]
    scaled = torch.where(scaled > fp8_max, fp8_max, scaled)
    scaled = torch.where(scaled < -fp8_max, -fp8_max, scaled)
    code = scaled.to(FP8_DTYPES[fp8_dtype]).view(torch.uint8)
    code = torch.where(torch.isnan(scaled), 0x7F, code).to(torch.uint8)
    return code.view(FP8_DTYPES[fp8_dtype])


def block_amax(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 max |x| along ``dim`` over the non-NaN elements, 0 when there are none (docs/mxfp8.md step 1)."""
    magnitudes = blocks.abs()
    # TE's fmaxf reduction starts from 0 and returns the non-NaN operand: NaN never reaches the amax.
    return torch.where(torch.isnan(magnitudes), 0.0, magnitudes).amax(dim=dim)


def _padded_blocks(x2d: torch.Tensor) -> torch.Tensor:
    """fp32 copy of x2d zero-padded to multiples of 32 in both dims (zeros never change an amax)."""
    rows, cols = x2d.shape
    pad_rows = -rows % _BLOCK
    pad_cols = -cols % _BLOCK
    return torch.nn.functional.pad(x2d.float(), (0, pad_cols, 0, pad_rows))


def quantize_rowwise(x2d: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (rows, cols) FP8, codes (rows, ceil(cols/32)) uint8) for 1x32 blocks."""
    rows, cols = x2d.shape
    padded = _padded_blocks(x2d)[:rows]
    blocks = padded.view(rows, padded.shape[1] // _BLOCK, _BLOCK)
    code = e8m0_from_amax(block_amax(blocks, 2), fp8_dtype)
    scaled = blocks * quantize_multiplier(code).unsqueeze(2)
    data = cast_to_fp8_satfinite(scaled, fp8_dtype).view(rows, padded.shape[1])[:, :cols]
    return data, code.to(torch.uint8)


def quantize_columnwise(x2d: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (rows, cols) FP8, codes (ceil(rows/32), cols) uint8) for 32x1 blocks."""
    rows, cols = x2d.shape
    padded = _padded_blocks(x2d)[:, :cols]
    blocks = padded.view(padded.shape[0] // _BLOCK, _BLOCK, cols)
    code = e8m0_from_amax(block_amax(blocks, 1), fp8_dtype)
    scaled = blocks * quantize_multiplier(code).unsqueeze(1)
    data = cast_to_fp8_satfinite(scaled, fp8_dtype).view(padded.shape[0], cols)[:rows]
    return data, code.to(torch.uint8)


def swizzle_scales(compact: torch.Tensor) -> torch.Tensor:
    """GEMM-swizzled copy of a padded row-wise scale buffer ``[128 a, 4 b]`` (docs/mxfp8.md#scale-layouts).

    Byte ``(i, j)`` goes to ``(i//128 * (b) + j//4) * 512 + (i%32)*16 + (i%128)//32 * 4 + j%4``.
    """
    rows, cols = compact.shape
    tiles = compact.view(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(rows, cols)


def unswizzle_scales(swizzled: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`."""
    rows, cols = swizzled.shape
    tiles = swizzled.view(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(rows, cols)


def swizzle_col_scales(compact: torch.Tensor) -> torch.Tensor:
    """Column-wise scales are swizzled as their transpose; the bytes keep the compact shape."""
    return swizzle_scales(compact.t().contiguous()).view(compact.shape)


def unswizzle_col_scales(swizzled: torch.Tensor) -> torch.Tensor:
    rows, cols = swizzled.shape
    return unswizzle_scales(swizzled.reshape(cols, rows)).t().contiguous()


def mxfp8_quantize(
    x: torch.Tensor, fp8_dtype: str, rowwise: bool, columnwise: bool, scale_layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::mxfp8_quantize``: ``(row_data, row_scale, col_data, col_scale)``.

    Shapes and dtypes as :func:`lowp_ops.meta.mxfp8.mxfp8_quantize_outputs`.
    """
    row_data, row_scale, col_data, col_scale = mxfp8_quantize_outputs(
        x, fp8_dtype, rowwise, columnwise, scale_layout
    )
    rows, cols = flat_2d_dims(x.shape)
    x2d = x.reshape(rows, cols)
    if rowwise:
        data, code = quantize_rowwise(x2d, fp8_dtype)
        row_data.copy_(data.view(torch.uint8).view(x.shape))
        row_scale[:rows, : code.shape[1]] = code
        if scale_layout == "swizzled":
            row_scale = swizzle_scales(row_scale)
    if columnwise:
        data, code = quantize_columnwise(x2d, fp8_dtype)
        col_data.copy_(data.view(torch.uint8).view(x.shape))
        col_scale[: code.shape[0], :cols] = code
        if scale_layout == "swizzled":
            col_scale = swizzle_col_scales(col_scale)
    return row_data, row_scale, col_data, col_scale


def mxfp8_dequantize(
    data: torch.Tensor, scale: torch.Tensor, fp8_dtype: str, use: str, scale_layout: str, dtype: torch.dtype
) -> torch.Tensor:
    """Reference of ``lowp::mxfp8_dequantize``: ``dtype(fp32(q) * 2^(e - 127))`` (docs/mxfp8.md)."""
    out = mxfp8_dequantize_output(data, scale, fp8_dtype, use, scale_layout, dtype)
    rows, cols = flat_2d_dims(data.shape)
    values = data.reshape(rows, cols).view(FP8_DTYPES[fp8_dtype]).float()
    if use == "rowwise":
        compact = unswizzle_scales(scale) if scale_layout == "swizzled" else scale
        multiplier = dequantize_multiplier(compact[:rows]).repeat_interleave(_BLOCK, dim=1)[:, :cols]
    else:
        compact = unswizzle_col_scales(scale) if scale_layout == "swizzled" else scale
        multiplier = dequantize_multiplier(compact[:, :cols]).repeat_interleave(_BLOCK, dim=0)[:rows]
    out.copy_((values * multiplier).view(data.shape))
    return out


def group_block_rows(group_ends: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    """Where each of ``rows`` rows goes when every group's rows start a new 32-row block.

    Groups: the rows ``[end[g-1], end[g])`` for the effective ends ``end`` of ``group_ends`` (the rule
    of every grouped op, ``meta.split_sizes.valid_group_ends``: an end outside ``[0, rows]`` is the last
    valid end before it, ``end[-1] = 0``), then the rows past the last end as one more group, so that
    every row is in exactly one group. Returns (int64 (rows,) slots, padded rows):
    row r's row in a zero-padded buffer of ``padded rows`` rows (a multiple of 32, fixed by ``rows`` and
    the number of groups) in which each group starts at a multiple of 32. On the device; no host read."""
    device = group_ends.device
    ends = valid_group_ends(group_ends, rows)
    ends = torch.cat([ends, ends.new_full((1,), rows)])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    block_rows = (ends - starts + _BLOCK - 1) // _BLOCK * _BLOCK
    first_slot = torch.cumsum(block_rows, 0) - block_rows
    row = torch.arange(rows, device=device)
    group = torch.searchsorted(ends, row, right=True)
    padded_rows = (-(-rows // _BLOCK) + ends.numel()) * _BLOCK
    return first_slot[group] + row - starts[group], padded_rows


def mxfp8_round_trip(
    x: torch.Tensor, fp8_dtype: str, rowwise: bool, columnwise: bool, group_ends: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::mxfp8_round_trip``: :func:`mxfp8_dequantize` of each copy of
    :func:`mxfp8_quantize`, to x's dtype (shapes: ``meta.mxfp8.mxfp8_round_trip_outputs``).

    ``group_ends`` (int32, E): the column-wise 32-row blocks restart at each group of rows
    (:func:`group_block_rows`), as quantizing each group (an MoE expert's tokens) as its own tensor does;
    a group's last block may be partial. The row-wise copy does not depend on it."""
    row_out, col_out = mxfp8_round_trip_outputs(x, fp8_dtype, rowwise, columnwise, group_ends)
    if columnwise and group_ends is not None:
        # Both copies of the padded rows (row-wise blocks lie within a row: the padding changes none).
        rows, cols = flat_2d_dims(x.shape)
        slots, padded_rows = group_block_rows(group_ends, rows)
        padded = x.new_zeros(padded_rows, cols).index_copy_(0, slots, x.reshape(rows, cols))
        copies = mxfp8_round_trip(padded, fp8_dtype, rowwise, True)
        for out, values in zip((row_out, col_out), copies, strict=True):
            if values.numel():
                out.copy_(values[slots].view(x.shape))
        return row_out, col_out
    row_data, row_scale, col_data, col_scale = mxfp8_quantize(x, fp8_dtype, rowwise, columnwise, "compact")
    if rowwise:
        row_out.copy_(mxfp8_dequantize(row_data, row_scale, fp8_dtype, "rowwise", "compact", x.dtype))
    if columnwise:
        col_out.copy_(mxfp8_dequantize(col_data, col_scale, fp8_dtype, "columnwise", "compact", x.dtype))
    return row_out, col_out
