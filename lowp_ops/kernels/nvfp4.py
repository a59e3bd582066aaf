"""Triton NVFP4 quantization (docs/nvfp4.md; semantics in ``lowp_ops.reference.nvfp4``).

One program owns a ``TILE_ROWS x BLOCK_COLS`` tile of ``x``, read once, and writes from registers the
row-wise copy (1x16 blocks along the columns) and the column-wise copy (16x1 blocks along the rows,
after the 16-point RHT when asked, stored transposed) with their E4M3 block scales. Given amaxes are
read as they are; missing ones come from a separate amax kernel (atomic max on the fp32 bits, no host
sync). The grouped form maps programs to (expert, tile) from the effective boundaries of the split
sizes (``kernels.split_sizes``, computed in each program on the device: any sizes stay in bounds), so
no block straddles two experts and each expert uses its own amaxes; with the RHT on CUDA it runs as two
launches, the tiles wholly inside their expert (maskless) and each expert's last tile (see
``GROUPED_RHT_MAX_REGISTERS``).

Bit-exact with the reference: fp32 steps in the reference's order, IEEE divisions (``div_rn``), no FMA
contraction (the explicit ``fma`` calls add exact products: one rounding, as the reference's add), the
RHT as the same butterfly (not ``tl.dot``: the order of its fp32 additions is the hardware's), E2M1
rounding by integer/float-add steps (sm_90 has no ``cvt.*.e2m1``). The interpreter's own fp32 -> bf16 /
fp8 casts truncate, so there those roundings are done on the bits first. On the GPU a few conversions
are inline PTX (bf16 pairs unpacked by a shift and an and, ``cvt.rn.bf16x2.f32``); the interpreter
runs their plain Triton forms.

Cost (sm_90 SASS per thread and element): row-wise 17.6 (16 x 128 on one warp), column-wise with RHT
24.9 and both with RHT 37.1 (64 x 64 on two warps; E2M1 rounding ~8.5 per copy), the RHT amax pass
9.6. On the H200 the row+col kernel is bound by the ALU pipe (half rate: logic, compare, min/max) and
the issue slots, not by memory: ncu shows them 72% and 66% busy, DRAM 40% (16384^2 bf16, 43.6% of a
copy; an L2-resident input is 3% faster; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import ceil_div, next_power_of_2
from ..meta.mxfp8 import flat_2d_dims
from ..meta.nvfp4 import (
    allocate_outputs,
    check_given_amax_values,
    check_group_quantize_args,
    check_group_split_values,
    check_quantize_args,
    group_quantize_output_layout,
    group_split_multiple,
    quantize_output_layout,
)
from .launch import INTERPRETING_CONSTEXPR as INTERPRETING
from .launch import PlanCache, cached_launch, rows_with_unit_stride, tensor_key
from .nvfp4_math import (
    SCALE_COLS_MULTIPLE,
    block_encode_factor,
    e2m1_bytes,
    e4m3_block_scale,
    global_encode_scale,
    hadamard16_rows,
    max_keep_nan,
    not_nan_mask,
    round_to_bf16,
    round_to_bf16_packed,
    sr_pair_bits,
)
from .split_sizes import effective_sizes, scale_col_start, tile_owner

# --------------------------------------------------------------------------------------------- tiles


@triton.jit
def quantize_rowwise_tile(
    x,
    vec_max,
    amax,
    rows_ok,
    grows,
    col0,
    cols,
    data_ptr,
    scale_ptr,
    scale_cols,
    sr_ptr,
    R: tl.constexpr,
    BC: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    EVEN: tl.constexpr,
):
    """1x16 blocks along the columns of ``x`` [R, BC] (block maxima ``vec_max`` [R, BC/16]; first column
    ``col0``): data at
    ``data_ptr[row, col / 2]``, E4M3 codes at ``scale_ptr[row, col / 16]``."""
    NB: tl.constexpr = BC // 16
    encode = global_encode_scale(amax)
    decode = tl.math.div_rn(1.0, encode)
    scale_value, scale_code, unrounded = e4m3_block_scale(vec_max, encode)
    factor = block_encode_factor(scale_value, decode)
    scaled = tl.reshape(tl.reshape(x, [R, NB, 16]) * factor[:, :, None], [R, BC])
    # Elements 2i and 2i + 1 of a row: the low and high nibble of output byte i.
    low, high = tl.split(tl.reshape(scaled, [R, BC // 2, 2]))
    low_bits = 0
    high_bits = 0
    if STOCHASTIC:
        # One hash per output byte: its low and high 16 bits round the low and high element.
        pairs = grows[:, None].to(tl.int64) * (cols // 2) + (col0 // 2 + tl.arange(0, BC // 2))[None, :]
        bits = sr_pair_bits(sr_ptr, 0, pairs)
        low_bits = bits & 0xFFFF
        high_bits = bits >> 16
    data = e2m1_bytes(low, high, low_bits, high_bits, STOCHASTIC)
    # A NaN makes its block's factor NaN, and only a NaN factor makes NaN data: those blocks encode as 0.
    # The mask comes from the unrounded fp32 scale (NaN exactly where the factor is), not from the factor:
    # the factor descends from the fp8 scale, and when the mask needs another layout than the data's
    # factor (2-D blocks in masked tiles), the compiler converts that fp8 tensor, whose e4m3x2 registers
    # then feed both a 16-bit pack / store and an in-register cvt.rn.f16x2.e4m3x2. ptxas (12.8 and 12.9,
    # sm_90) compiles that unpack to read the wrong register (the stack pointer or S_dec merged into the
    # pack's upper half): the data were scaled by garbage on the H200 while the stored codes were right.
    keep = not_nan_mask(unrounded)
    data = tl.reshape(tl.reshape(data, [R, NB, 8]) & keep[:, :, None], [R, BC // 2]).to(tl.uint8)
    byte_idx = col0 // 2 + tl.arange(0, BC // 2)
    row_bytes = cols // 2
    if EVEN:
        # cols is a multiple of BC: rows start 8-byte aligned (lets the stores be vectorized).
        row_bytes = tl.multiple_of(row_bytes, 8)
    data_ptrs = data_ptr + grows[:, None].to(tl.int64) * row_bytes + byte_idx[None, :]
    block_idx = col0 // 16 + tl.arange(0, NB)
    scale_ptrs = scale_ptr + grows[:, None].to(tl.int64) * scale_cols + block_idx[None, :]
    if EVEN:
        tl.store(data_ptrs, data)
        tl.store(scale_ptrs, scale_code)
    else:
        tl.store(data_ptrs, data, mask=rows_ok[:, None] & (2 * byte_idx[None, :] < cols))
        tl.store(scale_ptrs, scale_code, mask=rows_ok[:, None] & (16 * block_idx[None, :] < cols))


@triton.jit
def quantize_columnwise_tile(
    y,
    vec_max,
    amax,
    local_row0,
    n_rows,
    cols_idx,
    cols,
    data_ptr,
    scale_ptr,
    scale_cols,
    tile_row0,
    total_rows,
    sr_ptr,
    R: tl.constexpr,
    BC: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    EVEN: tl.constexpr,
    ROW_BYTES_MULTIPLE: tl.constexpr,
):
    """16x1 blocks along the rows of ``y`` [R, BC] (block maxima ``vec_max`` [R/16, BC]), stored
    transposed: data at ``data_ptr[col, row / 2]`` of a (cols, n_rows / 2) matrix, E4M3 codes at
    ``scale_ptr[col, row / 16]``. ``local_row0``: the tile's first row within that matrix; ``tile_row0``:
    its first row in x of ``total_rows`` (stochastic rounding indices ``col * total_rows + row``);
    ROW_BYTES_MULTIPLE: a divisor of ``n_rows / 2``."""
    RB: tl.constexpr = R // 16
    encode = global_encode_scale(amax)
    decode = tl.math.div_rn(1.0, encode)
    scale_value, scale_code, unrounded = e4m3_block_scale(vec_max, encode)
    factor = block_encode_factor(scale_value, decode)
    scaled = tl.reshape(tl.reshape(y, [RB, 16, BC]) * factor[:, None, :], [R, BC])
    # Rows 2i and 2i + 1 of a column: the low and high nibble of its output byte i.
    low, high = tl.split(tl.permute(tl.reshape(scaled, [R // 2, 2, BC]), (0, 2, 1)))
    low_bits = 0
    high_bits = 0
    if STOCHASTIC:
        # One hash per output byte: its low and high 16 bits round the low and high row.
        row_pairs = tile_row0 // 2 + tl.arange(0, R // 2)
        pairs = cols_idx[None, :].to(tl.int64) * (total_rows // 2) + row_pairs[:, None]
        bits = sr_pair_bits(sr_ptr, 1, pairs)
        low_bits = bits & 0xFFFF
        high_bits = bits >> 16
    data = e2m1_bytes(low, high, low_bits, high_bits, STOCHASTIC)
    # A NaN makes its block's factor NaN, and only a NaN factor makes NaN data: those blocks encode as 0.
    keep = not_nan_mask(unrounded)  # not from the factor: see quantize_rowwise_tile
    data = tl.reshape(tl.reshape(data, [RB, 8, BC]) & keep[:, None, :], [R // 2, BC]).to(tl.uint8)
    byte_idx = local_row0 // 2 + tl.arange(0, R // 2)
    # Aligned column starts let the stores be vectorized (16 bytes when n_rows is a multiple of R = 64).
    row_bytes = tl.multiple_of(n_rows // 2, ROW_BYTES_MULTIPLE)
    data_ptrs = data_ptr + cols_idx[None, :].to(tl.int64) * row_bytes + byte_idx[:, None]
    block_idx = local_row0 // 16 + tl.arange(0, RB)
    scale_ptrs = scale_ptr + cols_idx[None, :].to(tl.int64) * scale_cols + block_idx[:, None]
    if EVEN:
        tl.store(data_ptrs, data)
        tl.store(scale_ptrs, scale_code)
    else:
        col_ok = cols_idx[None, :] < cols
        tl.store(data_ptrs, data, mask=(2 * byte_idx[:, None] < n_rows) & col_ok)
        tl.store(scale_ptrs, scale_code, mask=(16 * block_idx[:, None] < n_rows) & col_ok)


@triton.jit
def expert_of_tile(
    split_ptr,
    experts,
    rows,
    tile,
    TILE_ROWS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    TAIL_TILES: tl.constexpr,
    SPLIT_MULTIPLE: tl.constexpr,
):
    """(expert, its rows, its first row, the tile's first row within it, its first column-wise scale
    column) of row tile ``tile`` when every expert's rows are cut into TILE_ROWS-row tiles in order.
    Tiles past the last expert get ``expert >= experts`` and 0 rows. TAIL_TILES: ``tile`` is an expert,
    and the tile its last TILE_ROWS-row cut (``n_rows % TILE_ROWS`` rows, none when that is 0). The
    experts' rows are the effective boundaries of the split sizes (multiples of SPLIT_MULTIPLE)."""
    idx = tl.arange(0, EXPERTS_POW2)
    sizes = effective_sizes(split_ptr, experts, rows, EXPERTS_POW2, SPLIT_MULTIPLE)
    if TAIL_TILES:
        expert = tile
    else:
        tiles, tile_ends, expert = tile_owner(sizes, tile, TILE_ROWS)
        first_tile = tl.sum(tl.where(idx == expert, tile_ends - tiles, 0), 0)
    mine = idx == expert
    before = idx < expert
    n_rows = tl.sum(tl.where(mine, sizes, 0), 0)
    row0 = tl.sum(tl.where(before, sizes, 0), 0)
    scale_col0 = scale_col_start(sizes, before, SCALE_COLS_MULTIPLE)
    local_row0 = n_rows // TILE_ROWS * TILE_ROWS if TAIL_TILES else (tile - first_tile) * TILE_ROWS
    return expert, n_rows, row0, local_row0, scale_col0


