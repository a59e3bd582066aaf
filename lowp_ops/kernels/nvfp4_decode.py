"""Triton NVFP4 local-value decodes and the global scales of the recipe's GEMM outputs (semantics in
``lowp_ops.reference.nvfp4_decode``).

One program decodes a ``BLOCK_ROWS x BLOCK_COLS`` tile of one matrix of packed E2M1 codes with one E4M3
scale per 16 columns: it reads the codes (8 bytes per 16-value block) and the block scales once and
writes the bf16 values once, row-contiguous. The grouped column-wise copy is a row-wise copy per expert
(expert e's ``(hidden, m_e)`` matrix of codes, row stride ``m_e / 2`` bytes): its programs own token
tiles that never straddle experts, mapped from the device cumsum of the split sizes (no host sync).

Both formats are decoded with integer steps on the bits (the interpreter has no fp8 types) and one fp32
multiply, which is exact: bf16 holds the product, so the final cast rounds nothing. The dequantize
(``lowp::nvfp4_dequantize``) decodes the same tiles and applies the per-tensor scale with the
reference's fp32 roundings, in their order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats import NVFP4_GLOBAL_SCALE_NUMERATOR, SCALE_TILE_COLS, ceil_div, next_power_of_2
from ..meta.nvfp4 import nvfp4_dequantize_output
from ..meta.nvfp4_decode import (
    DECODE_SPLIT_MULTIPLE,
    nvfp4_decode_rows_output,
    nvfp4_group_decode_columns_output,
    nvfp4_scale_rows_output,
)
from ..meta.split_sizes import check_split_size_values
from ..reference.nvfp4 import STAGED_AMAX_UNIT
from .bf16_pairs import to_dtype_rne
from .launch import PlanCache, cached_launch, tensor_key
from .split_sizes import effective_sizes, expert_of_rows, scale_col_start, tile_owner

SCALE_COLS_MULTIPLE = tl.constexpr(SCALE_TILE_COLS)
SPLIT_MULTIPLE = tl.constexpr(DECODE_SPLIT_MULTIPLE)
FP32_QUIET_NAN_BITS = tl.constexpr(0x7FC00000)
STAGE = tl.constexpr(STAGED_AMAX_UNIT)
GLOBAL_SCALE_RCP = tl.constexpr(1.0 / NVFP4_GLOBAL_SCALE_NUMERATOR)


@triton.jit
def e2m1_value(code):
    """fp32 value of int32 E2M1 codes 0..15: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0. Built
    on the bits: Triton's unary minus is ``0 - x``, which would turn -0 into +0."""
    magnitude_code = code & 7
    exponent = magnitude_code >> 1
    mantissa = magnitude_code & 1
    # Exponent field 126 + e with e = 0 meaning 0.5 (code 1) or 0 (code 0); mantissa bit 22 is +0.5.
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    magnitude = tl.where(exponent == 0, mantissa * (126 << 23), normal)
    return (magnitude | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(bits):
    """fp32 value of int32 E4M3 (fn) bit patterns 0..255: bias 7, subnormals m * 2^-9, 0x7F / 0xFF NaN."""
    magnitude_bits = bits & 0x7F
    exponent = magnitude_bits >> 3
    mantissa = magnitude_bits & 7
    normal_bits = ((exponent + 120) << 23) | (mantissa << 20)
    normal_bits = tl.where(magnitude_bits == 0x7F, FP32_QUIET_NAN_BITS, normal_bits)
    subnormal_bits = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2^-9
    magnitude = tl.where(exponent == 0, subnormal_bits, normal_bits)
    return (magnitude | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def tile_codes(
    data_ptr,
    data_row_stride,
    scale_ptr,
    scale_row_stride,
    scale_col_stride,
    row_idx,
    rows_ok,
    col0,
    n_cols,
    BLOCK_COLS: tl.constexpr,
    MASK_COLS: tl.constexpr,
):
    """(E2M1 codes int32 [BLOCK_ROWS, NB, 16], block scales fp32 [BLOCK_ROWS, NB], output columns
    [NB, 16], output mask [BLOCK_ROWS, NB, 16]) of rows ``row_idx`` (int64, masked by ``rows_ok``),
    columns ``[col0, col0 + BLOCK_COLS)`` (below ``n_cols`` when MASK_COLS) of one matrix: codes at
    ``data_ptr`` (byte ``r * data_row_stride + c / 2``), scale of column c at ``scale_ptr + r *
    scale_row_stride + (c / 16) * scale_col_stride``; NB = BLOCK_COLS / 16. col0 and BLOCK_COLS are
    multiples of 16. Without MASK_COLS the masks are constant along a row, so accesses can be vectors."""
    NB: tl.constexpr = BLOCK_COLS // 16
    block_idx = col0 // 16 + tl.arange(0, NB)
    byte_col = block_idx[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NB, 8]
    out_col = block_idx[:, None] * 16 + tl.arange(0, 16)[None, :]  # [NB, 16]
    data_ok = tl.broadcast_to(rows_ok[:, None, None], [row_idx.shape[0], NB, 8])
    scale_ok = tl.broadcast_to(rows_ok[:, None], [row_idx.shape[0], NB])
    out_ok = tl.broadcast_to(rows_ok[:, None, None], [row_idx.shape[0], NB, 16])
    if MASK_COLS:
        data_ok = data_ok & (2 * byte_col < n_cols)[None, :, :]
        scale_ok = scale_ok & (16 * block_idx < n_cols)[None, :]
        out_ok = out_ok & (out_col < n_cols)[None, :, :]
    data_ptrs = data_ptr + row_idx[:, None, None] * data_row_stride + byte_col[None, :, :]
    packed = tl.load(data_ptrs, mask=data_ok, other=0).to(tl.int32)
    scale_ptrs = scale_ptr + row_idx[:, None] * scale_row_stride + block_idx[None, :] * scale_col_stride
    block_scale = e4m3_value(tl.load(scale_ptrs, mask=scale_ok, other=0).to(tl.int32))
    # Element 2i is the low nibble: join puts (low, high) last, so [NB, 8, 2] flattens in column order.
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [row_idx.shape[0], NB, 16])
    return codes, block_scale, out_col, out_ok


@triton.jit
def decode_tile(
    data_ptr,
    data_row_stride,
    scale_ptr,
    scale_row_stride,
    scale_col_stride,
    out_ptr,
    out_row_stride,
    row_idx,
    rows_ok,
    col0,
    n_cols,
    BLOCK_COLS: tl.constexpr,
    MASK_COLS: tl.constexpr,
):
    """The bf16 local values ``e2m1 * s_b`` of :func:`tile_codes`'s tile to ``out_ptr + r *
    out_row_stride + c``."""
    codes, block_scale, out_col, out_ok = tile_codes(
        data_ptr, data_row_stride, scale_ptr, scale_row_stride, scale_col_stride, row_idx, rows_ok, col0,
        n_cols, BLOCK_COLS, MASK_COLS,
    )  # fmt: skip
    values = e2m1_value(codes) * block_scale[:, :, None]
    out_ptrs = out_ptr + row_idx[:, None, None] * out_row_stride + out_col[None, :, :]
    tl.store(out_ptrs, values.to(tl.bfloat16), mask=out_ok)


@cached_launch
@triton.jit
def nvfp4_decode_rows_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    rows,
    cols,
    data_batch_stride,
    data_row_stride,
    scale_batch_stride,
    scale_row_stride,
    scale_col_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    EVEN_COLS: tl.constexpr,
):
    """Grid (row tiles, column tiles, batch). EVEN_COLS: cols is a multiple of BLOCK_COLS."""
    batch = tl.program_id(2).to(tl.int64)
    row_idx = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    decode_tile(
        data_ptr + batch * data_batch_stride,
        data_row_stride,
        scale_ptr + batch * scale_batch_stride,
        scale_row_stride,
        scale_col_stride,
        out_ptr + batch * rows * cols,
        cols,
        row_idx,
        row_idx < rows,
        tl.program_id(1) * BLOCK_COLS,
        cols,
        BLOCK_COLS,
        not EVEN_COLS,
    )


