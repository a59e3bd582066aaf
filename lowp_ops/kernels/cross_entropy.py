"""Cross entropy (Triton): a masked-safe online forward that keeps only per-row statistics, and a
backward that recomputes the gradient from the saved logits and writes it either in the logits' dtype
or directly as MXFP8 (row- and column-wise) from registers.

Every backward kernel computes the fp32 gradient with the same element-wise ``softmax_minus_eps`` and
``cross_entropy_grad`` (``grad_of_logits``), and the MXFP8 one rounds it to the logits' dtype before
quantizing: its bytes equal ``mxfp8_quantize(<the bf16 kernel's output>)`` by construction. On CUDA the
MXFP8 one is usually ``cross_entropy_gluon``'s, the same helpers in an explicit layout. Rows that are not
16-byte aligned take a peeled forward (``softmax.row_stats_peeled``) and a bf16 backward of one program
per row segment (``cross_entropy_bwd_rows_kernel``), with the 32-row tile kernel's bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import (
    FP8_DTYPES,
    FP8_MAX,
    FP8_MAX_RCP,
    MXFP8_BLOCK_SIZE,
    ceil_div,
    next_power_of_2,
    round_to_fp32,
)
from ..meta.checks import require
from ..meta.cross_entropy import (
    LOG_SUM,
    SHIFT,
    cross_entropy_bwd_mxfp8_outputs,
    cross_entropy_bwd_output,
    cross_entropy_fwd_outputs,
    cross_entropy_mxfp8_grad_outputs,
    cross_entropy_reduce_outputs,
    cross_entropy_scale_grad_output,
    row_loss_and_stats_outputs,
)
from ..meta.mxfp8 import allocate_uint8, mxfp8_data_pitch, quantize_output_layout
from ..reference.cross_entropy import cross_entropy_reduce, loss_grad_rows, smoothing_weight_total
from . import cross_entropy_gluon
from .bf16_pairs import to_dtype_rne
from .cross_entropy_math import (
    grad_of_logits,
    program_tile_grad,
    round_to_dtype,
    row_stats_weighted_or_capped,
    row_terms,
    softcap_logits,
    store_row_loss,
)
from .launch import PlanCache, cached_launch, tensor_key
from .mxfp8 import (
    TRITON_FP8,
    quantize_tile,
    scale_padded_grid,
    scale_tile_coords,
    store_padding_scales,
    store_tile,
    tile_cols,
    tile_coords,
)
from .softmax import finish_log_sum, masked_safe_shift, row_stats_in_parts, row_stats_peeled

FWD_BLOCK = 8192


def fwd_config(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a one-row-per-program online pass: one warp per 2048 elements of a row
    block, 92-93% of copy at 4096 x 129280 on the H200."""
    block = min(FWD_BLOCK, next_power_of_2(n_cols))
    return block, max(1, block // 2048)


BWD_BLOCK_COLS = 128
TILE_ROWS = 32


@cached_launch
@triton.jit
def cross_entropy_fwd_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    loss_ptr,
    shift_ptr,
    log_sum_ptr,
    n_cols,
    ignore_index,
    label_smoothing,
    weight_ptr,
    smooth_total_ptr,
    smoothing_eps,
    z_loss,
    softcap,
    softcap_rcp,
    BLOCK: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ALIGN: tl.constexpr,
    ALIGNED_ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    if HAS_SOFTCAP or (HAS_WEIGHT and HAS_SMOOTHING):  # only smoothing needs every class's weight
        m, d, shifted_sum = row_stats_weighted_or_capped(
            row_ptr, weight_ptr, n_cols, softcap, softcap_rcp, BLOCK, HAS_SMOOTHING, HAS_WEIGHT, HAS_SOFTCAP
        )
    elif ALIGN > 0:
        row_start = row * stride_row
        m, d, shifted_sum = row_stats_peeled(
            logits_ptr, row_start, n_cols, BLOCK, HAS_SMOOTHING, ALIGN, ALIGNED_ROWS
        )
    else:
        m, d, shifted_sum = row_stats_in_parts(row_ptr, n_cols, BLOCK, HAS_SMOOTHING)
    shift = masked_safe_shift(m)
    log_sum = finish_log_sum(d)

    target = tl.load(target_ptr + row).to(tl.int64)
    is_valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    target_logit = tl.load(row_ptr + target, mask=is_valid & in_range, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        target_logit, _ = softcap_logits(target_logit, softcap, softcap_rcp)
    store_row_loss(
        row, target, target_logit, shift, log_sum, shifted_sum, loss_ptr, shift_ptr, log_sum_ptr, weight_ptr,
        smooth_total_ptr, n_cols, ignore_index, label_smoothing, smoothing_eps, z_loss, HAS_SMOOTHING,
        HAS_WEIGHT, HAS_Z_LOSS,
    )  # fmt: skip


@cached_launch
@triton.jit
def cross_entropy_bwd_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    dlogits_ptr,
    rows,
    n_cols,
    ignore_index,
    vocab_start,
    vocab_total,
    smoothing_eps,
    target_weight,
    weight_ptr,
    smooth_total_ptr,
    z_loss2,
    softcap,
    softcap_rcp,
    BLOCK_COLS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    row_block, col_tile = tile_coords(n_cols, BLOCK_COLS)
    rows_idx, cols, grad = program_tile_grad(
        row_block,
        col_tile,
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
        z_loss2,
        softcap,
        softcap_rcp,
        BLOCK_COLS,
        HAS_SMOOTHING,
        EVEN,
        HAS_WEIGHT,
        HAS_Z_LOSS,
        HAS_SOFTCAP,
    )
    store_tile(
        dlogits_ptr, rows_idx, cols, rows, n_cols, n_cols, to_dtype_rne(grad, dlogits_ptr.dtype.element_ty),
        EVEN,
    )  # fmt: skip


@cached_launch
@triton.jit
def cross_entropy_bwd_mxfp8_kernel(
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
    row_scale_rows,
    row_scale_cols,
    col_data_ptr,
    col_scale_ptr,
    col_scale_rows,
    col_scale_cols,
    z_loss2,
    softcap,
    softcap_rcp,
    BLOCK_COLS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAX_RCP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    SWIZZLED: tl.constexpr,
):
    # The grid covers the scales' padding (mxfp8.scale_padded_grid): programs past the data write its zeros.
    row_block, col_tile = scale_tile_coords(n_cols, BLOCK_COLS)
    tile_col0 = col_tile * BLOCK_COLS
    if (row_block * 32 < rows) & (tile_col0 < n_cols):
        rows_idx, cols, grad = program_tile_grad(
            row_block,
            col_tile,
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
            z_loss2,
            softcap,
            softcap_rcp,
            BLOCK_COLS,
            HAS_SMOOTHING,
            EVEN,
            HAS_WEIGHT,
            HAS_Z_LOSS,
            HAS_SOFTCAP,
        )
        # Quantize exactly what the other kernel stores: the gradient rounded to the logits' dtype.
        grad = round_to_dtype(grad, logits_ptr.dtype.element_ty)
        if not EVEN:
            grad = tl.where((rows_idx[:, None] < rows) & (cols[None, :] < n_cols), grad, 0.0)
        quantize_tile(
            grad,
            rows_idx,
            cols,
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


def stats_rows(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (shift, log_sum) rows of ``(2, N)`` row statistics as unit-stride vectors (views when they are)."""
    return stats[SHIFT].contiguous(), stats[LOG_SUM].contiguous()


def _bwd_scalars(label_smoothing: float, vocab_total: int) -> tuple[float, float]:
    """(eps, 1 - ls) as the fp32 values the reference uses."""
    return round_to_fp32(label_smoothing / vocab_total), 1.0 - label_smoothing


def feature_args(z_loss: float, softcap: float) -> dict:
    """The loss features' kernel arguments: scalars ``z_loss2 = 2 z``, ``softcap``, ``softcap_rcp =
    fp32(1 / c)`` and the ``HAS_Z_LOSS`` / ``HAS_SOFTCAP`` constexprs (False: the code without them)."""
    return {
        "z_loss2": 2.0 * z_loss,
        "softcap": softcap,
        "softcap_rcp": round_to_fp32(1.0 / softcap) if softcap > 0 else 0.0,
        "HAS_Z_LOSS": z_loss > 0,
        "HAS_SOFTCAP": softcap > 0,
    }


def class_weight_args(
    weight: torch.Tensor | None, eps: float, placeholder: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 contiguous class weights, 0-d ``s_w = eps * Σ w`` on the device) for the kernels; without
    weights a placeholder fp32 tensor for both (``HAS_WEIGHT=False`` never reads it)."""
    if weight is None:
        return placeholder, placeholder
    weight = weight.float().contiguous()
    return weight, smoothing_weight_total(weight, eps)


def launch_cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::cross_entropy_fwd``; ``block`` / ``num_warps`` override the launch configuration. From a
    plan per specialization (:data:`_FWD_PLANS`)."""
    key = (
        logits.shape, logits.stride(), logits.dtype, logits.device, target.shape, target.stride(),
        target.dtype, target.device, label_smoothing, ignore_index, tensor_key(weight), z_loss, softcap,
        block, num_warps,
    )  # fmt: skip
    args = (logits, target, label_smoothing, ignore_index, weight, z_loss, softcap, block, num_warps)
    return _FWD_PLANS.get(key, _fwd_plan, *args)(logits, target, weight)


# The launchers' plans (kernels.launch.PlanCache), one per specialization of their arguments: checks,
# configuration, grid and constexprs are made once; a call allocates and launches.
_FWD_PLANS = PlanCache()
_REDUCE_PLANS = PlanCache()
_BWD_PLANS = PlanCache()
_BWD_MXFP8_PLANS = PlanCache()
_MXFP8_GRAD_PLANS = PlanCache()  # the three steps of the MXFP8 loss under one key
_REDUCED_PLANS = PlanCache()  # the forward and the reduction under one key


def _fwd_plan(logits, target, label_smoothing, ignore_index, weight, z_loss, softcap, block, num_warps):
    """:func:`launch_cross_entropy_fwd` for arguments of these layouts and values: a function of
    ``(logits, target, weight)``."""
    cross_entropy_fwd_outputs(logits, target, label_smoothing, ignore_index, weight, z_loss, softcap)
    rows, n_cols = logits.shape
    if rows == 0:
        return lambda logits, target, weight: row_loss_and_stats_outputs(logits, rows)
    copy = logits.stride(1) != 1  # rows_with_unit_stride
    row_stride = n_cols if copy else logits.stride(0)
    default_block, default_warps = fwd_config(n_cols)
    block, num_warps = block or default_block, num_warps or default_warps
    eps = round_to_fp32(label_smoothing / n_cols)
    align = _peel_align(row_stride, n_cols, logits.element_size())
    features = feature_args(z_loss, softcap)
    launch = cross_entropy_fwd_kernel.bind(
        (rows,),
        exact_ints=False,
        BLOCK=block,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_WEIGHT=weight is not None,
        HAS_Z_LOSS=features["HAS_Z_LOSS"],
        HAS_SOFTCAP=features["HAS_SOFTCAP"],
        ALIGN=align,
        # rows on 16-byte boundaries fold in the one pass's parts (``softmax.row_stats_in_parts``)
        ALIGNED_ROWS=align > 0 and row_stride % align == 0,
        num_warps=num_warps,
    )
    scalars = (label_smoothing,)
    tail = (eps, z_loss, features["softcap"], features["softcap_rcp"])
    copy_target = not target.is_contiguous()

    def call(logits, target, weight):
        loss, stats = row_loss_and_stats_outputs(logits, rows)
        class_weights, smooth_total = class_weight_args(weight, eps, loss)
        launch(
            logits.contiguous() if copy else logits,
            row_stride,
            target.contiguous() if copy_target else target,
            loss,
            stats[SHIFT],
            stats[LOG_SUM],
            n_cols,
            ignore_index,
            *scalars,
            class_weights,
            smooth_total,
            *tail,
        )
        return loss, stats

    return call


def peel_align(logits: torch.Tensor) -> int:
    """Elements per 16 bytes where the forward peels each row's unaligned head (the row stride is not a
    multiple of 16 elements, which is all Triton's specialization proves), else 0."""
    return _peel_align(logits.stride(0), logits.shape[1], logits.element_size())


def _peel_align(row_stride: int, n_cols: int, element_size: int) -> int:
    return 16 // element_size if row_stride % 16 != 0 and n_cols > 1 else 0


def _bwd_grid(rows: int, n_cols: int, block_cols: int) -> tuple[int]:
    """1-D grid of 32-row x ``block_cols`` tiles, walked along the rows (``mxfp8.tile_coords``)."""
    return (ceil_div(rows, TILE_ROWS) * ceil_div(n_cols, block_cols),)


ROWS_BLOCK = 4096


@triton.jit
def store_row_grad(
    row_ptr, grad_row_ptr, offsets, cols, mask, any_special, class_weight_ptr, shift, log2_sum, target,
    row_scale, ignored, class_weight, alpha, factor, smoothing_eps, target_weight, softcap, softcap_rcp,
    HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """The gradient of one row's elements ``row_ptr[offsets]`` (columns ``cols`` of the vocabulary shard,
    ``mask``ed), stored at ``grad_row_ptr[offsets]`` in its dtype: ``grad_of_logits`` with the row's terms
    (``row_terms``) and, with class weights (``class_weight_ptr`` at the shard's first column), each
    column's smoothing weight."""
    column_eps = 0.0
    if HAS_WEIGHT:
        column_eps = smoothing_eps * tl.load(class_weight_ptr + cols, mask=mask, other=0.0)
    x = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad = grad_of_logits(
        x, cols, shift, log2_sum, target, row_scale, ignored, any_special, class_weight, alpha, column_eps,
        factor, smoothing_eps, target_weight, softcap, softcap_rcp, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
        HAS_SOFTCAP,
    )  # fmt: skip
    tl.store(grad_row_ptr + offsets, to_dtype_rne(grad, grad_row_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def cross_entropy_bwd_rows_kernel(
    logits_ptr,
    target_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    dlogits_ptr,
    rows,
    n_cols,
    ignore_index,
    vocab_start,
    vocab_total,
    smoothing_eps,
    target_weight,
    weight_ptr,
    smooth_total_ptr,
    z_loss2,
    softcap,
    softcap_rcp,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """``cross_entropy_bwd_kernel`` for contiguous logits whose rows are not 16-byte aligned: one program
    per row and ``BLOCK`` columns of the row's aligned body (from its first 16-byte boundary, ``ALIGN``
    elements, to its last whole ``ALIGN``-element vector), so loads and stores are vector-wide where a
    32-row tile's cannot be; the row's first program also does the up to ``2 (ALIGN - 1)`` ragged
    elements at its two ends. The same op sequence as the tile kernel (``grad_of_logits``): the same bytes."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_start = row * n_cols
    head = tl.minimum((ALIGN - row_start % ALIGN) % ALIGN, n_cols).to(tl.int32)
    body = tl.multiple_of(row_start + head, ALIGN)
    body_len = n_cols - head
    body_end = tl.multiple_of(body_len - body_len % ALIGN, ALIGN)
    shift, log2_sum, target, row_scale, ignored, class_weight, alpha, factor = row_terms(
        target_ptr, shift_ptr, log_sum_ptr, grad_ptr, grad_stride, weight_ptr, smooth_total_ptr, row, rows,
        n_cols, ignore_index, vocab_start, vocab_total, target_weight, z_loss2, HAS_WEIGHT, HAS_Z_LOSS,
    )  # fmt: skip
    in_body = chunk * BLOCK + tl.arange(0, BLOCK)
    first_col = head + chunk * BLOCK
    any_special = ignored | ((target >= first_col) & (target < first_col + BLOCK))
    store_row_grad(
        logits_ptr + body, dlogits_ptr + body, in_body, head + in_body, in_body < body_end, any_special,
        weight_ptr + vocab_start, shift, log2_sum, target, row_scale, ignored, class_weight, alpha, factor,
        smoothing_eps, target_weight, softcap, softcap_rcp, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
        HAS_SOFTCAP,
    )  # fmt: skip
    if chunk == 0:
        # The ragged ends: lanes [0, ALIGN) the head, lanes [ALIGN, 2 ALIGN) the tail after the body.
        lane = tl.arange(0, 2 * ALIGN)
        ragged = tl.where(lane < ALIGN, lane, head + body_end + lane - ALIGN)
        store_row_grad(
            logits_ptr + row_start, dlogits_ptr + row_start, ragged, ragged,
            tl.where(lane < ALIGN, lane < head, ragged < n_cols), True, weight_ptr + vocab_start, shift,
            log2_sum, target, row_scale, ignored, class_weight, alpha, factor, smoothing_eps, target_weight,
            softcap, softcap_rcp, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS, HAS_SOFTCAP,
        )  # fmt: skip


def aligned_row_programs(n_cols: int, contiguous: bool) -> bool:
    """Whether the backward to the logits' dtype runs one program per row segment
    (``cross_entropy_bwd_rows_kernel``): contiguous logits whose row length is not a multiple of 16
    elements (all that Triton's specialization proves) and at least ``ROWS_BLOCK`` long. H200, 8192 x
    50257 bf16: the tile kernel ran at 33% of copy there (scalar loads and stores), this one at 86%."""
    return n_cols % 16 != 0 and n_cols >= ROWS_BLOCK and contiguous


def launch_cross_entropy_bwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    vocab_start: int = 0,
    vocab_total: int = 0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    *,
    out: torch.Tensor | None = None,
    by_row: bool | None = None,
) -> torch.Tensor:
    """``lowp::cross_entropy_bwd``. ``out``: where to write dlogits; may be ``logits`` itself when it is
    contiguous (each program reads its block before writing it), which the LM-head loss uses. ``by_row``:
    force (True, contiguous logits only) or forbid the row-segment kernel; None:
    :func:`aligned_row_programs` decides. From a plan per specialization (:data:`_BWD_PLANS`)."""
    out_key = None if out is None else (out is logits, out.shape, out.stride(), out.dtype, out.device)
    key = (
        logits.shape, logits.stride(), logits.dtype, logits.device, target.shape, target.stride(),
        target.dtype, stats.shape, stats.stride(), stats.dtype, grad_rows.shape, grad_rows.stride(),
        grad_rows.dtype, label_smoothing, ignore_index, vocab_start, vocab_total, tensor_key(weight), z_loss,
        softcap, out_key, by_row,
    )  # fmt: skip
    args = (logits, target, stats, grad_rows, label_smoothing, ignore_index, vocab_start, vocab_total, weight)
    plan = _BWD_PLANS.get(key, _bwd_plan, *args, z_loss, softcap, out, by_row)
    return plan(logits, target, stats, grad_rows, weight, out)


def _bwd_plan(
    logits, target, stats, grad_rows, label_smoothing, ignore_index, vocab_start, vocab_total, weight, z_loss,
    softcap, out, by_row,
):  # fmt: skip
    """:func:`launch_cross_entropy_bwd` for arguments of these layouts and values: a function of
    ``(logits, target, stats, grad_rows, weight, out)``."""
    cross_entropy_bwd_output(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, vocab_start, vocab_total, weight,
        z_loss, softcap, out,
    )  # fmt: skip
    aliased = out is not None and out is not logits

    def output(logits, out):
        if aliased:  # a tensor other than logits itself: the aliasing rule checked per call
            return cross_entropy_bwd_output(
                logits, target, stats, grad_rows, label_smoothing, ignore_index, vocab_start, vocab_total,
                weight, z_loss, softcap, out,
            )  # fmt: skip
        return logits.new_empty(logits.shape) if out is None else out

    rows, n_cols = logits.shape
    if rows == 0 or n_cols == 0:
        return lambda logits, target, stats, grad_rows, weight, out: output(logits, out)
    copy = logits.stride(1) != 1  # rows_with_unit_stride
    contiguous = logits.is_contiguous() or copy
    vocab_total = vocab_total or n_cols
    eps, target_weight = _bwd_scalars(label_smoothing, vocab_total)
    features = feature_args(z_loss, softcap)
    constexprs = {
        "HAS_SMOOTHING": label_smoothing > 0,
        "HAS_WEIGHT": weight is not None,
        "HAS_Z_LOSS": features["HAS_Z_LOSS"],
        "HAS_SOFTCAP": features["HAS_SOFTCAP"],
        "num_warps": 4,
    }
    if by_row if by_row is not None else aligned_row_programs(n_cols, contiguous):
        require(contiguous, lambda: "the row-segment kernel reads contiguous logits only")
        launch = cross_entropy_bwd_rows_kernel.bind(
            (rows, ceil_div(n_cols, ROWS_BLOCK)),
            exact_ints=False,
            BLOCK=ROWS_BLOCK,
            ALIGN=16 // logits.element_size(),
            **constexprs,
        )
        head = ()
    else:
        launch = cross_entropy_bwd_kernel.bind(
            _bwd_grid(rows, n_cols, BWD_BLOCK_COLS),
            exact_ints=False,
            BLOCK_COLS=BWD_BLOCK_COLS,
            EVEN=rows % TILE_ROWS == 0 and n_cols % BWD_BLOCK_COLS == 0,
            **constexprs,
        )
        head = (n_cols if copy else logits.stride(0),)
    copy_target = not target.is_contiguous()
    grad_stride = grad_rows.stride(0)
    shard = (ignore_index, vocab_start, vocab_total, eps, target_weight)
    tail = (features["z_loss2"], features["softcap"], features["softcap_rcp"])

    def call(logits, target, stats, grad_rows, weight, out):
        dlogits = output(logits, out)
        class_weights, smooth_total = class_weight_args(weight, eps, grad_rows)
        launch(
            logits.contiguous() if copy else logits,
            *head,
            target.contiguous() if copy_target else target,
            *stats_rows(stats),
            grad_rows,
            grad_stride,
            dlogits,
            rows,
            n_cols,
            *shard,
            class_weights,
            smooth_total,
            *tail,
        )
        return dlogits

    return call


def launch_cross_entropy_bwd_mxfp8(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    vocab_start: int = 0,
    vocab_total: int = 0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    *,
    gluon: bool | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
):
    """``lowp::cross_entropy_bwd_mxfp8``. On CUDA, with >= 128 columns (a whole vocabulary or a shard of
    it), compact scales or rows that are not 16-byte aligned, and a Triton with Gluon, the Gluon kernel
    runs (``cross_entropy_gluon``);
    ``gluon=False`` forces the Triton one, whose launch config ``block_cols`` / ``num_warps`` override.
    With ``z_loss`` or ``softcap`` the Triton kernel always runs: the Gluon kernel has no loss features
    (it cannot be run without a GPU here, and the Triton kernel gives the same bytes a few points of
    bandwidth slower)."""
    key = (
        logits.shape, logits.stride(), logits.dtype, logits.device, logits.data_ptr() % 16 == 0,
        target.shape, target.stride(), target.dtype, stats.shape, stats.stride(), stats.dtype,
        grad_rows.shape, grad_rows.stride(), grad_rows.dtype, label_smoothing, ignore_index, fp8_dtype,
        rowwise, columnwise, scale_layout, vocab_start, vocab_total, tensor_key(weight), z_loss, softcap,
        gluon, block_cols, num_warps,
    )  # fmt: skip
    args = (
        logits, target, stats, grad_rows, label_smoothing, ignore_index, fp8_dtype, rowwise, columnwise,
        scale_layout, vocab_start, vocab_total, weight, z_loss, softcap, gluon, block_cols, num_warps,
    )  # fmt: skip
    return _BWD_MXFP8_PLANS.get(key, _bwd_mxfp8_plan, *args)(logits, target, stats, grad_rows, weight)


def _bwd_mxfp8_plan(
    logits, target, stats, grad_rows, label_smoothing, ignore_index, fp8_dtype, rowwise, columnwise,
    scale_layout, vocab_start, vocab_total, weight, z_loss, softcap, gluon, block_cols, num_warps,
):  # fmt: skip
    """:func:`launch_cross_entropy_bwd_mxfp8` for arguments of these layouts and values (and the logits'
    16-byte alignment): a function of ``(logits, target, stats, grad_rows, weight)``."""
    cross_entropy_bwd_mxfp8_outputs(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, fp8_dtype, rowwise, columnwise,
        scale_layout, vocab_start, vocab_total, weight, z_loss, softcap, zero_padding=False,
    )  # fmt: skip
    # The Triton kernel writes every scale code; for the Gluon one, see below.
    layout = quantize_output_layout(logits.shape, rowwise, columnwise)
    rows, n_cols = logits.shape
    if rows == 0 or n_cols == 0:
        return lambda logits, target, stats, grad_rows, weight: allocate_uint8(logits, layout)
    copy = logits.stride(1) != 1  # rows_with_unit_stride
    row_stride = n_cols if copy else logits.stride(0)
    vocab_total = vocab_total or n_cols
    eps, target_weight = _bwd_scalars(label_smoothing, vocab_total)
    data_dtype = FP8_DTYPES[fp8_dtype]
    aligned_rows = n_cols % 16 == 0 and row_stride % 16 == 0
    data_stride = mxfp8_data_pitch(n_cols)  # the FP8 rows' stride, as the outputs are allocated
    if gluon is None:
        # Swizzled scales of aligned rows: the Triton kernel (80.3% of copy against the Gluon one's 79.0%
        # on the H200); of other rows the Gluon one (65% against 9% at 8192 x 50257).
        gluon = (
            logits.is_cuda
            and cross_entropy_gluon.gluon is not None
            and (scale_layout == "compact" or not aligned_rows)
            and n_cols >= cross_entropy_gluon.BLOCK_COLS
            and 32 * max(data_stride, row_stride) < 2**31  # its in-tile offsets are int32
            and z_loss == 0
            and softcap == 0
        )
    if gluon and not aligned_rows and not copy and logits.data_ptr() % 16 != 0:
        gluon = False  # rows that are not 16-byte aligned are realigned from a 16-byte aligned base
    row_scale_shape, col_scale_shape = layout[1][0], layout[3][0]
    pad_row_scales = pad_col_scales = False
    contiguous_grad_rows = False
    if gluon:
        require(z_loss == 0 and softcap == 0, lambda: "the Gluon kernel has no z_loss / softcap: gluon=False")
        require(
            32 * max(data_stride, row_stride) < 2**31,
            lambda: "the Gluon kernel's in-tile offsets are int32: rows this wide need gluon=False",
        )
        kernel = cross_entropy_gluon.cross_entropy_bwd_mxfp8_gluon_kernel
        block_cols, num_warps = cross_entropy_gluon.BLOCK_COLS, cross_entropy_gluon.NUM_WARPS
        per_16_bytes = 16 // logits.element_size()
        tile_config = {"LOAD_MOD": -1 if aligned_rows else row_stride % per_16_bytes}
        # One dloss broadcast to every row (stride 0) cost the realigned kernel 7% at 8192 x 50257
        # (0.581 against 0.543 ms, H200); a 32 KB copy costs ~2 us.
        contiguous_grad_rows = not aligned_rows and grad_rows.stride(0) == 0
        # It writes the scales of the data's blocks; the padding is zero-filled per call
        # (meta.mxfp8.zero_scale_padding). Forms that wrote the padding too ran slower on the H200 (a
        # branch around the tile: 18% at 4096 x 129280; the last row block writing it: 11%) than the
        # fills cost (2 x 4.9 us at 8192 x 50257).
        pad_row_scales = rowwise and tuple(row_scale_shape) != (rows, ceil_div(n_cols, MXFP8_BLOCK_SIZE))
        pad_col_scales = columnwise and tuple(col_scale_shape) != (ceil_div(rows, MXFP8_BLOCK_SIZE), n_cols)
        grid = _bwd_grid(rows, n_cols, block_cols)
        # The row-wise scales' cols alone (a (0, 0) tensor when not asked for).
        scale_bounds = ((row_scale_shape[1],), tuple(col_scale_shape))
    else:
        # H200, 4096 x 129280, grid along rows: 128 columns on 2 warps 83-84% of copy; 64 on 1 or 2
        # warps 70-82%, 256 on 2-4 warps 62-67%, 128 on 4 warps 61%.
        kernel = cross_entropy_bwd_mxfp8_kernel
        block_cols = block_cols or tile_cols(n_cols, widest=128)
        num_warps = num_warps or (2 if block_cols == 128 else 1)
        features = feature_args(z_loss, softcap)
        tile_config = {
            "BLOCK_COLS": block_cols,
            "HAS_Z_LOSS": features["HAS_Z_LOSS"],
            "HAS_SOFTCAP": features["HAS_SOFTCAP"],
        }
        grid = scale_padded_grid(rows, n_cols, block_cols)  # the kernel writes every scale code
        # The row-wise scales' (rows, cols): the Triton kernel writes their padding rows.
        scale_bounds = (tuple(row_scale_shape), tuple(col_scale_shape))
    launch = kernel.bind(
        grid,
        exact_ints=False,
        **tile_config,
        EVEN=rows % TILE_ROWS == 0 and n_cols % block_cols == 0,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_WEIGHT=weight is not None,
        FP8_MAX=FP8_MAX[fp8_dtype],
        MAX_RCP=FP8_MAX_RCP[fp8_dtype],
        OUT_DTYPE=TRITON_FP8[fp8_dtype],
        ROWWISE=rowwise,
        COLWISE=columnwise,
        SWIZZLED=scale_layout == "swizzled",
        num_warps=num_warps,
    )
    tail = () if gluon else (features["z_loss2"], features["softcap"], features["softcap_rcp"])
    copy_target = not target.is_contiguous()
    shard = (rows, n_cols, ignore_index, vocab_start, vocab_total, eps, target_weight)
    row_bounds, col_bounds = scale_bounds

    def call(logits, target, stats, grad_rows, weight):
        row_data, row_scale, col_data, col_scale = outputs = allocate_uint8(logits, layout)
        if pad_row_scales:
            row_scale.zero_()
        if pad_col_scales:
            col_scale.zero_()
        class_weights, smooth_total = class_weight_args(weight, eps, grad_rows)
        if contiguous_grad_rows:
            grad_rows = grad_rows.contiguous()
        launch(
            logits.contiguous() if copy else logits,
            row_stride,
            target.contiguous() if copy_target else target,
            *stats_rows(stats),
            grad_rows,
            grad_rows.stride(0),
            *shard,
            class_weights,
            smooth_total,
            data_stride,
            row_data.view(data_dtype),
            row_scale,
            *row_bounds,
            col_data.view(data_dtype),
            col_scale,
            *col_bounds,
            *tail,
        )
        return outputs

    return call


def launch_cross_entropy_mxfp8_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor | None,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """``lowp::cross_entropy_mxfp8_grad``: the plans of :func:`launch_cross_entropy_fwd`, for ``mean`` /
    ``sum`` :func:`launch_cross_entropy_reduce`, then :func:`launch_cross_entropy_bwd_mxfp8` (three
    launches, one op: the reference's steps, each launcher's bytes), from one plan per specialization
    (:data:`_MXFP8_GRAD_PLANS`): one key a call where the three launchers would build three."""
    key = (
        logits.shape, logits.stride(), logits.dtype, logits.device, logits.data_ptr() % 16 == 0,
        target.shape, target.stride(), target.dtype, target.device, tensor_key(grad_loss), label_smoothing,
        ignore_index, reduction, fp8_dtype, rowwise, columnwise, scale_layout, tensor_key(weight), z_loss,
        softcap,
    )  # fmt: skip
    args = (
        logits, target, grad_loss, label_smoothing, ignore_index, reduction, fp8_dtype, rowwise, columnwise,
        scale_layout, weight, z_loss, softcap,
    )  # fmt: skip
    return _MXFP8_GRAD_PLANS.get(key, _mxfp8_grad_plan, *args)(logits, target, grad_loss, weight)


def _mxfp8_grad_plan(
    logits, target, grad_loss, label_smoothing, ignore_index, reduction, fp8_dtype, rowwise, columnwise,
    scale_layout, weight, z_loss, softcap,
):  # fmt: skip
    """:func:`launch_cross_entropy_mxfp8_grad` for arguments of these layouts and values (and the logits'
    16-byte alignment): the three launchers' plans for the tensors the steps pass each other, built from
    stand-ins of those tensors' layouts; a function of ``(logits, target, grad_loss, weight)``."""
    cross_entropy_mxfp8_grad_outputs(
        logits, target, grad_loss, label_smoothing, ignore_index, reduction, fp8_dtype, rowwise, columnwise,
        scale_layout, weight, z_loss, softcap,
    )  # fmt: skip
    rows = logits.shape[0]
    fwd = _fwd_plan(logits, target, label_smoothing, ignore_index, weight, z_loss, softcap, None, None)
    loss_rows, stats = row_loss_and_stats_outputs(logits, rows)  # the forward's outputs' layouts
    reduce = grad_scale = None
    if reduction != "none":
        reduce = _reduce_plan(loss_rows, target, ignore_index, reduction == "mean", weight)
        grad_scale = loss_rows.new_empty(())
    grad_rows = loss_grad_rows(grad_loss, grad_scale, rows, loss_rows)
    bwd = _bwd_mxfp8_plan(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, fp8_dtype, rowwise, columnwise,
        scale_layout, 0, 0, weight, z_loss, softcap, None, None, None,
    )  # fmt: skip

    def call(logits, target, grad_loss, weight):
        loss, stats = fwd(logits, target, weight)
        grad_scale = None
        if reduce is not None:
            loss, grad_scale = reduce(loss, target, weight)
        grad_rows = loss_grad_rows(grad_loss, grad_scale, rows, loss)
        return loss, stats, *bwd(logits, target, stats, grad_rows, weight)

    return call


# H200, 8192 rows, graph GPU time: 4096 per iteration 4.72 us, 8192 2.68 us (8 or 16 warps), 2048 6.25 us.
REDUCE_BLOCK = 8192
# One program loops over the rows: fine for the per-GPU token counts of a training step (16 loads of
# REDUCE_BLOCK rows at most); longer inputs go to the multi-block PyTorch reduction of the reference.
REDUCE_MAX_ROWS = 16 * REDUCE_BLOCK


@cached_launch
@triton.jit
def cross_entropy_reduce_kernel(
    loss_rows_ptr,
    target_ptr,
    n_rows,
    ignore_index,
    loss_ptr,
    grad_scale_ptr,
    weight_ptr,
    n_classes,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """One program: the fp32 sum of the row losses (fixed order: deterministic) and, for the mean, the
    non-ignored count (with class weights: the sum of those rows' target weights, NaN for a target
    outside ``[0, n_classes)``), then ``loss`` (NaN when the count is 0) and ``grad_scale`` with IEEE
    divisions."""
    total = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.int32)
    weight_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        in_bounds = idx < n_rows
        total += tl.load(loss_rows_ptr + idx, mask=in_bounds, other=0.0)
        if MEAN:
            target = tl.load(target_ptr + idx, mask=in_bounds, other=ignore_index).to(tl.int64)
            valid = target != ignore_index
            if HAS_WEIGHT:
                in_range = (target >= 0) & (target < n_classes)
                class_weight = tl.load(weight_ptr + target, mask=valid & in_range, other=0.0)
                weight_sum += tl.where(valid & ~in_range, float("nan"), class_weight)
            else:
                count += valid.to(tl.int32)
    loss = tl.sum(total, 0)
    scale = 1.0
    if MEAN:
        rows = tl.sum(weight_sum, 0) if HAS_WEIGHT else tl.sum(count, 0).to(tl.float32)
        loss = tl.where(rows == 0, float("nan"), tl.math.div_rn(loss, rows))
        scale = tl.math.div_rn(1.0, rows)
    tl.store(loss_ptr, loss)
    tl.store(grad_scale_ptr, scale)


def launch_cross_entropy_reduce(
    loss_rows: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    mean: bool,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::cross_entropy_reduce``: one launch for what took five to eight small PyTorch kernels. From a
    plan per specialization (:data:`_REDUCE_PLANS`)."""
    key = (
        loss_rows.shape, loss_rows.stride(), loss_rows.dtype, loss_rows.device, target.shape, target.stride(),
        target.dtype, ignore_index, mean, tensor_key(weight),
    )  # fmt: skip
    plan = _REDUCE_PLANS.get(key, _reduce_plan, loss_rows, target, ignore_index, mean, weight)
    return plan(loss_rows, target, weight)


def _reduce_plan(loss_rows, target, ignore_index, mean, weight):
    """:func:`launch_cross_entropy_reduce` for arguments of these layouts and values: a function of
    ``(loss_rows, target, weight)``."""
    if loss_rows.shape[0] > REDUCE_MAX_ROWS:
        # Longer inputs: the multi-block PyTorch reduction of the reference.
        return lambda rows, target, weight: cross_entropy_reduce(rows, target, ignore_index, mean, weight)
    cross_entropy_reduce_outputs(loss_rows, target, ignore_index, mean, weight)
    launch = cross_entropy_reduce_kernel.bind(
        (1,), exact_ints=False, MEAN=mean, BLOCK=REDUCE_BLOCK, HAS_WEIGHT=weight is not None, num_warps=8
    )
    copy_rows, copy_target = not loss_rows.is_contiguous(), not target.is_contiguous()
    n_rows, n_classes = loss_rows.shape[0], 0 if weight is None else weight.shape[0]

    def call(loss_rows, target, weight):
        loss, grad_scale = loss_rows.new_empty(()), loss_rows.new_empty(())
        class_weights = loss_rows if weight is None else weight.float().contiguous()
        launch(
            loss_rows.contiguous() if copy_rows else loss_rows,
            target.contiguous() if copy_target else target,
            n_rows,
            ignore_index,
            loss,
            grad_scale,
            class_weights,
            n_classes,
        )
        return loss, grad_scale

    return call


def launch_cross_entropy_reduced(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    mean: bool,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lowp::cross_entropy_reduced``: the plans of :func:`launch_cross_entropy_fwd`, then
    :func:`launch_cross_entropy_reduce`, under one key (:data:`_REDUCED_PLANS`)."""
    key = (
        logits.shape, logits.stride(), logits.dtype, logits.device, target.shape, target.stride(),
        target.dtype, target.device, label_smoothing, ignore_index, mean, tensor_key(weight), z_loss, softcap,
    )  # fmt: skip
    args = (logits, target, label_smoothing, ignore_index, mean, weight, z_loss, softcap)
    return _REDUCED_PLANS.get(key, _reduced_plan, *args)(logits, target, weight)


def _reduced_plan(logits, target, label_smoothing, ignore_index, mean, weight, z_loss, softcap):
    """:func:`launch_cross_entropy_reduced` for arguments of these layouts and values: a function of
    ``(logits, target, weight)``."""
    fwd = _fwd_plan(logits, target, label_smoothing, ignore_index, weight, z_loss, softcap, None, None)
    loss_rows = row_loss_and_stats_outputs(logits, logits.shape[0])[0]  # the forward's loss layout
    reduce = _reduce_plan(loss_rows, target, ignore_index, mean, weight)

    def call(logits, target, weight):
        loss_rows, stats = fwd(logits, target, weight)
        return (*reduce(loss_rows, target, weight), stats)

    return call


def launch_cross_entropy_grad_scale(
    target: torch.Tensor, ignore_index: int, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean's ``grad_scale`` of :func:`launch_cross_entropy_reduce` from the targets alone, before any
    row loss exists: that launch itself, given the targets' bytes as its row losses (it sums them into a
    loss that is dropped). The same kernel variant, not one compiled without the loss, whose accumulators
    would take another layout and so another summation order of class weights."""
    target = target.contiguous()
    stand_in_rows = target.view(torch.float32)[: target.shape[0]]
    return launch_cross_entropy_reduce(stand_in_rows, target, ignore_index, True, weight)[1]


def launch_cross_entropy_bwd_(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> None:
    """:func:`launch_cross_entropy_bwd` with the gradient written over the contiguous logits (checked as
    its ``out``), which each program reads before it writes them: the same kernels, the same bytes. The
    two-pass step of ``lowp::cross_entropy_fwd_bwd_`` and of the LM head's chunks."""
    whole_vocab = (0, 0)
    features = (weight, z_loss, softcap)
    launch_cross_entropy_bwd(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, *whole_vocab, *features, out=logits
    )


SCALE_BLOCK = 4096


@cached_launch
@triton.jit
def cross_entropy_scale_grad_kernel(
    dlogits_ptr, row_stride, grad_ptr, grad_stride, n_cols, BLOCK: tl.constexpr
):
    """Multiply one row of the gradient in place by its row's fp32 ``grad_rows`` and round to the
    gradient's dtype (RNE); a row whose factor is 1 returns at once (the product equals the input), so
    the usual call (an upstream gradient of 1) costs one program per row and one load each."""
    row = tl.program_id(0).to(tl.int64)
    factor = tl.load(grad_ptr + row * grad_stride)
    if factor != 1.0:
        row_ptr = dlogits_ptr + row * row_stride
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < n_cols
            x = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
            tl.store(row_ptr + cols, to_dtype_rne(x * factor, dlogits_ptr.dtype.element_ty), mask=in_row)


def launch_cross_entropy_scale_grad_(dlogits: torch.Tensor, grad_rows: torch.Tensor) -> None:
    """``lowp::cross_entropy_scale_grad_``: ``dlogits[i] *= grad_rows[i]`` in place, decided per row on the
    device (rows whose factor is 1 are not touched: no host sync, CUDA-graph safe)."""
    cross_entropy_scale_grad_output(dlogits, grad_rows)
    rows, n_cols = dlogits.shape
    if rows == 0 or n_cols == 0:
        return
    if dlogits.stride(1) != 1:  # rows of unit stride only: scale a contiguous copy, write it back
        work = dlogits.contiguous()
        launch_cross_entropy_scale_grad_(work, grad_rows)
        dlogits.copy_(work)
        return
    cross_entropy_scale_grad_kernel[(rows,)](
        dlogits, dlogits.stride(0), grad_rows, grad_rows.stride(0), n_cols, BLOCK=SCALE_BLOCK, num_warps=4
    )