@triton.jit
def to_fp32(x):
    """``x`` (bf16, fp16 or fp32) as fp32. bf16 on the GPU: one shift or one and per element of a pair
    held in one register (the generic conversion spends a byte permute more on the high one)."""
    if INTERPRETING or x.dtype != tl.bfloat16:
        out = x.to(tl.float32)
    else:
        out = tl.inline_asm_elementwise(
            "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }",
            "=r,=r,r",
            [x],
            dtype=tl.float32,
            is_pure=True,
            pack=2,
        )
    return out


@triton.jit
def load_tile(
    x_ptr,
    stride_row,
    grows,
    rows_ok,
    col0,
    cols,
    R: tl.constexpr,
    BC: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    EVEN: tl.constexpr,
):
    """fp32 [R, BC] tile from column ``col0``; lanes out of bounds hold 0 (the reference's zero padding).
    SPLIT_BLOCKS: load the first and the second 8 columns of every 16-column block as two tensors of one
    layout, so that a thread holds whole row blocks (no shuffles or replicated scale math per block)."""
    if SPLIT_BLOCKS:
        NB: tl.constexpr = BC // 16
        first_half = col0 + tl.arange(0, NB)[:, None] * 16 + tl.arange(0, 8)[None, :]
        ptrs = x_ptr + grows[:, None, None].to(tl.int64) * stride_row + first_half[None, :, :]
        # Upcast right after the load (bf16 math is wrong in the Triton interpreter).
        if EVEN:
            low = to_fp32(tl.load(ptrs))
            high = to_fp32(tl.load(ptrs + 8))
        else:
            row_ok = rows_ok[:, None, None]
            low = to_fp32(tl.load(ptrs, mask=row_ok & (first_half < cols)[None, :, :], other=0.0))
            high = tl.load(ptrs + 8, mask=row_ok & (first_half + 8 < cols)[None, :, :], other=0.0)
            high = to_fp32(high)
        x = tl.reshape(tl.permute(tl.join(low, high), (0, 1, 3, 2)), [R, BC])
    else:
        cols_idx = col0 + tl.arange(0, BC)
        ptrs = x_ptr + grows[:, None].to(tl.int64) * stride_row + cols_idx[None, :]
        if EVEN:
            x = tl.load(ptrs).to(tl.float32)
        else:
            x = tl.load(ptrs, mask=rows_ok[:, None] & (cols_idx[None, :] < cols), other=0.0).to(tl.float32)
    return x