@cached_launch
@triton.jit
def nvfp4_dequantize_kernel(
    data_ptr,
    scale_ptr,
    amax_ptr,
    out_ptr,
    rows,
    cols,
    scale_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    EVEN_COLS: tl.constexpr,
):
    """``lowp::nvfp4_dequantize``: ``e2m1 * (s_b * amax' * fp32(1/2688)) * unstage`` in the reference's
    order of fp32 roundings (``amax'``, ``unstage``: the staged amax, ``reference.nvfp4.staged_amax``),
    cast to the output's dtype. Grid (row tiles, column tiles)."""
    row_idx = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    codes, block_scale, out_col, out_ok = tile_codes(
        data_ptr, cols // 2, scale_ptr, scale_row_stride, 1, row_idx, row_idx < rows,
        tl.program_id(1) * BLOCK_COLS, cols, BLOCK_COLS, not EVEN_COLS,
    )  # fmt: skip
    amax = tl.load(amax_ptr).to(tl.float32)
    large = amax >= STAGE
    amax = tl.where(large, amax * (1.0 / STAGE), amax)
    unstage = tl.where(large, STAGE, 1.0)
    final_scale = block_scale * amax * GLOBAL_SCALE_RCP
    values = e2m1_value(codes) * final_scale[:, :, None] * unstage
    out_ptrs = out_ptr + row_idx[:, None, None] * cols + out_col[None, :, :]
    tl.store(out_ptrs, to_dtype_rne(values, out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def token_tile_coordinates(split_ptr, experts, tokens, tile, TILE: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    """(decodable, tokens of its range, first token, expert size, first local token of the tile, first
    scale column) of token tile ``tile`` when every expert's tokens are cut into TILE-token tiles in
    order, followed by the tiles of the tokens past the last expert. The experts' tokens are the
    effective boundaries (even sizes) of the split sizes: decodable, a tile of an expert; the others (the
    tokens past the experts, among them an expert reaching past ``tokens`` and those after it) are zeros."""
    idx = tl.arange(0, EXPERTS_POW2)
    sizes = effective_sizes(split_ptr, experts, tokens, EXPERTS_POW2, SPLIT_MULTIPLE)
    tiles, tile_ends, expert = tile_owner(sizes, tile, TILE)
    in_expert = expert < experts
    mine = idx == expert
    before = idx < expert
    start = tl.sum(tl.where(before, sizes, 0), 0)
    size = tl.sum(tl.where(mine, sizes, 0), 0)
    first_tile = tl.where(in_expert, tl.sum(tl.where(mine, tile_ends - tiles, 0), 0), tl.sum(tiles, 0))
    n_tokens = tl.maximum(tl.minimum(tl.where(in_expert, size, tokens), tokens - start), 0)
    scale_col0 = scale_col_start(sizes, before, SCALE_COLS_MULTIPLE)
    decodable = in_expert & (start + size <= tokens)
    return decodable, n_tokens, start, size, (tile - first_tile) * TILE, scale_col0


@cached_launch
@triton.jit
def nvfp4_group_decode_columns_kernel(
    col_data_ptr,
    col_scale_ptr,
    split_ptr,
    out_ptr,
    hidden,
    tokens,
    experts,
    scale_row_stride,
    scale_col_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
):
    """Grid (token tiles, hidden tiles): a tile of one expert's (hidden, m_e) codes, or zeros."""
    decodable, n_tokens, start, size, local0, scale_col0 = token_tile_coordinates(
        split_ptr, experts, tokens, tl.program_id(0), BLOCK_TOKENS, EXPERTS_POW2
    )
    row_idx = tl.program_id(1).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rows_ok = row_idx < hidden
    # Split sizes that are multiples of 16 (the recipe's) and a full tile: aligned, unmasked vectors.
    fast = decodable & (start % 16 == 0) & (size % 16 == 0) & (local0 + BLOCK_TOKENS <= n_tokens)
    if fast:
        aligned_start = tl.multiple_of(start, 16)
        decode_tile(
            col_data_ptr + tl.multiple_of((aligned_start // 2).to(tl.int64) * hidden, 8),
            tl.multiple_of(size // 2, 8),
            col_scale_ptr + scale_col0 * scale_col_stride,
            scale_row_stride,
            scale_col_stride,
            out_ptr + aligned_start,
            tokens,
            row_idx,
            rows_ok,
            local0,
            n_tokens,
            BLOCK_TOKENS,
            False,
        )
    elif decodable:
        decode_tile(
            col_data_ptr + (start // 2).to(tl.int64) * hidden,
            size // 2,
            col_scale_ptr + scale_col0 * scale_col_stride,
            scale_row_stride,
            scale_col_stride,
            out_ptr + start,
            tokens,
            row_idx,
            rows_ok,
            local0,
            n_tokens,
            BLOCK_TOKENS,
            True,
        )
    else:
        out_col = local0 + tl.arange(0, BLOCK_TOKENS)
        zeros = tl.zeros([BLOCK_ROWS, BLOCK_TOKENS], dtype=tl.bfloat16)
        out_ptrs = out_ptr + start + row_idx[:, None] * tokens + out_col[None, :]
        tl.store(out_ptrs, zeros, mask=rows_ok[:, None] & (out_col < n_tokens)[None, :])


@cached_launch
@triton.jit
def nvfp4_scale_rows_kernel(
    y_ptr,
    out_ptr,
    amax_a_ptr,
    amax_b_ptr,
    ends_ptr,
    rows,
    cols,
    y_row_stride,
    experts,
    rows_per_expert,
    BY_ENDS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Grid (row tiles, column tiles). A row's expert is the number of ends <= it (BY_ENDS) or
    ``row // rows_per_expert``; its two global-scale factors are formed per row, as the reference's."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    if BY_ENDS:
        e = tl.arange(0, EXPERTS_POW2)
        ends = tl.load(ends_ptr + e, mask=e < experts, other=rows)  # padding: past every row
        expert = expert_of_rows(ends, row)
    else:
        expert = row // rows_per_expert
    owned = (row < rows) & (expert < experts)
    a = tl.load(amax_a_ptr + expert, mask=owned, other=0.0) * GLOBAL_SCALE_RCP
    b = tl.load(amax_b_ptr + expert, mask=owned, other=0.0) * GLOBAL_SCALE_RCP
    alpha = a * b
    overflows = (tl.abs(alpha) == float("inf")) & (tl.abs(a) < float("inf")) & (tl.abs(b) < float("inf"))
    first = tl.where(overflows, a, alpha)
    second = tl.where(owned, tl.where(overflows, b, 1.0), 0.0)
    mask = (row < rows)[:, None] & (col < cols)[None, :]
    y = tl.load(y_ptr + row[:, None].to(tl.int64) * y_row_stride + col[None, :], mask=mask, other=0.0)
    scaled = (y.to(tl.float32) * first[:, None]) * second[:, None]
    out = out_ptr + row[:, None].to(tl.int64) * cols + col[None, :]
    tl.store(out, to_dtype_rne(scaled, tl.bfloat16), mask=mask)


# ----------------------------------------------------------------------------------------- launchers


def decode_config(cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps): 16 x 256 tiles, 4 warps (32 values per thread); narrower
    (a power of two >= 16) for thin matrices. Not tuned on a GPU yet."""
    return 16, max(16, min(256, next_power_of_2(cols))), 4


def launch_nvfp4_decode_rows(
    data: torch.Tensor, scale: torch.Tensor, config: tuple | None = None
) -> torch.Tensor:
    """``lowp::nvfp4_decode_rows`` on CUDA (or interpreted CPU) tensors; ``config`` = (BLOCK_ROWS,
    BLOCK_COLS, num_warps) overrides the launch configuration (benchmarks, tests). From a plan per
    specialization (:data:`_PLANS`)."""
    key = ("rows", data.shape, data.stride(), data.dtype, data.device, scale.shape, scale.stride())
    key += (scale.dtype, scale.device, config)
    return _PLANS.get(key, _decode_rows_plan, data, scale, config)(data, scale)


# The launchers' plans, one per specialization (shapes, strides, dtypes, devices, options): the checks
# of the layouts, the grids and the constexprs depend on nothing else. Split-size values, where checked
# on the host (meta.split_sizes), are checked on every call.
_PLANS = PlanCache()


def _decode_rows_plan(data: torch.Tensor, scale: torch.Tensor, config: tuple | None):
    shape = nvfp4_decode_rows_output(data, scale).shape  # the checks
    rows, cols = shape[-2:]
    batch = data.shape[0] if data.dim() == 3 else 1
    if math.prod(shape) == 0:
        return lambda data, scale: data.new_empty(shape, dtype=torch.bfloat16)
    data3 = data.reshape(-1, rows, data.shape[-1])
    copy = data3.stride(-1) != 1
    # A copied batch is contiguous: (rows * C/2, C/2).
    data_strides = (rows * data.shape[-1], data.shape[-1]) if copy else data3.stride()[:2]
    scale3 = scale.reshape(-1, *scale.shape[-2:])
    block_rows, block_cols, num_warps = config or decode_config(cols)
    launch = nvfp4_decode_rows_kernel.bind(
        (ceil_div(rows, block_rows), ceil_div(cols, block_cols), batch),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        EVEN_COLS=cols % block_cols == 0,
        num_warps=num_warps,
    )
    strides = (*data_strides, *scale3.stride())
    data_rows = (-1, rows, data.shape[-1])
    scale_rows = (-1, *scale.shape[-2:])

    def call(data, scale):
        out = data.new_empty(shape, dtype=torch.bfloat16)
        data3 = data.reshape(data_rows)
        launch(data3.contiguous() if copy else data3, scale.reshape(scale_rows), out, rows, cols, *strides)
        return out

    return call


def launch_nvfp4_dequantize(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``lowp::nvfp4_dequantize`` on CUDA (or interpreted CPU) tensors: one launch, from a plan per
    specialization (:data:`_DEQUANTIZE_PLANS`)."""
    key = (data.shape, data.stride(), data.dtype, data.device, scale.shape, scale.stride(), scale.dtype)
    key += (tensor_key(amax), dtype)
    return _DEQUANTIZE_PLANS.get(key, _dequantize_plan, data, scale, amax, dtype)(data, scale, amax)


# launch_nvfp4_dequantize's plans: the checks, grid and constexprs depend on the key alone.
_DEQUANTIZE_PLANS = PlanCache()


def _dequantize_plan(data, scale, amax, dtype):
    """The call of :func:`launch_nvfp4_dequantize` for arguments of these layouts: a function of
    ``(data, scale, amax)`` that allocates the output and launches."""
    shape = nvfp4_dequantize_output(data, scale, amax, dtype).shape  # the checks
    rows, cols = shape
    if rows == 0 or cols == 0:
        return lambda data, scale, amax: data.new_empty(shape, dtype=dtype)
    copy = not data.is_contiguous()
    copy_scale = scale.stride(1) != 1  # the kernel reads a row's scales at unit stride
    block_rows, block_cols, num_warps = decode_config(cols)
    launch = nvfp4_dequantize_kernel.bind(
        (ceil_div(rows, block_rows), ceil_div(cols, block_cols)),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        EVEN_COLS=cols % block_cols == 0,
        num_warps=num_warps,
    )
    scale_stride = scale.shape[1] if copy_scale else scale.stride(0)

    def call(data, scale, amax):
        out = data.new_empty(shape, dtype=dtype)
        scale = scale.contiguous() if copy_scale else scale
        # amax holds one element (checked): the kernel reads it at its data pointer, whatever its shape.
        launch(data.contiguous() if copy else data, scale, amax, out, rows, cols, scale_stride)
        return out

    return call


def launch_nvfp4_group_decode_columns(
    col_data: torch.Tensor,
    col_scale: torch.Tensor,
    split_sizes: torch.Tensor,
    hidden: int,
    tokens: int,
    config: tuple | None = None,
) -> torch.Tensor:
    """``lowp::nvfp4_group_decode_columns`` on CUDA (or interpreted CPU) tensors. The split sizes stay on
    the device: the grid covers the most token tiles any split can need, the experts' plus the tail's,
    ``(tokens + (E + 1) * (BLOCK_TOKENS - 1)) // BLOCK_TOKENS``. ``config`` = (BLOCK_ROWS, BLOCK_TOKENS,
    num_warps)."""
    key = ("columns", col_data.shape, col_data.stride(), col_data.dtype, col_data.device, col_scale.shape)
    key += (col_scale.stride(), col_scale.dtype, col_scale.device, tensor_key(split_sizes), hidden, tokens)
    key += (config,)
    args = (col_data, col_scale, split_sizes, hidden, tokens, config)
    plan = _PLANS.get(key, _group_decode_columns_plan, *args)
    check_split_size_values(  # values: every call
        split_sizes, tokens, total="any", multiple=DECODE_SPLIT_MULTIPLE, why="two codes per byte"
    )
    return plan(col_data, col_scale, split_sizes)


def _group_decode_columns_plan(col_data, col_scale, split_sizes, hidden, tokens, config):
    nvfp4_group_decode_columns_output(col_data, col_scale, split_sizes, hidden, tokens)  # the checks
    if hidden * tokens == 0:
        return lambda col_data, col_scale, split_sizes: col_data.new_empty(
            (hidden, tokens), dtype=torch.bfloat16
        )
    experts = split_sizes.shape[0]
    block_rows, block_tokens, num_warps = config or (32, 128, 4)
    token_tiles = (tokens + (experts + 1) * (block_tokens - 1)) // block_tokens
    launch = nvfp4_group_decode_columns_kernel.bind(
        (token_tiles, ceil_div(hidden, block_rows)),
        BLOCK_ROWS=block_rows,
        BLOCK_TOKENS=block_tokens,
        EXPERTS_POW2=max(2, next_power_of_2(experts)),
        num_warps=num_warps,
    )
    copy_data, copy_sizes = not col_data.is_contiguous(), not split_sizes.is_contiguous()
    scale_strides = col_scale.stride()

    def call(col_data, col_scale, split_sizes):
        out = col_data.new_empty((hidden, tokens), dtype=torch.bfloat16)
        launch(
            col_data.contiguous() if copy_data else col_data,
            col_scale,
            split_sizes.contiguous() if copy_sizes else split_sizes,
            out,
            hidden,
            tokens,
            experts,
            *scale_strides,
        )
        return out

    return call


def launch_nvfp4_scale_rows(
    y: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor, ends: torch.Tensor | None
) -> torch.Tensor:
    """``lowp::nvfp4_scale_rows`` on CUDA (or interpreted CPU) tensors: one launch, 16 x 256 tiles, from a
    plan per specialization."""
    key = ("scale", y.shape, y.stride(), y.dtype, y.device, tensor_key(amax_a), tensor_key(amax_b))
    key += (tensor_key(ends),)
    return _PLANS.get(key, _scale_rows_plan, y, amax_a, amax_b, ends)(y, amax_a, amax_b, ends)


def _scale_rows_plan(y, amax_a, amax_b, ends):
    shape = nvfp4_scale_rows_output(y, amax_a, amax_b, ends).shape  # the checks
    rows, cols = y.shape
    if rows * cols == 0:
        return lambda y, amax_a, amax_b, ends: y.new_empty(shape)
    copy = y.stride(1) != 1  # rows_with_unit_stride
    y_stride = cols if copy else y.stride(0)
    experts = amax_a.shape[0]
    block_rows, block_cols, num_warps = decode_config(cols)
    launch = nvfp4_scale_rows_kernel.bind(
        (ceil_div(rows, block_rows), ceil_div(cols, block_cols)),
        BY_ENDS=ends is not None,
        EXPERTS_POW2=max(2, next_power_of_2(experts)),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    rows_per_expert = max(1, rows // experts)
    # The kernel reads the amaxes and ends at unit stride: strided ones are copied first.
    copy_a, copy_b = not amax_a.is_contiguous(), not amax_b.is_contiguous()
    copy_ends = ends is not None and not ends.is_contiguous()

    def call(y, amax_a, amax_b, ends):
        out = y.new_empty(shape)
        amax_a = amax_a.contiguous() if copy_a else amax_a
        amax_b = amax_b.contiguous() if copy_b else amax_b
        launch(
            y.contiguous() if copy else y,
            out,
            amax_a,
            amax_b,
            amax_a if ends is None else ends.contiguous() if copy_ends else ends,  # unused without ends
            rows,
            cols,
            y_stride,
            experts,
            rows_per_expert,
        )
        return out

    return call
