"""Triton MXFP8 quantize / dequantize (TE's bit algorithm, docs/mxfp8.md).

One program owns a 32-row x BLOCK_COLS tile, read once: it writes the row-wise copy (1x32 blocks, via
a [32, BLOCK_COLS/32, 32] view) and the column-wise copy (32x1 blocks, a reduction over the tile's
rows) with their E8M0 scales. The tile helpers are shared with the cross-entropy backward, which
quantizes its gradient in registers. One warp per tile keeps each 32-row reduction inside the warp;
the kernels are instruction-bound on sm90, so tiles wholly in bounds skip every mask (EVEN).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..formats import (
    FP8_DTYPES,
    FP8_MAX,
    FP8_MAX_RCP,
    MXFP8_BLOCK_SIZE,
    SCALE_TILE_COLS,
    SCALE_TILE_ROWS,
    ceil_div,
    next_power_of_2,
    round_up,
)
from ..meta.mxfp8 import (
    allocate_uint8,
    check_quantize_args,
    flat_2d_dims,
    mxfp8_data_pitch,
    mxfp8_dequantize_output,
    mxfp8_quantize_outputs,
    mxfp8_round_trip_outputs,
    quantize_output_layout,
)
from ..meta.split_sizes import check_group_end_values
from .bf16_pairs import to_dtype_rne
from .launch import INTERPRETING_CONSTEXPR as INTERPRETING
from .launch import PlanCache, cached_launch, tensor_key
from .split_sizes import valid_group_ends

TILE_ROWS = MXFP8_BLOCK_SIZE
SOFTWARE_FP8_CAST = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
# L2 hint on the input although it is read once: H200 16384^2 row+col 89.4% -> 93.1% of copy with a new
# input buffer each call, same bytes (2026-11-30; the fused CE backward's load measured the same way).
X_EVICTION = tl.constexpr("evict_last")


@triton.jit
def e8m0_from_amax(amax, MAX_RCP: tl.constexpr):
    """E8M0 code (int32) of fp32 block amaxes: ``v = amax * R`` rounded up to a power of two
    (docs/mxfp8.md step 3).

    Integer form (v >= 0): adding 0x7FFFFF carries any nonzero mantissa into the exponent; fp32
    denormals round up only above 2^-127 (add 0x3FFFFF); E = 0xFE with a mantissa and Inf saturate to
    254; NaN is 255 (as TE's ``float_to_e8m0``; :func:`block_amax` never returns NaN). Eight
    instructions: the code is recomputed by every thread that holds its block.
    """
    v = amax * MAX_RCP
    bits = v.to(tl.int32, bitcast=True)
    code = (bits + tl.where(bits < 0x800000, 0x3FFFFF, 0x7FFFFF)) >> 23
    return tl.where(v != v, 0xFF, tl.minimum(code, 0xFE))


@triton.jit
def quantize_multiplier(code):
    """fp32 2^(127 - e) from the bits ``(254 - e) << 23`` (docs/mxfp8.md#quantization step 4)."""
    bits = (254 - code) << 23
    bits = tl.where(code == 254, 0x00400000, bits)
    bits = tl.where(code == 255, 0x7FFFFFFF, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dequantize_multiplier(code):
    """fp32 2^(e - 127) of E8M0 codes (docs/mxfp8.md#dequantization): 0 -> 2^-127, 255 -> NaN."""
    bits = code << 23
    bits = tl.where(code == 0, 0x00400000, bits)
    bits = tl.where(code == 255, 0x7FFFFFFF, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_to_fp32(values):
    """``values`` widened to fp32, exactly. The interpreter (triton 3.9) decodes the FP8 (E4M3 / E5M2) Inf
    and NaN codes as finite numbers (E4M3 0x7F as 480), so there FP8 codes are decoded from their bits."""
    if INTERPRETING and (values.dtype == tl.float8e4nv or values.dtype == tl.float8e5):
        bits = values.to(tl.uint8, bitcast=True).to(tl.uint32)
        sign = (bits & 0x80) << 24
        magnitude = bits & 0x7F
        if values.dtype == tl.float8e4nv:  # 4 exponent bits (bias 7), 3 mantissa bits, 0x7F NaN
            exponent, mantissa = magnitude >> 3, magnitude & 7
            normal = ((exponent + 120) << 23) | (mantissa << 20)
            subnormal = mantissa.to(tl.float32) * 0.001953125  # 2^-9
            special = tl.where(magnitude == 0x7F, 0x7FC00000, 0)
        else:  # 5 exponent bits (bias 15), 2 mantissa bits, exponent 31: Inf or NaN
            exponent, mantissa = magnitude >> 2, magnitude & 3
            normal = ((exponent + 112) << 23) | (mantissa << 21)
            subnormal = mantissa.to(tl.float32) * 0.0000152587890625  # 2^-16
            special = tl.where(exponent == 31, tl.where(mantissa == 0, 0x7F800000, 0x7FC00000), 0)
        magnitude_bits = tl.where(exponent == 0, subnormal.to(tl.uint32, bitcast=True), normal)
        magnitude_bits = tl.where(special != 0, special, magnitude_bits).to(tl.uint32)
        return (magnitude_bits | sign).to(tl.float32, bitcast=True)
    return values.to(tl.float32)


@triton.jit
def _max_drop_nan(a, b):
    # maxnum: the non-NaN operand wins (PTX max.f32, numpy fmax in the interpreter), as TE's fmaxf.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.NONE)


@triton.jit
def block_amax(values, axis: tl.constexpr):
    """max |values| along ``axis`` over the non-NaN elements, 0 for an all-NaN block (docs/mxfp8.md step 1).

    A NaN then keeps its block's scale and encodes as 0x7F alone, as TE's ``fmaxf`` block reduction,
    which starts from 0: the final maxnum with 0 turns an all-NaN block's NaN into 0.
    """
    magnitude = tl.abs(values)
    if INTERPRETING:
        # The same value from numpy's nanmax: the interpreter runs a combine function element by element.
        amax = tl.max(tl.where(magnitude != magnitude, 0.0, magnitude), axis)
    else:
        amax = _max_drop_nan(tl.reduce(magnitude, axis, _max_drop_nan), 0.0)
    return amax


@triton.jit
def cast_satfinite(scaled, FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """RNE cast to FP8 with +-max saturation and NaN -> 0x7F: ``cvt.rn.satfinite`` on the GPU.

    The Triton interpreter's own fp32 -> fp8 cast neither rounds to nearest nor saturates, so there
    the rounding is done in fp32 first (add and subtract 2^23 ulp) and the cast only sees
    representable values.
    """
    if SOFTWARE_FP8_CAST:
        MANTISSA_BITS: tl.constexpr = 3 if FP8_MAX == 448.0 else 2
        MIN_ULP_EXPONENT: tl.constexpr = -9 if FP8_MAX == 448.0 else -16
        bits = scaled.to(tl.int32, bitcast=True)
        magnitude = tl.minimum(tl.abs(scaled), FP8_MAX)
        exponent = (magnitude.to(tl.int32, bitcast=True) >> 23) - 127
        ulp_exponent = tl.maximum(exponent - MANTISSA_BITS, MIN_ULP_EXPONENT)
        shifter = ((ulp_exponent + 23 + 127) << 23).to(tl.float32, bitcast=True)
        rounded = ((magnitude + shifter) - shifter).to(tl.int32, bitcast=True)
        # Sign by bit (Triton's unary minus is 0 - x, which loses -0.0).
        signed = (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)
        code = signed.to(OUT_DTYPE).to(tl.uint8, bitcast=True)
        code = tl.where(scaled != scaled, 0x7F, code).to(OUT_DTYPE, bitcast=True)
    else:
        code = scaled.to(OUT_DTYPE)
    return code


@triton.jit
def swizzled_scale_offset(i, j, n_tiles_x):
    """Byte offset of scale (i, j) in the GEMM-swizzled layout: 128x4 tiles of 512 bytes
    (docs/mxfp8.md#scale-layouts)."""
    tile = (i // 128) * n_tiles_x + j // 4
    return tile * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)


@triton.jit
def tile_coords(cols, BLOCK_COLS: tl.constexpr):
    """(32-row block, column tile) of this program on a 1-D grid that walks along the rows first:
    programs resident together then cover long row segments, which DRAM serves near copy speed
    (H200, a bf16 tile read and written as two fp8 arrays: 95-97% of copy, against 79-92% when
    adjacent programs walk down a column strip)."""
    n_col_tiles = tl.cdiv(cols, BLOCK_COLS)
    pid = tl.program_id(0)
    return pid // n_col_tiles, pid % n_col_tiles


@triton.jit
def scale_tile_coords(cols, BLOCK_COLS: tl.constexpr):
    """:func:`tile_coords` on the grid of :func:`scale_padded_grid`, whose columns run to a multiple of
    128 (4 scale columns of 32: the scales' padding)."""
    return tile_coords(tl.cdiv(cols, 128) * 128, BLOCK_COLS)


@triton.jit
def store_tile(ptr, rows_idx, cols_idx, rows, cols, row_stride, values, EVEN: tl.constexpr):
    """Store a [32, BLOCK_COLS] tile into a (rows, cols) buffer whose rows are ``row_stride`` apart;
    EVEN: the tile is in bounds."""
    ptrs = ptr + rows_idx[:, None].to(tl.int64) * row_stride + cols_idx[None, :]
    if EVEN:
        tl.store(ptrs, values)
    else:
        tl.store(ptrs, values, mask=(rows_idx[:, None] < rows) & (cols_idx[None, :] < cols))


@triton.jit
def load_tile_fp32(
    x_ptr, stride_row, rows_idx, cols_idx, rows, cols, EVEN: tl.constexpr, EVICTION: tl.constexpr
):
    """The [32, BLOCK_COLS] tile of x as fp32, out-of-bounds lanes 0 (EVEN: the tile is in bounds). The
    upcast follows the load at once (bf16 math is wrong in the Triton interpreter)."""
    ptrs = x_ptr + rows_idx[:, None].to(tl.int64) * stride_row + cols_idx[None, :]
    if EVEN:
        return tl.load(ptrs, eviction_policy=EVICTION).to(tl.float32)
    in_bounds = (rows_idx[:, None] < rows) & (cols_idx[None, :] < cols)
    return tl.load(ptrs, mask=in_bounds, other=0.0, eviction_policy=EVICTION).to(tl.float32)


@triton.jit
def quantize_rows(
    x, BLOCK_COLS: tl.constexpr, FP8_MAX: tl.constexpr, MAX_RCP: tl.constexpr, OUT_DTYPE: tl.constexpr
):
    """(E8M0 codes [32, BLOCK_COLS/32] int32, FP8 data [32, BLOCK_COLS/32, 32]) of the fp32 tile ``x``
    in 1x32 blocks, in registers (docs/mxfp8.md#quantization)."""
    blocks = tl.reshape(x, [32, BLOCK_COLS // 32, 32])
    code = e8m0_from_amax(block_amax(blocks, 2), MAX_RCP)
    return code, cast_satfinite(blocks * quantize_multiplier(code)[:, :, None], FP8_MAX, OUT_DTYPE)


@triton.jit
def quantize_columns(x, FP8_MAX: tl.constexpr, MAX_RCP: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """(E8M0 codes [BLOCK_COLS] int32, FP8 data [32, BLOCK_COLS]) of the fp32 tile ``x`` in 32x1 blocks."""
    code = e8m0_from_amax(block_amax(x, 0), MAX_RCP)
    return code, cast_satfinite(x * quantize_multiplier(code)[None, :], FP8_MAX, OUT_DTYPE)


@triton.jit
def store_row_scale_codes(scale_ptr, code, scale_row, scale_col, rows, scale_cols, SWIZZLED: tl.constexpr):
    """E8M0 ``code`` at row-wise scale (``scale_row``, ``scale_col``), index tensors broadcastable to it,
    for rows below ``rows`` (the data's, or the padded scale rows to write the padding too). A block
    wholly past the data (a last tile's tail, rows past the data) has code 0, which is the padding
    value."""
    if SWIZZLED:
        offset = swizzled_scale_offset(scale_row, scale_col, scale_cols // 4)
    else:
        offset = scale_row * scale_cols + scale_col
    tl.store(scale_ptr + offset, code.to(tl.uint8), mask=(scale_row < rows) & (scale_col < scale_cols))


@triton.jit
def store_column_scale_codes(
    scale_ptr, code, cols_idx, row_block, cols, scale_rows, scale_cols, SWIZZLED: tl.constexpr
):
    """E8M0 ``code`` of columns ``cols_idx`` below ``cols`` (the data's, or ``scale_cols`` to write the
    padding too) at column-wise scale (``row_block``, column); columns past the data have code 0, the
    padding value."""
    if SWIZZLED:
        # Column-wise scales are swizzled as their transpose: i = column, j = 32-row block.
        offset = swizzled_scale_offset(cols_idx, row_block, scale_rows // 4)
    else:
        offset = row_block * scale_cols + cols_idx
    tl.store(scale_ptr + offset, code.to(tl.uint8), mask=cols_idx < cols)


@triton.jit
def store_padding_scales(
    row_block,
    tile_col0,
    row_scale_ptr,
    row_scale_rows,
    row_scale_cols,
    col_scale_ptr,
    col_scale_rows,
    col_scale_cols,
    BLOCK_COLS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    SWIZZLED: tl.constexpr,
):
    """Zero codes for the scales of a 32-row x BLOCK_COLS tile wholly past the data (the scales' rows
    and columns padded to 128): the programs of :func:`scale_padded_grid` that hold no data write
    them, so no launch fills the scale tensors first."""
    if ROWWISE:
        scale_row = row_block * 32 + tl.arange(0, 32)[:, None]
        scale_col = tile_col0 // 32 + tl.arange(0, BLOCK_COLS // 32)[None, :]
        zeros = tl.zeros([32, BLOCK_COLS // 32], tl.int32)
        store_row_scale_codes(
            row_scale_ptr, zeros, scale_row, scale_col, row_scale_rows, row_scale_cols, SWIZZLED
        )
    if COLWISE:
        cols_idx = tile_col0 + tl.arange(0, BLOCK_COLS)
        zeros = tl.zeros([BLOCK_COLS], tl.int32)
        store_column_scale_codes(
            col_scale_ptr,
            zeros,
            cols_idx,
            row_block,
            col_scale_cols,
            col_scale_rows,
            col_scale_cols,
            SWIZZLED,
        )


@triton.jit
def quantize_tile_rowwise(
    x,
    rows_idx,
    cols_idx,
    rows,
    data_stride,
    tile_col0,
    data_ptr,
    scale_ptr,
    scale_rows,
    scale_cols,
    BLOCK_COLS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAX_RCP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    SWIZZLED: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Quantize an fp32 tile ``x`` [32, BLOCK_COLS] (out-of-bounds lanes hold 0; the tile starts on a
    32-column boundary) in 1x32 blocks: data at ``data_ptr[row * data_stride + col]`` (zeros in the
    row's padding up to ``data_stride``), E8M0 codes at row-wise scale (row, col // 32) of the
    (``scale_rows``, ``scale_cols``) scales, the tile's share of their padding included."""
    N_BLOCKS: tl.constexpr = BLOCK_COLS // 32
    code, data = quantize_rows(x, BLOCK_COLS, FP8_MAX, MAX_RCP, OUT_DTYPE)
    data = tl.reshape(data, [32, BLOCK_COLS])
    # Bounded by the padded row (the tile holds zeros past cols): Triton then proves whole 8-byte runs.
    store_tile(data_ptr, rows_idx, cols_idx, rows, data_stride, data_stride, data, EVEN)
    scale_col = tile_col0 // 32 + tl.arange(0, N_BLOCKS)[None, :]
    store_row_scale_codes(scale_ptr, code, rows_idx[:, None], scale_col, scale_rows, scale_cols, SWIZZLED)


@triton.jit
def quantize_tile_columnwise(
    x,
    rows_idx,
    cols_idx,
    rows,
    data_stride,
    row_block,
    data_ptr,
    scale_ptr,
    scale_rows,
    scale_cols,
    FP8_MAX: tl.constexpr,
    MAX_RCP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    SWIZZLED: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Quantize an fp32 tile ``x`` [32, BLOCK_COLS] in 32x1 blocks (the tile is one block high): data
    (not transposed) at ``data_ptr[row * data_stride + col]`` (zeros in the padding), E8M0 codes at
    column-wise scale (row_block, col)."""
    code, data = quantize_columns(x, FP8_MAX, MAX_RCP, OUT_DTYPE)
    store_tile(data_ptr, rows_idx, cols_idx, rows, data_stride, data_stride, data, EVEN)
    store_column_scale_codes(
        scale_ptr, code, cols_idx, row_block, scale_cols, scale_rows, scale_cols, SWIZZLED
    )


@triton.jit
def quantize_tile(
    x,
    rows_idx,
    cols_idx,
    rows,
    data_stride,
    tile_col0,
    row_block,
    row_data_ptr,
    row_scale_ptr,
    row_scale_rows,
    row_scale_cols,
    col_data_ptr,
    col_scale_ptr,
    col_scale_rows,
    col_scale_cols,
    BLOCK_COLS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAX_RCP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    SWIZZLED: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Write the requested copies of the fp32 tile ``x`` [32, BLOCK_COLS] (this program's 32-row block
    ``row_block``, first column ``tile_col0``), both from registers."""
    if ROWWISE:
        quantize_tile_rowwise(
            x,
            rows_idx,
            cols_idx,
            rows,
            data_stride,
            tile_col0,
            row_data_ptr,
            row_scale_ptr,
            row_scale_rows,
            row_scale_cols,
            BLOCK_COLS,
            FP8_MAX,
            MAX_RCP,
            OUT_DTYPE,
            SWIZZLED,
            EVEN,
        )
    if COLWISE:
        quantize_tile_columnwise(
            x,
            rows_idx,
            cols_idx,
            rows,
            data_stride,
            row_block,
            col_data_ptr,
            col_scale_ptr,
            col_scale_rows,
            col_scale_cols,
            FP8_MAX,
            MAX_RCP,
            OUT_DTYPE,
            SWIZZLED,
            EVEN,
        )


@cached_launch
@triton.jit
def mxfp8_quantize_kernel(
    x_ptr,
    stride_row,
    rows,
    cols,
    data_stride,
    row_data_ptr,
    row_scale_ptr,
    row_scale_rows,
    row_scale_cols,
    col_data_ptr,
    col_scale_ptr,
    col_scale_rows,
    col_scale_cols,
    BLOCK_COLS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAX_RCP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    SWIZZLED: tl.constexpr,
    EVEN: tl.constexpr,
):
    """One program: a 32 x BLOCK_COLS tile read once; both copies come from registers. EVEN: every tile
    of data is in bounds (rows % 32 == 0, cols % BLOCK_COLS == 0), so no masks are evaluated. The grid
    is :func:`scale_padded_grid`'s: a program past the data writes its share of the scales' padding."""
    row_block, col_tile = scale_tile_coords(cols, BLOCK_COLS)
    tile_col0 = col_tile * BLOCK_COLS
    if (row_block * 32 < rows) & (tile_col0 < cols):
        rows_idx = row_block * 32 + tl.arange(0, 32)
        cols_idx = tile_col0 + tl.arange(0, BLOCK_COLS)
        x = load_tile_fp32(x_ptr, stride_row, rows_idx, cols_idx, rows, cols, EVEN, X_EVICTION)
        quantize_tile(
            x,
            rows_idx,
            cols_idx,
            rows,
            data_stride,
            tile_col0,
            row_block,
            row_data_ptr,
            row_scale_ptr,
            row_scale_rows,
            row_scale_cols,
            col_data_ptr,
            col_scale_ptr,
            col_scale_rows,
            col_scale_cols,
            BLOCK_COLS,
            FP8_MAX,
            MAX_RCP,
            OUT_DTYPE,
            ROWWISE,
            COLWISE,
            SWIZZLED,
            EVEN,
        )
    else:
        store_padding_scales(
            row_block,
            tile_col0,
            row_scale_ptr,
            row_scale_rows,
            row_scale_cols,
            col_scale_ptr,
            col_scale_rows,
            col_scale_cols,
            BLOCK_COLS,
            ROWWISE,
            COLWISE,
            SWIZZLED,
        )


@cached_launch
@triton.jit
def mxfp8_dequantize_kernel(
    data_ptr,
    data_stride,
    scale_ptr,
    out_ptr,
    rows,
    cols,
    scale_rows,
    scale_cols,
    BLOCK_COLS: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    SWIZZLED: tl.constexpr,
):
    rows_idx = tl.program_id(0) * 32 + tl.arange(0, 32)
    cols_idx = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    in_bounds = (rows_idx[:, None] < rows) & (cols_idx[None, :] < cols)
    rows64 = rows_idx[:, None].to(tl.int64)
    values = tl.load(data_ptr + rows64 * data_stride + cols_idx[None, :], mask=in_bounds, other=0.0)
    values = fp8_to_fp32(values)
    if COLUMNWISE:
        i = cols_idx[None, :]
        j = rows_idx[:, None] // 32
        n_tiles_x = scale_rows // 4
        compact = j * scale_cols + i
    else:
        i = rows_idx[:, None]
        j = cols_idx[None, :] // 32
        n_tiles_x = scale_cols // 4
        compact = i * scale_cols + j
    scale_offset = swizzled_scale_offset(i, j, n_tiles_x) if SWIZZLED else compact
    code = tl.load(scale_ptr + scale_offset, mask=in_bounds, other=0).to(tl.int32)
    out = values * dequantize_multiplier(code)
    out_ptrs = out_ptr + rows64 * cols + cols_idx[None, :]
    tl.store(out_ptrs, to_dtype_rne(out, out_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def group_block_rows(row_block, ends_ptr, n_ends, rows, BLOCK_GROUPS: tl.constexpr):
    """(first row, end row) of the ``row_block``-th 32-row block when each group of rows starts a new
    block (``reference.mxfp8.group_block_rows``): the groups end at the effective group ends
    (``split_sizes.valid_group_ends``), then at ``rows``; past the last block, an empty range."""
    g = tl.arange(0, BLOCK_GROUPS)
    # start of group g = end of group g - 1, read one index back (0 for the first, rows past the ends)
    ends = tl.load(ends_ptr + g, mask=g < n_ends, other=rows)
    starts = tl.load(ends_ptr + g - 1, mask=(g >= 1) & (g <= n_ends), other=0)
    starts = tl.where(g > n_ends, rows, starts)
    ends = valid_group_ends(ends, rows)
    starts = valid_group_ends(starts, rows)
    blocks = (ends - starts + 31) // 32
    last_block = tl.cumsum(blocks, 0)  # one past each group's last block
    group = tl.sum((last_block <= row_block).to(tl.int32), 0)
    mine = g == group
    first_block = tl.sum(tl.where(mine, last_block - blocks, 0), 0)
    first_row = tl.sum(tl.where(mine, starts, 0), 0) + (row_block - first_block) * 32
    return first_row, tl.sum(tl.where(mine, ends, 0), 0)


@triton.jit
def round_trip_tile(
    x_ptr,
    stride_row,
    rows_idx,
    cols_idx,
    row_end,
    cols,
    row_out_ptr,
    col_out_ptr,
    BLOCK_COLS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAX_RCP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    EVEN: tl.constexpr,
):
    """The rows ``rows_idx`` (below ``row_end``) x ``cols_idx`` of x read once, each requested copy
    quantized in registers and multiplied back by its scale; EVEN: the tile is in bounds."""
    x = load_tile_fp32(x_ptr, stride_row, rows_idx, cols_idx, row_end, cols, EVEN, "")
    if ROWWISE:
        code, data = quantize_rows(x, BLOCK_COLS, FP8_MAX, MAX_RCP, OUT_DTYPE)
        values = tl.reshape(fp8_to_fp32(data) * dequantize_multiplier(code)[:, :, None], [32, BLOCK_COLS])
        values = to_dtype_rne(values, row_out_ptr.dtype.element_ty)
        store_tile(row_out_ptr, rows_idx, cols_idx, row_end, cols, cols, values, EVEN)
    if COLWISE:
        code, data = quantize_columns(x, FP8_MAX, MAX_RCP, OUT_DTYPE)
        values = to_dtype_rne(
            fp8_to_fp32(data) * dequantize_multiplier(code)[None, :], col_out_ptr.dtype.element_ty
        )
        store_tile(col_out_ptr, rows_idx, cols_idx, row_end, cols, cols, values, EVEN)


@cached_launch
@triton.jit
def mxfp8_round_trip_kernel(
    x_ptr,
    stride_row,
    rows,
    cols,
    row_out_ptr,
    col_out_ptr,
    ends_ptr,
    n_ends,
    BLOCK_COLS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAX_RCP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """One program: a 32 x BLOCK_COLS tile read once, each requested copy quantized in registers as the
    quantize kernel does and multiplied back by its scale as the dequantize kernel does (neither the
    FP8 data nor the scales touch memory), stored in the output's dtype. BLOCK_GROUPS > 0: the tile's
    rows are the ``row_block``-th block of :func:`group_block_rows` (the grid has a block more per
    group), so that no column-wise block spans two groups; EVEN then says the columns are whole tiles,
    and a tile of 32 rows in its group skips the masks (H200, T 16384 x 4096 bf16, row+col: 80.3% of
    copy with masks on every tile, against 90.6% for the whole-tensor blocks)."""
    row_block, col_tile = tile_coords(cols, BLOCK_COLS)
    if BLOCK_GROUPS > 0:
        first_row, row_end = group_block_rows(row_block, ends_ptr, n_ends, rows, BLOCK_GROUPS)
    else:
        first_row, row_end = row_block * 32, rows
    rows_idx = first_row + tl.arange(0, 32)
    cols_idx = col_tile * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    # round_trip_tile's run-time arguments, the same on every path.
    tile_args = (x_ptr, stride_row, rows_idx, cols_idx, row_end, cols, row_out_ptr, col_out_ptr)
    if BLOCK_GROUPS > 0 and EVEN:
        if first_row + 32 <= row_end:
            round_trip_tile(*tile_args, BLOCK_COLS, FP8_MAX, MAX_RCP, OUT_DTYPE, ROWWISE, COLWISE, True)
        else:
            round_trip_tile(*tile_args, BLOCK_COLS, FP8_MAX, MAX_RCP, OUT_DTYPE, ROWWISE, COLWISE, False)
    else:
        round_trip_tile(*tile_args, BLOCK_COLS, FP8_MAX, MAX_RCP, OUT_DTYPE, ROWWISE, COLWISE, EVEN)


TRITON_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


def tile_cols(cols: int, widest: int = 128) -> int:
    """Tile width: ``widest`` columns, narrower (a power of two >= 32) for thin inputs."""
    return max(32, min(widest, next_power_of_2(cols)))


def scale_padded_grid(rows: int, cols: int, block_cols: int) -> tuple[int]:
    """1-D grid of 32-row x ``block_cols`` tiles over the data and the scales' padding (rows and columns
    to multiples of 128, ``meta.mxfp8.row_scale_shape``), walked along the rows
    (:func:`scale_tile_coords`). The kernels write every scale code: no fill precedes them (a fill of
    both scale tensors at 8192 x 50257 took 2 x 4.9 us on the H200)."""
    padded_rows = round_up(rows, SCALE_TILE_ROWS)
    padded_cols = round_up(cols, SCALE_TILE_COLS * MXFP8_BLOCK_SIZE)
    return (padded_rows // TILE_ROWS * ceil_div(padded_cols, block_cols),)


def quantize_config(cols: int, rowwise: bool = True, columnwise: bool = True) -> tuple[int, int]:
    """(BLOCK_COLS, num_warps) of the quantize kernel, per mode. Measured on the H200 at 16384 x 16384
    bf16 (grid along rows, % of copy): row+col 128 cols / 2 warps 86.1 (128/1 85.4, 256/2 85.9, 256/4
    67.3); row only 256/2 94.4 (256/4 94.7, 128/2 92.6); col only 128/1 95.8 (256/1 96.1, 128/2 82.8)."""
    if rowwise and not columnwise:
        widest, warps = 256, 2
    elif columnwise and not rowwise:
        widest, warps = 128, 1
    else:
        widest, warps = 128, 2
    block_cols = tile_cols(cols, widest)
    return (block_cols, warps) if block_cols >= 128 else (block_cols, 1)


def launch_mxfp8_quantize(
    x: torch.Tensor,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    block_cols: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lowp::mxfp8_quantize`` on a CUDA (or interpreted CPU) tensor. Any strides: rows are read through
    their stride, an input whose last dim is not unit-stride is copied first. ``block_cols`` and
    ``num_warps`` override the launch configuration (for benchmarks). The outputs are
    ``meta.mxfp8.mxfp8_quantize_outputs``'s (the fake's) without the scale fill."""
    key = (x.shape, x.stride(), x.dtype, x.device, fp8_dtype, rowwise, columnwise, scale_layout)
    key += (block_cols, num_warps)
    args = (x, fp8_dtype, rowwise, columnwise, scale_layout, block_cols, num_warps)
    return _QUANTIZE_PLANS.get(key, _quantize_plan, *args)(x)


# launch_mxfp8_quantize's plans, one per input specialization: the checks, output layouts, grid and
# constexprs depend on the key alone, so a call repeats none of them (~10 of a call's 22 us of host
# time on a CI-class CPU were those).
_QUANTIZE_PLANS = PlanCache()


def _quantize_plan(
    x: torch.Tensor,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    block_cols: int | None,
    num_warps: int | None,
):
    """The call of :func:`launch_mxfp8_quantize` for inputs of ``x``'s shape, strides, dtype and device:
    a function of the input that allocates the outputs and launches the kernel."""
    check_quantize_args(x, fp8_dtype, rowwise, columnwise, scale_layout)
    rows, cols = flat_2d_dims(x.shape)
    if rows == 0 or cols == 0:
        return lambda t: mxfp8_quantize_outputs(t, fp8_dtype, rowwise, columnwise, scale_layout, False)
    fp8 = FP8_DTYPES[fp8_dtype]
    layout = quantize_output_layout(x.shape, rowwise, columnwise)  # the fake's
    pitch = mxfp8_data_pitch(cols)
    (row_scale_rows, row_scale_cols), (col_scale_rows, col_scale_cols) = layout[1][0], layout[3][0]
    # The kernel reads row-major tiles only. Column-major 16-bit input (row stride 1) on one warp
    # crashed the H200 (illegal address, Triton 3.6, 45 x 70 bf16 with strides (1, 45)).
    flat = x.reshape(rows, cols)
    copy = flat.stride(1) != 1
    reshape = not copy and x.dim() != 2
    row_stride = cols if copy else flat.stride(0)
    default_cols, default_warps = quantize_config(cols, rowwise, columnwise)
    block_cols, num_warps = block_cols or default_cols, num_warps or default_warps
    launch = mxfp8_quantize_kernel.bind(
        scale_padded_grid(rows, cols, block_cols),
        BLOCK_COLS=block_cols,
        EVEN=rows % TILE_ROWS == 0 and cols % block_cols == 0,
        FP8_MAX=FP8_MAX[fp8_dtype],
        MAX_RCP=FP8_MAX_RCP[fp8_dtype],
        OUT_DTYPE=TRITON_FP8[fp8_dtype],
        ROWWISE=rowwise,
        COLWISE=columnwise,
        SWIZZLED=scale_layout == "swizzled",
        num_warps=num_warps,
    )

    def call(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        row_data, row_scale, col_data, col_scale = outputs = allocate_uint8(t, layout)
        t2d = t.contiguous().view(rows, cols) if copy else t.reshape(rows, cols) if reshape else t
        launch(
            t2d,
            row_stride,
            rows,
            cols,
            pitch,
            row_data.view(fp8),
            row_scale,
            row_scale_rows,
            row_scale_cols,
            col_data.view(fp8),
            col_scale,
            col_scale_rows,
            col_scale_cols,
        )
        return outputs

    return call


def launch_mxfp8_dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: str,
    use: str,
    scale_layout: str,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``lowp::mxfp8_dequantize`` on a CUDA (or interpreted CPU) tensor; ``out``: a contiguous buffer of
    data's shape and ``dtype`` to write into instead of a new one (the LM head reuses a dead chunk).
    From a plan per specialization (:data:`_DEQUANTIZE_PLANS`)."""
    out_key = None if out is None else (out.shape, out.stride(), out.dtype, out.device)
    key = (data.shape, data.stride(), data.dtype, data.device, scale.shape, scale.stride(), scale.dtype)
    key += (scale.device, fp8_dtype, use, scale_layout, dtype, out_key)
    args = (data, scale, fp8_dtype, use, scale_layout, dtype, out)
    return _DEQUANTIZE_PLANS.get(key, _dequantize_plan, *args)(data, scale, out)


# launch_mxfp8_dequantize's plans: the checks, grid and constexprs depend on the key alone.
_DEQUANTIZE_PLANS = PlanCache()


def _dequantize_plan(data, scale, fp8_dtype, use, scale_layout, dtype, out):
    """The call of :func:`launch_mxfp8_dequantize` for arguments of these layouts: a function of
    ``(data, scale, out)`` that allocates the output (unless given) and launches the kernel."""
    mxfp8_dequantize_output(data, scale, fp8_dtype, use, scale_layout, dtype, out)  # the checks
    rows, cols = flat_2d_dims(data.shape)
    shape = data.shape

    def output(data, out):
        return data.new_empty(shape, dtype=dtype) if out is None else out

    if rows == 0 or cols == 0:
        return lambda data, scale, out: output(data, out)
    block_cols = tile_cols(cols)
    # Rows are read through their stride: the padded rows of MXFP8 data (mxfp8_data_pitch) too.
    reshape = data.dim() != 2
    copy = data.reshape(rows, cols).stride(1) != 1
    data_stride = cols if copy else data.reshape(rows, cols).stride(0)
    copy_scale = not scale.is_contiguous()
    scale_rows, scale_cols = scale.shape
    fp8 = FP8_DTYPES[fp8_dtype]
    launch = mxfp8_dequantize_kernel.bind(
        (ceil_div(rows, TILE_ROWS), ceil_div(cols, block_cols)),
        BLOCK_COLS=block_cols,
        COLUMNWISE=use == "columnwise",
        SWIZZLED=scale_layout == "swizzled",
        num_warps=4,
    )

    def call(data, scale, out):
        result = output(data, out)
        data2d = data.reshape(rows, cols) if reshape else data
        if copy:
            data2d = data2d.contiguous()
        scale = scale.contiguous() if copy_scale else scale
        launch(data2d.view(fp8), data_stride, scale, result, rows, cols, scale_rows, scale_cols)
        return result

    return call


def launch_mxfp8_round_trip(
    x: torch.Tensor, fp8_dtype: str, rowwise: bool, columnwise: bool, group_ends: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::mxfp8_round_trip`` on a CUDA (or interpreted CPU) tensor: one read of x, one write per
    copy (the quantize kernel's tiles and configuration). ``group_ends``: the column-wise blocks restart
    at each group (``reference.mxfp8.group_block_rows``), one more tile row per group. From a plan per
    specialization (:data:`_ROUND_TRIP_PLANS`)."""
    key = (x.shape, x.stride(), x.dtype, x.device, fp8_dtype, rowwise, columnwise, tensor_key(group_ends))
    args = (x, fp8_dtype, rowwise, columnwise, group_ends)
    plan = _ROUND_TRIP_PLANS.get(key, _round_trip_plan, *args)
    if group_ends is not None:  # values: every call, where read on the host (meta.split_sizes)
        check_group_end_values(group_ends, flat_2d_dims(x.shape)[0], "group_ends")
    return plan(x, group_ends)


# launch_mxfp8_round_trip's plans: the checks of the layouts, the grid and the constexprs.
_ROUND_TRIP_PLANS = PlanCache()


def _round_trip_plan(x, fp8_dtype, rowwise, columnwise, group_ends):
    mxfp8_round_trip_outputs(x, fp8_dtype, rowwise, columnwise, group_ends)  # the checks
    shape = x.shape

    def outputs(x):
        return tuple(x.new_empty(shape if wanted else (0,)) for wanted in (rowwise, columnwise))

    rows, cols = flat_2d_dims(shape)
    if rows == 0 or cols == 0:
        return lambda x, group_ends: outputs(x)
    copy = x.reshape(rows, cols).stride(1) != 1  # row-major tiles only, as launch_mxfp8_quantize
    row_stride = cols if copy else x.reshape(rows, cols).stride(0)
    block_cols, num_warps = quantize_config(cols, rowwise, columnwise)
    grouped = columnwise and group_ends is not None
    copy_ends = grouped and group_ends.stride(0) != 1  # the kernel reads the ends at unit stride
    n_ends = group_ends.numel() if grouped else 0
    row_blocks = ceil_div(rows, TILE_ROWS) + (n_ends + 1 if grouped else 0)
    launch = mxfp8_round_trip_kernel.bind(
        (row_blocks * ceil_div(cols, block_cols),),
        BLOCK_COLS=block_cols,
        FP8_MAX=FP8_MAX[fp8_dtype],
        MAX_RCP=FP8_MAX_RCP[fp8_dtype],
        OUT_DTYPE=TRITON_FP8[fp8_dtype],
        ROWWISE=rowwise,
        COLWISE=columnwise,
        EVEN=(grouped or rows % TILE_ROWS == 0) and cols % block_cols == 0,
        BLOCK_GROUPS=next_power_of_2(n_ends + 1) if grouped else 0,
        num_warps=num_warps,
    )

    def call(x, group_ends):
        row_out, col_out = outputs(x)
        x2d = x.reshape(rows, cols)
        x2d = x2d.contiguous() if copy else x2d
        ends = (group_ends.contiguous() if copy_ends else group_ends) if grouped else x2d
        launch(x2d, row_stride, rows, cols, row_out, col_out, ends, n_ends)
        return row_out, col_out

    return call