@triton.jit
def program_tile(cols, BLOCK_COLS: tl.constexpr, GRID_ALONG_ROWS: tl.constexpr):
    """(row tile, column tile) of this program. GRID_ALONG_ROWS (1-D grid): consecutive programs walk
    along the columns of a row tile, so programs resident together read long row segments (what made
    the MXFP8 quantizer faster on the H200); otherwise a 2-D grid whose first axis walks down a column
    strip (the transposed column-wise writes of neighbours then sit side by side)."""
    if GRID_ALONG_ROWS:
        n_col_tiles = tl.cdiv(cols, BLOCK_COLS)
        tile = tl.program_id(0) // n_col_tiles
        col_tile = tl.program_id(0) % n_col_tiles
    else:
        tile = tl.program_id(0)
        col_tile = tl.program_id(1)
    return tile, col_tile


@triton.jit
def tile_coordinates(
    split_ptr,
    experts,
    rows,
    tile,
    TILE_ROWS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    GROUPED: tl.constexpr,
    TAIL_TILES: tl.constexpr = False,
    SPLIT_MULTIPLE: tl.constexpr = 1,
):
    if GROUPED:
        expert, n_rows, row0, local_row0, scale_col0 = expert_of_tile(
            split_ptr, experts, rows, tile, TILE_ROWS, EXPERTS_POW2, TAIL_TILES, SPLIT_MULTIPLE
        )
    else:
        zero = tl.full([], 0, tl.int32)
        expert = zero
        n_rows = zero + rows
        row0 = zero
        local_row0 = tile * TILE_ROWS
        scale_col0 = zero
    return expert, n_rows, row0, local_row0, scale_col0


