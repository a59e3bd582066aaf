"""The fused cross-entropy backward to MXFP8 (row- and column-wise) in Gluon, for CUDA GPUs.

Same math and bytes as ``cross_entropy.cross_entropy_bwd_mxfp8_kernel``: it calls the same
element-wise ``@triton.jit`` helpers (``cross_entropy_math``: gradient, bf16 rounding; ``mxfp8``: block
maximum, E8M0 code, FP8 cast).
What Gluon adds is the layout, which Triton picks on its own: a [32, 4, 32] tile (rows, 32-column
blocks, columns in a block), 8 consecutive columns per thread, 4 lanes along the columns and 4 along
the blocks of a row, 2 along the rows, and the 2 warps stacked along the rows. Each warp then writes
whole 128-byte lines, and the E8M0 scales are stored straight from the layouts their reductions leave,
where Triton's kernel re-lays both scale tensors out through shared memory (with a barrier each)
before storing them.

H200, bf16, compact scales, % of a device copy (2026-11-30, Triton kernel -> this one): 4096 x 129280
83.3 -> 86.7, 8192 x 32768 80.2 -> 85.7, 16384 x 131072 80.5 -> 86.8 (both kernels swing by several
points from run to run there); with swizzled scales 79.0 against Triton's 80.3, so the launcher keeps
Triton's kernel there. The logits load carries an L2 ``evict_last`` hint: +1-3 points in 100 ms
bursts and +1.5-3% back to back, with new logits buffers every call; no cost above the noise to
GEMMs run right after it (2026-11-30). Also Triton's: the CPU interpreter, thin inputs (< 128 columns)
and Triton builds without Gluon. GPU tests hold the two kernels to the same bytes.

Rows that are not 16-byte aligned (the logits' row stride or ``n_cols`` not a multiple of 16) are
loaded through ``realign.load_tile`` (constexpr ``LOAD_MOD``): the same gradient and bytes from a
layout of 8 consecutive rows per thread. The FP8 rows are always 16-byte aligned (padded,
``meta.mxfp8.mxfp8_data_pitch``), so the stores are the same for both.
"""

from __future__ import annotations

from . import realign
from .cross_entropy_math import (
    class_weighted_probs,
    cross_entropy_grad,
    load_class_weight_terms,
    load_row_stats,
    round_to_dtype,
    softmax_minus_eps,
    weighted_cross_entropy_grad,
)
from .launch import cached_launch
from .mxfp8 import (
    block_amax,
    cast_satfinite,
    e8m0_from_amax,
    quantize_multiplier,
    store_column_scale_codes,
    store_row_scale_codes,
)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon: the launcher uses the Triton kernel
    gluon = gl = None

BLOCK_COLS = 128
NUM_WARPS = 2