# ------------------------------------------------------------------------------------------- kernels


@cached_launch
@triton.jit
def nvfp4_amax_kernel(
    x_ptr,
    stride_row,
    rows,
    cols,
    split_ptr,
    experts,
    amax_bits_ptr,
    TILE_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ABS_AMAX: tl.constexpr,
    RHT_AMAX: tl.constexpr,
    GROUPED: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    GRID_ALONG_ROWS: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    EVEN: tl.constexpr,
    SPLIT_MULTIPLE: tl.constexpr = 1,
):
    """Per expert e: max |x| at ``amax_bits_ptr[e]`` and/or max |bf16(RHT16 along the rows of x)| at
    ``amax_bits_ptr[experts + e]`` (zeroed beforehand), as an integer atomic max of the fp32 bits
    (|v| >= 0 orders like its bits; a NaN sorts above Inf and wins)."""
    tile, col_tile = program_tile(cols, BLOCK_COLS, GRID_ALONG_ROWS)
    expert, n_rows, row0, local_row0, _ = tile_coordinates(
        split_ptr, experts, rows, tile, TILE_ROWS, EXPERTS_POW2, GROUPED, False, SPLIT_MULTIPLE
    )
    local_rows = local_row0 + tl.arange(0, TILE_ROWS)
    x = load_tile(
        x_ptr,
        stride_row,
        row0 + local_rows,
        local_rows < n_rows,
        col_tile * BLOCK_COLS,
        cols,
        TILE_ROWS,
        BLOCK_COLS,
        False,
        EVEN,
    )
    if ABS_AMAX:
        amax = max_keep_nan(tl.reshape(tl.abs(x), [TILE_ROWS * BLOCK_COLS]), 0)
        tl.atomic_max(
            amax_bits_ptr + expert, amax.to(tl.int32, bitcast=True), mask=expert < experts, sem="relaxed"
        )
    if RHT_AMAX:
        y = tl.abs(hadamard16_rows(x, TILE_ROWS, BLOCK_COLS))
        # max |bf16(y)| == bf16(max |y|) (docs/nvfp4.md#amax-of-a-rounded-tensor): round the tile max only.
        amax = round_to_bf16(max_keep_nan(tl.reshape(y, [TILE_ROWS * BLOCK_COLS]), 0))
        tl.atomic_max(
            amax_bits_ptr + experts + expert,
            amax.to(tl.int32, bitcast=True),
            mask=expert < experts,
            sem="relaxed",
        )


@triton.jit
def quantize_tile(
    x_ptr,
    stride_row,
    rows,
    cols,
    expert,
    experts,
    n_rows,
    row0,
    local_row0,
    scale_col0,
    col_tile,
    amax_row_ptr,
    amax_col_ptr,
    row_data_ptr,
    row_scale_ptr,
    row_scale_cols,
    col_data_ptr,
    col_scale_ptr,
    col_scale_cols,
    sr_ptr,
    TILE_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    RHT: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    EVEN: tl.constexpr,
    ROW_BYTES_MULTIPLE: tl.constexpr,
):
    """Quantize rows ``[local_row0, local_row0 + TILE_ROWS)`` of one expert (``n_rows`` rows from row
    ``row0`` of x) in the columns of ``col_tile``; EVEN: the tile is wholly in bounds (no masks);
    ROW_BYTES_MULTIPLE: a divisor of ``n_rows / 2``."""
    local_rows = local_row0 + tl.arange(0, TILE_ROWS)
    rows_ok = local_rows < n_rows
    grows = row0 + local_rows
    col0 = col_tile * BLOCK_COLS
    cols_idx = col0 + tl.arange(0, BLOCK_COLS)
    # Split loads pay off for the row-wise copy, unless the column-wise one reads the load's layout.
    split_blocks: tl.constexpr = ROWWISE and (RHT or not COLWISE)
    x = load_tile(x_ptr, stride_row, grows, rows_ok, col0, cols, TILE_ROWS, BLOCK_COLS, split_blocks, EVEN)
    if BLOCK_2D:
        tiles = tl.abs(tl.reshape(x, [TILE_ROWS // 16, 16, BLOCK_COLS // 16, 16]))
        tile_max = max_keep_nan(max_keep_nan(tiles, 3), 1)
    if ROWWISE:
        if BLOCK_2D:
            row_max = tl.broadcast_to(tile_max[:, None, :], [TILE_ROWS // 16, 16, BLOCK_COLS // 16])
            row_max = tl.reshape(row_max, [TILE_ROWS, BLOCK_COLS // 16])
        else:
            row_max = max_keep_nan(tl.abs(tl.reshape(x, [TILE_ROWS, BLOCK_COLS // 16, 16])), 2)
        amax_row = tl.load(amax_row_ptr + expert, mask=expert < experts, other=0.0)
        quantize_rowwise_tile(
            x,
            row_max,
            amax_row,
            rows_ok,
            grows,
            col0,
            cols,
            row_data_ptr,
            row_scale_ptr,
            row_scale_cols,
            sr_ptr,
            TILE_ROWS,
            BLOCK_COLS,
            STOCHASTIC,
            EVEN,
        )
    if COLWISE:
        y = x
        if RHT:
            y = round_to_bf16_packed(hadamard16_rows(x, TILE_ROWS, BLOCK_COLS))
        if BLOCK_2D:
            col_max = tl.broadcast_to(tile_max[:, :, None], [TILE_ROWS // 16, BLOCK_COLS // 16, 16])
            col_max = tl.reshape(col_max, [TILE_ROWS // 16, BLOCK_COLS])
        else:
            col_max = max_keep_nan(tl.abs(tl.reshape(y, [TILE_ROWS // 16, 16, BLOCK_COLS])), 1)
        amax_col = tl.load(amax_col_ptr + expert, mask=expert < experts, other=0.0)
        quantize_columnwise_tile(
            y,
            col_max,
            amax_col,
            local_row0,
            n_rows,
            cols_idx,
            cols,
            col_data_ptr + (row0 // 2).to(tl.int64) * cols,
            col_scale_ptr + scale_col0,
            col_scale_cols,
            row0 + local_row0,
            rows,
            sr_ptr,
            TILE_ROWS,
            BLOCK_COLS,
            STOCHASTIC,
            EVEN,
            ROW_BYTES_MULTIPLE,
        )


@cached_launch
@triton.jit
def nvfp4_quantize_kernel(
    x_ptr,
    stride_row,
    rows,
    cols,
    split_ptr,
    experts,
    amax_row_ptr,
    amax_col_ptr,
    amax_row_out_ptr,
    amax_col_out_ptr,
    row_data_ptr,
    row_scale_ptr,
    row_scale_cols,
    col_data_ptr,
    col_scale_ptr,
    col_scale_cols,
    sr_ptr,
    TILE_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    RHT: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    GROUPED: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    GRID_ALONG_ROWS: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    EVEN: tl.constexpr,
    FULL_TILES: tl.constexpr = True,
    PARTIAL_TILES: tl.constexpr = True,
    TAIL_TILES: tl.constexpr = False,
    SPLIT_MULTIPLE: tl.constexpr = 1,
    COPY_AMAXES: tl.constexpr = False,
):
    """One program: a TILE_ROWS x BLOCK_COLS tile of one expert, read once; both copies from registers.
    Column-wise data of expert e is its own (cols, n_rows / 2) matrix starting at byte
    ``cols * row0 / 2``; its scales start at column ``scale_col0`` of the shared scale matrix.
    EVEN: every tile is in bounds. Grouped: a tile wholly inside its expert (and EVEN_COLS: cols a
    multiple of BLOCK_COLS) takes the maskless path, chosen at run time. FULL_TILES / PARTIAL_TILES:
    whether this launch quantizes such tiles / the others (a launch of one kind compiles one path);
    TAIL_TILES: the grid's rows are the experts, each program its expert's last, partial, tile (the
    only partial ones, so a launch for them needs E rows of programs, not the whole grid's).
    COPY_AMAXES: the first program also copies the amaxes read at ``amax_*_ptr`` (given, or the amax
    kernel's) to the op's amax outputs at ``amax_*_out_ptr`` (no copy launch of their own)."""
    if COPY_AMAXES:  # noqa: SIM102 (a compile-time switch, then a run-time test)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            e = tl.arange(0, EXPERTS_POW2)
            tl.store(amax_row_out_ptr + e, tl.load(amax_row_ptr + e, mask=e < experts), mask=e < experts)
            tl.store(amax_col_out_ptr + e, tl.load(amax_col_ptr + e, mask=e < experts), mask=e < experts)
    tile, col_tile = program_tile(cols, BLOCK_COLS, GRID_ALONG_ROWS)
    expert, n_rows, row0, local_row0, scale_col0 = tile_coordinates(
        split_ptr, experts, rows, tile, TILE_ROWS, EXPERTS_POW2, GROUPED, TAIL_TILES, SPLIT_MULTIPLE
    )
    # A grouped tile wholly inside its expert takes the maskless path (EVEN is False when grouped).
    full_tile = False
    if GROUPED and EVEN_COLS:
        full_tile = local_row0 + TILE_ROWS <= n_rows
    # quantize_tile's run-time arguments, the same on both paths.
    tile_args = (
        x_ptr, stride_row, rows, cols, expert, experts, n_rows, row0, local_row0, scale_col0, col_tile,
        amax_row_ptr, amax_col_ptr, row_data_ptr, row_scale_ptr, row_scale_cols, col_data_ptr, col_scale_ptr,
        col_scale_cols, sr_ptr,
    )  # fmt: skip
    if full_tile:
        if FULL_TILES:
            # Column-store width: an expert's rows are a multiple of 16 with the RHT, of 2 otherwise.
            width: tl.constexpr = 8 if RHT else 1
            quantize_tile(
                *tile_args, TILE_ROWS, BLOCK_COLS, ROWWISE, COLWISE, RHT, BLOCK_2D, STOCHASTIC, True, width
            )
    elif PARTIAL_TILES:  # noqa: SIM102 (a compile-time switch, then a run-time test)
        # An expert's tail program exits when its expert has no partial tile (no rows left to quantize),
        # as does a grid tile past the last expert: each ran the whole masked tile code for nothing.
        if local_row0 < n_rows:
            # Column-store width: 16 bytes need the column-owned layout of the RHT (else a layout round trip).
            width: tl.constexpr = (TILE_ROWS // 2 if RHT else 8) if EVEN else 1
            quantize_tile(
                *tile_args, TILE_ROWS, BLOCK_COLS, ROWWISE, COLWISE, RHT, BLOCK_2D, STOCHASTIC, EVEN, width
            )


# ----------------------------------------------------------------------------------------- launchers


# Grouped with the RHT (no stochastic rounding) on CUDA, two launches: the tiles wholly inside their
# expert (a maskless kernel, 128 registers), then each expert's last, partial, tile (a grid of E rows).
# In one kernel the masked branch took ptxas to 203 registers (167 column-wise only): 8 resident warps
# per SM instead of 16. Both launches are capped at 128 (sm_90 SASS, triton 3.6: the maskless kernel
# takes 128 anyway, the masked one spills 8 bytes). H200, 16384^2 bf16, 8 experts, row+col, given
# amaxes: one kernel 0.674 ms, capped 0.551, two launches 0.530 (ragged experts 0.570 -> 0.536); a
# second launch over the whole grid instead of E rows cost 0.05 ms (2026-11-30). Without the RHT
# or with stochastic rounding a cap of 128 spills 224-520 bytes: those keep one kernel at ptxas' choice.
GROUPED_RHT_MAX_REGISTERS = 128


def quantize_config(rows: int, cols: int, columnwise: bool = True) -> tuple[int, int, int, bool]:
    """(TILE_ROWS, BLOCK_COLS, num_warps, grid along rows). The column-wise copy is stored transposed,
    so a program writes TILE_ROWS / 2 contiguous bytes per column: 64-row tiles write whole 32-byte
    sectors. H200, 16384 x 16384 bf16 with RHT, % of copy: row+col 64 x 64 on 2 warps 36.6 (16 x 128 on
    1 warp 26.8, 32 x 128 / 2 34.4, 64 x 128 / 4 35.2); col only 64 x 64 / 2 54.1 (64 x 32 / 1 54.6,
    16 x 128 / 1 24.6). Row only keeps 16 x 128 on 1 warp (64% of copy), the fewest instructions."""
    block_cols = max(16, min(128, next_power_of_2(cols)))
    if not columnwise:
        return 16, block_cols, 1, True
    return max(16, min(64, next_power_of_2(rows))), min(64, block_cols), 2, False


def _launch_plan(
    rows: int,
    cols: int,
    row_stride: int,
    experts: int,
    n_tiles: int,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    block_2d: bool,
    given_row: bool,
    given_col: bool,
    grouped: bool,
    config: tuple,
    stochastic: bool,
    split_full_tiles: bool = False,
):
    """The launches of one specialization, fixed once: a function ``run(x2d, split_sizes, outputs,
    given_row, given_col, sr_seed)`` that computes the amaxes not given (the amax kernel, into one zeroed
    buffer), then quantizes (grouped with ``split_full_tiles``: the tiles wholly inside their expert in
    a launch of their own), copying the amaxes it used to the op's outputs. ``given_row`` /
    ``given_col``: whether the call passes those amaxes."""
    # (TILE_ROWS, BLOCK_COLS, num_warps[, grid along rows[, register cap]]); defaults: along rows, no cap.
    tile_rows, block_cols, num_warps, along_rows, maxnreg = (*config, *(True, None)[len(config) - 3 :])
    need_abs = not given_row or (columnwise and not rht and not given_col)
    need_rht = columnwise and rht and not given_col
    common = {
        "TILE_ROWS": tile_rows,
        "BLOCK_COLS": block_cols,
        "GROUPED": grouped,
        "EXPERTS_POW2": max(2, next_power_of_2(experts)),
        "GRID_ALONG_ROWS": along_rows,
        "EVEN_COLS": cols % block_cols == 0,
        "EVEN": not grouped and rows % tile_rows == 0 and cols % block_cols == 0,
        "SPLIT_MULTIPLE": group_split_multiple(columnwise, rht, block_2d) if grouped else 1,
        "num_warps": num_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
        "enable_fp_fusion": False,
    }
    n_col_tiles = ceil_div(cols, block_cols)
    grid = (n_tiles * n_col_tiles,) if along_rows else (n_tiles, n_col_tiles)
    empty = rows == 0 or cols == 0
    amax_launch = None
    if (need_abs or need_rht) and not empty:
        amax_launch = nvfp4_amax_kernel.bind(grid, ABS_AMAX=need_abs, RHT_AMAX=need_rht, **common)
    flags = {"ROWWISE": rowwise, "COLWISE": columnwise, "RHT": rht, "BLOCK_2D": block_2d}
    flags |= {"STOCHASTIC": stochastic, **common}
    launches = [nvfp4_quantize_kernel.bind(grid, **flags, COPY_AMAXES=True)]
    if split_full_tiles and common["EVEN_COLS"]:  # otherwise no tile takes the maskless path
        tails = (experts * n_col_tiles,) if along_rows else (experts, n_col_tiles)
        launches = [
            nvfp4_quantize_kernel.bind(grid, **flags, PARTIAL_TILES=False, COPY_AMAXES=True),
            nvfp4_quantize_kernel.bind(tails, **flags, FULL_TILES=False, TAIL_TILES=True),
        ]

    def run(x2d, split_sizes, outputs, given_row, given_col, sr_seed) -> None:
        row_data, row_scale, col_data, col_scale, amax_row, amax_col = outputs
        source = (x2d, row_stride, rows, cols, split_sizes, experts)  # both kernels' first arguments
        if need_abs or need_rht:
            # The amax kernel's accumulators, max |x| then max |RHT(x)| per expert: one fill for both.
            found = torch.zeros(2 * experts, dtype=torch.float32, device=x2d.device)
            if amax_launch is not None:
                amax_launch(*source, found.view(torch.int32))
            found_abs, found_rht = found[:experts], found[experts:]
        # Where the kernel reads each amax from: a given one (contiguous: the plans see to it; the kernel
        # reads expert e's at its data pointer + e), or the one the amax kernel computed.
        source_row = found_abs if given_row is None else given_row
        if not columnwise:
            source_col = source_row
        elif given_col is not None:
            source_col = given_col
        else:
            source_col = found_rht if rht else found_abs
        if empty:  # no quantize launch to copy them
            amax_row.copy_(source_row.reshape(experts))
            amax_col.copy_(source_col.reshape(experts))
            return
        sr_state = amax_row if sr_seed is None else sr_seed.reshape(2).contiguous()  # unused without SR
        row_scale_cols, col_scale_cols = row_scale.shape[1], col_scale.shape[1]
        for launch in launches:
            launch(
                *source,
                source_row,
                source_col,
                amax_row,
                amax_col,
                row_data,
                row_scale,
                row_scale_cols if rowwise else 0,
                col_data,
                col_scale,
                col_scale_cols if columnwise else 0,
                sr_state,
            )

    return run


# The launchers' plans, one per specialization of their arguments (shapes, strides, dtypes, devices,
# flags, which amaxes are given): the checks, output layouts, grids and constexprs depend on nothing
# else, so a call repeats none of them.
_PLANS = PlanCache()


def launch_nvfp4_quantize(
    x: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    block_2d: bool,
    sr_seed: torch.Tensor | None = None,
    config: tuple | None = None,
) -> tuple[torch.Tensor, ...]:
    """``lowp::nvfp4_quantize`` on a CUDA (or interpreted CPU) tensor; outputs as
    ``meta.nvfp4.nvfp4_quantize_outputs``. ``config`` = (TILE_ROWS, BLOCK_COLS, num_warps[, grid
    along rows[, register cap]]) overrides the launch configuration (benchmarks, tests)."""
    key = ("quantize", x.shape, x.stride(), x.dtype, x.device, rowwise, columnwise, rht, block_2d, config)
    key += (tensor_key(amax_rowwise), tensor_key(amax_columnwise), tensor_key(sr_seed))
    args = (x, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d, sr_seed, config)
    plan = _PLANS.get(key, _quantize_plan, *args)
    check_given_amax_values(amax_rowwise, amax_columnwise)  # values: every call, where read on the host
    return plan(x, amax_rowwise, amax_columnwise, sr_seed)


def _quantize_plan(x, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d, sr_seed, config):
    """The call of :func:`launch_nvfp4_quantize` for arguments of this specialization: a function of
    ``(x, amax_rowwise, amax_columnwise, sr_seed)`` that allocates the outputs and launches."""
    check_quantize_args(x, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d, sr_seed)
    rows, cols = flat_2d_dims(x.shape)
    layout = quantize_output_layout(rows, cols, rowwise, columnwise)
    flat = rows_with_unit_stride(x.reshape(rows, cols))
    reshape = x.dim() != 2 or flat.stride(-1) != x.stride(-1)
    config = config or quantize_config(rows, cols, columnwise)
    run = _launch_plan(
        rows=rows,
        cols=cols,
        row_stride=flat.stride(0),
        experts=1,
        n_tiles=ceil_div(rows, config[0]),
        rowwise=rowwise,
        columnwise=columnwise,
        rht=rht,
        block_2d=block_2d,
        given_row=amax_rowwise is not None,
        given_col=amax_columnwise is not None,
        grouped=False,
        config=config,
        stochastic=sr_seed is not None,
    )

    def call(x, amax_rowwise, amax_columnwise, sr_seed):
        outputs = allocate_outputs(x, layout, 1)
        x2d = rows_with_unit_stride(x.reshape(rows, cols)) if reshape else x
        # A given amax holds one element (checked): the kernel reads it at its data pointer.
        run(x2d, outputs[4], outputs, amax_rowwise, amax_columnwise, sr_seed)  # split sizes: unused
        return outputs

    return call


def launch_nvfp4_group_quantize(
    x: torch.Tensor,
    split_sizes: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    sr_seed: torch.Tensor | None = None,
    block_2d: bool = False,
    config: tuple | None = None,
    split_full_tiles: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """``lowp::nvfp4_group_quantize`` on a CUDA (or interpreted CPU) tensor; outputs as
    ``meta.nvfp4.nvfp4_group_quantize_outputs``. The split sizes stay on the device: the grid covers
    the most tiles any split can need, ``(T + E * (TILE_ROWS - 1)) // TILE_ROWS``. ``split_full_tiles``
    (None: where GROUPED_RHT_MAX_REGISTERS says) quantizes the tiles wholly inside their expert in a
    launch of their own."""
    key = ("group", x.shape, x.stride(), x.dtype, x.device, tensor_key(split_sizes), rowwise, columnwise)
    key += (rht, block_2d, config, split_full_tiles)
    key += (tensor_key(amax_rowwise), tensor_key(amax_columnwise), tensor_key(sr_seed))
    args = (x, split_sizes, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, sr_seed, block_2d)
    plan = _PLANS.get(key, _group_quantize_plan, *args, config, split_full_tiles)
    # The values of the split sizes and amaxes, where they are checked on the host (meta.split_sizes):
    # every call.
    check_group_split_values(split_sizes, x.shape[0], columnwise, rht, block_2d)
    check_given_amax_values(amax_rowwise, amax_columnwise)
    return plan(x, split_sizes, amax_rowwise, amax_columnwise, sr_seed)


def _group_quantize_plan(
    x, split_sizes, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, sr_seed, block_2d, config,
    split_full_tiles,
):  # fmt: skip
    """The call of :func:`launch_nvfp4_group_quantize` for arguments of this specialization: a function
    of ``(x, split_sizes, amax_rowwise, amax_columnwise, sr_seed)`` that allocates and launches."""
    check_group_quantize_args(
        x, split_sizes, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, sr_seed, block_2d
    )
    rows, cols = x.shape
    experts = split_sizes.shape[0]
    layout = group_quantize_output_layout(rows, cols, experts, rowwise, columnwise)
    copy = x.stride(-1) != 1
    tuned = config is None and columnwise and rht and sr_seed is None and x.is_cuda
    config = config or quantize_config(rows, cols, columnwise)
    if tuned:
        config = (*config, GROUPED_RHT_MAX_REGISTERS)
    tile_rows = config[0]
    run = _launch_plan(
        rows=rows,
        cols=cols,
        row_stride=cols if copy else x.stride(0),
        experts=experts,
        n_tiles=(rows + experts * (tile_rows - 1)) // tile_rows,
        rowwise=rowwise,
        columnwise=columnwise,
        rht=rht,
        block_2d=block_2d,
        given_row=amax_rowwise is not None,
        given_col=amax_columnwise is not None,
        grouped=True,
        config=config,
        stochastic=sr_seed is not None,
        split_full_tiles=tuned if split_full_tiles is None else split_full_tiles,
    )

    # Given per-expert amaxes (E,) are read at unit stride: strided ones are copied first.
    copy_row = amax_rowwise is not None and not amax_rowwise.is_contiguous()
    copy_col = amax_columnwise is not None and not amax_columnwise.is_contiguous()

    def call(x, split_sizes, amax_rowwise, amax_columnwise, sr_seed):
        outputs = allocate_outputs(x, layout, experts)
        x2d = x.contiguous() if copy else x
        amax_rowwise = amax_rowwise.contiguous() if copy_row else amax_rowwise
        amax_columnwise = amax_columnwise.contiguous() if copy_col else amax_columnwise
        run(x2d, split_sizes.contiguous(), outputs, amax_rowwise, amax_columnwise, sr_seed)
        return outputs

    return call