if gluon is not None:

    @gluon.jit
    def tile_gradient(
        x,
        row_block,
        tile_col0,
        target_ptr,
        shift_ptr,
        log_sum_ptr,
        grad_ptr,
        grad_stride,
        rows,
        n_cols,
        ignore_index,
        vocab_start,
        vocab_total,
        smoothing_eps,
        target_weight,
        weight_ptr,
        smooth_total_ptr,
        DTYPE: gl.constexpr,
        HAS_SMOOTHING: gl.constexpr,
        EVEN: gl.constexpr,
        HAS_WEIGHT: gl.constexpr,
    ):
        """The gradient of the [32, 4, 32] tile ``x`` (rows, 32-column blocks, columns in a block; any
        layout) of row block ``row_block`` from column ``tile_col0``: fp32 values rounded to ``DTYPE``,
        0 outside the logits."""
        tile: gl.constexpr = x.type.layout
        by_row: gl.constexpr = gl.SliceLayout(2, tile)
        rows_idx = row_block * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, by_row))
        blocks = tile_col0 // 32 + gl.arange(0, 4, layout=gl.SliceLayout(0, by_row))
        in_block = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, tile)))
        cols = blocks[None, :, None] * 32 + in_block[None, None, :]  # [1, 4, 32]
        # Target checks once per lane (each thread of the tile holds 8 rows: its int64 target checks
        # would cost ~5 instructions per element); the tile layout loads only the two floats it needs.
        one_row_per_lane: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        lane_rows = row_block * 32 + gl.arange(0, 32, layout=one_row_per_lane)
        _, _, target, row_scale, ignored = load_row_stats(
            target_ptr,
            shift_ptr,
            log_sum_ptr,
            grad_ptr,
            grad_stride,
            lane_rows,
            rows,
            n_cols,
            ignore_index,
            vocab_start,
            vocab_total,
        )
        # Rows that are ignored, hold their target column in the tile or have an out-of-range target
        # (a NaN row scale) need the full formula; the others take the select-free branch.
        in_tile = (target >= tile_col0) & (target < tile_col0 + 128)
        special = ignored | in_tile | (row_scale != row_scale)
        row_ok = rows_idx < rows
        # The row statistics as the Triton kernel's load_shift_and_log2_sum forms them (same bits).
        shift = gl.load(shift_ptr + rows_idx, mask=row_ok, other=0.0)
        log2_sum = gl.load(log_sum_ptr + rows_idx, mask=row_ok, other=0.0) * 1.4426950408889634
        tile_rows: gl.constexpr = gl.SliceLayout(1, by_row)
        if HAS_WEIGHT:
            # Class weights: the Triton kernel's helpers, per lane for the rows, per tile column for eps.
            class_weight, alpha = load_class_weight_terms(
                target_ptr, weight_ptr, smooth_total_ptr, lane_rows, rows, vocab_total, ignore_index,
                target_weight,
            )  # fmt: skip
            column_weight = gl.load(weight_ptr + vocab_start + cols, mask=cols < n_cols, other=0.0)
            p = softmax_minus_eps(x.to(gl.float32), shift[:, None, None], log2_sum[:, None, None], 0.0, False)
            alpha3 = gl.convert_layout(alpha, tile_rows)[:, None, None]
            p = class_weighted_probs(p, alpha3, smoothing_eps * column_weight, HAS_SMOOTHING)
        else:
            p = softmax_minus_eps(
                x.to(gl.float32), shift[:, None, None], log2_sum[:, None, None], smoothing_eps, HAS_SMOOTHING
            )
        if gl.max(special.to(gl.int32), 0) > 0:
            packed = gl.convert_layout(gl.where(ignored, -2, target), tile_rows)  # -2: an ignored row
            scale = gl.convert_layout(row_scale, tile_rows)[:, None, None]
            is_ignored = (packed == -2)[:, None, None]
            if HAS_WEIGHT:
                weight3 = gl.convert_layout(class_weight, tile_rows)[:, None, None]
                grad = weighted_cross_entropy_grad(
                    p, cols, packed[:, None, None], scale, is_ignored, target_weight, weight3
                )
            else:
                grad = cross_entropy_grad(p, cols, packed[:, None, None], scale, is_ignored, target_weight)
        else:
            first_row = grad_ptr + (row_block * 32).to(gl.int64) * grad_stride
            grad_rows = gl.load(first_row + (rows_idx - row_block * 32) * grad_stride, mask=row_ok, other=0.0)
            grad = p * grad_rows[:, None, None]
        # Quantize exactly what the bf16 kernel stores: the gradient rounded to the logits' dtype.
        grad = round_to_dtype(grad, DTYPE)
        if not EVEN:
            grad = gl.where((rows_idx[:, None, None] < rows) & (cols < n_cols), grad, 0.0)
        return grad

    @gluon.jit
    def scale_rows(grad, MAX_RCP: gl.constexpr):
        """(E8M0 codes [32, 4], the tile scaled for its FP8 cast) in 1x32 blocks."""
        code = e8m0_from_amax(block_amax(grad, 2), MAX_RCP)
        return code, grad * quantize_multiplier(code)[:, :, None]

    @gluon.jit
    def scale_columns(grad, MAX_RCP: gl.constexpr):
        """(E8M0 codes [4, 32], the tile scaled for its FP8 cast) in 32x1 blocks."""
        code = e8m0_from_amax(block_amax(grad, 0), MAX_RCP)
        return code, grad * quantize_multiplier(code)[None, :, :]

    @gluon.jit
    def store_row_scales(code, row_block, tile_col0, rows, scale_ptr, scale_cols, SWIZZLED: gl.constexpr):
        """The row-wise E8M0 codes [32, 4] of the tile at (row, 32-column block)."""
        by_row: gl.constexpr = code.type.layout
        scale_row = row_block * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, by_row))[:, None]
        scale_col = tile_col0 // 32 + gl.arange(0, 4, layout=gl.SliceLayout(0, by_row))[None, :]
        store_row_scale_codes(scale_ptr, code, scale_row, scale_col, rows, scale_cols, SWIZZLED)

    @gluon.jit
    def store_column_scales(
        code, row_block, tile_col0, n_cols, scale_ptr, scale_rows, scale_cols, SWIZZLED: gl.constexpr
    ):
        """The column-wise E8M0 codes [4, 32] of the tile at (32-row block, column)."""
        by_col: gl.constexpr = code.type.layout
        col_blocks = tile_col0 // 32 + gl.arange(0, 4, layout=gl.SliceLayout(1, by_col))
        col_in_block = gl.arange(0, 32, layout=gl.SliceLayout(0, by_col))
        cols_idx = col_blocks[:, None] * 32 + col_in_block[None, :]
        store_column_scale_codes(
            scale_ptr, code, cols_idx, row_block, n_cols, scale_rows, scale_cols, SWIZZLED
        )

    @cached_launch
    @gluon.jit
    def cross_entropy_bwd_mxfp8_gluon_kernel(
        logits_ptr,
        stride_row,
        target_ptr,
        shift_ptr,
        log_sum_ptr,
        grad_ptr,
        grad_stride,
        rows,
        n_cols,
        ignore_index,
        vocab_start,
        vocab_total,
        smoothing_eps,
        target_weight,
        weight_ptr,
        smooth_total_ptr,
        data_stride,
        row_data_ptr,
        row_scale_ptr,
        row_scale_cols,
        col_data_ptr,
        col_scale_ptr,
        col_scale_rows,
        col_scale_cols,
        HAS_SMOOTHING: gl.constexpr,
        EVEN: gl.constexpr,
        HAS_WEIGHT: gl.constexpr,
        FP8_MAX: gl.constexpr,
        MAX_RCP: gl.constexpr,
        OUT_DTYPE: gl.constexpr,
        ROWWISE: gl.constexpr,
        COLWISE: gl.constexpr,
        SWIZZLED: gl.constexpr,
        LOAD_MOD: gl.constexpr,
    ):
        """One program (2 warps): a 32 x 128 tile of the logits, read once; both copies from registers.

        ``LOAD_MOD`` -1: 16-byte aligned rows (``n_cols`` and the row stride multiples of 16 elements),
        loaded in the tile's layout. Otherwise the row stride mod the elements per 16 bytes: rows that
        are not 16-byte aligned (the logits' base is), loaded through :func:`realign.load_tile`. The FP8
        rows are ``data_stride`` bytes apart, a multiple of 16 (``meta.mxfp8.mxfp8_data_pitch``), so
        every thread stores its 8 bytes of a row as one aligned word either way, the row's padding
        included (zeros)."""
        # Realigned rows keep the layout realign.load_tile reads them in (8 consecutive rows a thread, the
        # same tile as realign.SPLIT_TILE): no shared-memory round trip between the load and the math.
        if LOAD_MOD < 0:
            tile: gl.constexpr = gl.BlockedLayout([1, 1, 8], [2, 4, 4], [2, 1, 1], [2, 1, 0])
        else:
            tile: gl.constexpr = gl.BlockedLayout([8, 1, 8], [2, 4, 4], [2, 1, 1], [2, 1, 0])
        by_row: gl.constexpr = gl.SliceLayout(2, tile)

        # Tiles walk along the rows (as mxfp8.tile_coords): resident programs read long row segments.
        n_col_tiles = gl.cdiv(n_cols, 128)
        row_block = gl.program_id(0) // n_col_tiles
        tile_col0 = (gl.program_id(0) % n_col_tiles) * 128
        rows_idx = row_block * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, by_row))
        blocks = tile_col0 // 32 + gl.arange(0, 4, layout=gl.SliceLayout(0, by_row))
        in_block = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, tile)))
        cols = blocks[None, :, None] * 32 + in_block[None, None, :]  # [1, 4, 32]
        rows3 = rows_idx[:, None, None]
        # 64-bit tile origins, 32-bit offsets inside the tile (the launcher checks 32 rows fit in int32).
        tile_row0 = (row_block * 32).to(gl.int64)
        in_tile_rows = rows3 - row_block * 32
        if LOAD_MOD < 0:
            ptrs = logits_ptr + tile_row0 * stride_row + (in_tile_rows * stride_row + cols)
            # evict_last although the logits are read once: measured faster (module docstring).
            hint: gl.constexpr = "evict_last"
            if EVEN:
                x = gl.load(ptrs, eviction_policy=hint)
            else:
                x = gl.load(ptrs, mask=(rows3 < rows) & (cols < n_cols), other=0.0, eviction_policy=hint)
        else:
            split: gl.constexpr = realign.SPLIT_TILE
            x = realign.load_tile(logits_ptr, stride_row, tile_row0, tile_col0, rows, n_cols, LOAD_MOD, split)
            x = gl.convert_layout(gl.reshape(x, [32, 4, 32]), tile)
        grad = tile_gradient(
            x, row_block, tile_col0, target_ptr, shift_ptr, log_sum_ptr, grad_ptr, grad_stride, rows,
            n_cols, ignore_index, vocab_start, vocab_total, smoothing_eps, target_weight, weight_ptr,
            smooth_total_ptr,
            logits_ptr.dtype.element_ty, HAS_SMOOTHING, EVEN, HAS_WEIGHT,
        )  # fmt: skip
        out_origin = tile_row0 * data_stride
        offsets = in_tile_rows * data_stride + cols
        # Bounded by the padded row (grad is 0 past n_cols): whole words, as the compiler knows
        # data_stride is a multiple of 16.
        out_bounds = (rows3 < rows) & (cols < data_stride)
        if ROWWISE:
            code, scaled = scale_rows(grad, MAX_RCP)
            store_fp8(row_data_ptr + out_origin + offsets, scaled, out_bounds, FP8_MAX, OUT_DTYPE, EVEN)
            store_row_scales(code, row_block, tile_col0, rows, row_scale_ptr, row_scale_cols, SWIZZLED)
        if COLWISE:
            code, scaled = scale_columns(grad, MAX_RCP)
            store_fp8(col_data_ptr + out_origin + offsets, scaled, out_bounds, FP8_MAX, OUT_DTYPE, EVEN)
            store_column_scales(
                code, row_block, tile_col0, n_cols, col_scale_ptr, col_scale_rows, col_scale_cols, SWIZZLED
            )

    @gluon.jit
    def store_fp8(
        ptrs, scaled, in_bounds, FP8_MAX: gl.constexpr, OUT_DTYPE: gl.constexpr, EVEN: gl.constexpr
    ):
        """``scaled`` cast to FP8 (``cast_satfinite``) at ``ptrs``; EVEN: every element in bounds."""
        data = cast_satfinite(scaled, FP8_MAX, OUT_DTYPE)
        if EVEN:
            gl.store(ptrs, data)
        else:
            gl.store(ptrs, data, mask=in_bounds)
