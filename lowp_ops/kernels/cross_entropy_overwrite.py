"""The cross entropy that writes its gradient over the logits in the forward (``overwrite_logits=True``),
in one kernel: each program takes whole rows and, for each, makes the forward's online pass (loss and
row statistics), then at once a second pass over the same row that writes the gradient in place.

The row was read from HBM a moment before, so the second pass finds most of it in L2 (132 SMs x one
258 KB row of a 129280-class bf16 vocabulary is 34 MB of the H200's 50 MB): about 4 bytes of HBM traffic
per element (read, write) where the forward and a separate in-place backward move 6. The second pass
walks the row backwards, so that it starts with the blocks read last, the likeliest still in L2; the
grid holds a few programs per SM (persistent, rows strided over them), so that the rows being read at
once fit in L2.

The bytes are those of ``cross_entropy_fwd`` then ``cross_entropy_bwd_`` by construction: the forward
pass is the forward kernel's code (``row_loss_and_stats``) at the forward's block and warp count, and the
gradient pass is the row-segment backward's (``store_row_segment_grad``) from the row statistics
re-read as the backward reads them. The mean's ``grad_scale`` comes first, from the targets alone.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..meta.cross_entropy import overwrite_row_outputs, row_loss_and_stats_outputs
from .cross_entropy import (
    LOG_SUM,
    ROWS_BLOCK,
    SHIFT,
    _bwd_scalars,
    _fwd_feature_args,
    class_weight_args,
    feature_args,
    fwd_config,
    launch_cross_entropy_reduce,
    launch_mean_grad_scale,
    peel_align,
    row_loss_and_stats,
    store_row_segment_grad,
)
from .cross_entropy_math import row_terms
from .launch import INTERPRETING, cached_launch

# Programs per SM of the persistent grid: the rows in flight at once must fit in L2.
PROGRAMS_PER_SM = 2


@cached_launch
@triton.jit
def cross_entropy_overwrite_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    loss_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    rows,
    n_cols,
    ignore_index,
    label_smoothing,
    weight_ptr,
    smooth_total_ptr,
    smoothing_eps,
    target_weight,
    z_loss,
    z_loss2,
    softcap,
    softcap_rcp,
    BLOCK: tl.constexpr,
    GRAD_BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    GRAD_ALIGN: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    REVERSE: tl.constexpr,
):
    """Rows ``program_id, program_id + num_programs, ...`` of contiguous (rows, n_cols) logits (``stride_row``
    is ``n_cols``, passed apart so that the forward pass specializes as the forward kernel does): loss
    and statistics stored, then the row's gradient written over it, scaled by ``grad_ptr[row *
    grad_stride]``."""
    n_chunks = tl.cdiv(n_cols, GRAD_BLOCK)
    first_row = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    for step_row in range(0, tl.cdiv(rows - tl.program_id(0), programs)):
        row = first_row + step_row * programs
        loss, shift, log_sum = row_loss_and_stats(
            logits_ptr, stride_row, target_ptr, row, n_cols, ignore_index, label_smoothing, weight_ptr,
            smooth_total_ptr, smoothing_eps, z_loss, softcap, softcap_rcp, BLOCK, HAS_SMOOTHING, HAS_WEIGHT,
            HAS_Z_LOSS, HAS_SOFTCAP, ALIGN,
        )  # fmt: skip
        tl.store(loss_ptr + row, loss)
        tl.store(shift_ptr + row, shift)
        tl.store(log_sum_ptr + row, log_sum)
        # The statistics are re-read as the backward reads them (the same bits); the barrier makes the
        # stores above visible to every thread of the program, and keeps every read of the row's
        # logits by the forward pass before the first gradient store.
        tl.debug_barrier()
        shift, log2_sum, target, row_scale, ignored, class_weight, alpha, factor = row_terms(
            target_ptr, shift_ptr, log_sum_ptr, grad_ptr, grad_stride, weight_ptr, smooth_total_ptr, row,
            rows, n_cols, ignore_index, 0, n_cols, target_weight, z_loss2, HAS_WEIGHT, HAS_Z_LOSS,
        )  # fmt: skip
        for step in range(0, n_chunks):
            chunk = n_chunks - 1 - step if REVERSE else step
            store_row_segment_grad(
                logits_ptr, logits_ptr, row * n_cols, n_cols, chunk, shift, log2_sum, target, row_scale,
                ignored, class_weight, alpha, factor, weight_ptr, smoothing_eps, target_weight, softcap,
                softcap_rcp, GRAD_BLOCK, GRAD_ALIGN, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS, HAS_SOFTCAP,
            )  # fmt: skip
        # The next row's statistics stores must not pass this row's last re-reads (same program).
        tl.debug_barrier()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def overwrite_programs(logits: torch.Tensor, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Programs of the persistent grid: ``programs_per_sm`` per SM, at most one per row (under the
    interpreter: one per row)."""
    rows = logits.shape[0]
    if INTERPRETING or not logits.is_cuda:
        return rows
    return min(rows, programs_per_sm * _sm_count(logits.device.index))


def launch_cross_entropy_overwrite_(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    *,
    programs: int | None = None,
    grad_block: int = ROWS_BLOCK,
    reverse: bool = True,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::cross_entropy_overwrite_``: ``(loss, row_stats)`` with the gradient (for ``grad_loss = 1``)
    written over the contiguous ``logits``. Launches: the mean's ``grad_scale`` (mean only), the row
    kernel, the reduction (mean and sum). ``programs`` / ``grad_block`` / ``reverse``: the persistent
    grid's size, the gradient pass's block and direction (for tuning; the bytes do not depend on them);
    ``num_warps``: for tuning only (the forward kernel's count gives the forward's bytes)."""
    loss_rows, stats = overwrite_row_outputs(
        logits, target, label_smoothing, ignore_index, reduction, weight, z_loss, softcap
    )
    rows = logits.shape[0]
    mean = reduction == "mean"
    if mean:
        grad_rows = launch_mean_grad_scale(target, ignore_index, weight).expand(rows)
    else:
        grad_rows = torch.ones((), dtype=torch.float32, device=logits.device).expand(rows)
    one_pass_into(
        loss_rows, stats, logits, target, grad_rows, label_smoothing, ignore_index, weight, z_loss, softcap,
        programs=programs, grad_block=grad_block, reverse=reverse, num_warps=num_warps,
    )  # fmt: skip
    if reduction == "none":
        return loss_rows, stats
    loss, _ = launch_cross_entropy_reduce(loss_rows, target, ignore_index, mean, weight)
    return loss, stats


def launch_cross_entropy_fwd_bwd_(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy_fwd`` then ``cross_entropy_bwd_`` with ``grad_rows`` (N,) fp32 known up front, in
    one pass: ``(loss (N,), row_stats (2, N))``, the gradient written over the contiguous ``logits``
    (the LM-head loss's chunks, whose arguments its op checked)."""
    loss_rows, stats = row_loss_and_stats_outputs(logits, logits.shape[0])
    one_pass_into(
        loss_rows, stats, logits, target, grad_rows, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    return loss_rows, stats


def one_pass_into(
    loss_rows: torch.Tensor,
    stats: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None,
    z_loss: float,
    softcap: float,
    *,
    programs: int | None = None,
    grad_block: int = ROWS_BLOCK,
    reverse: bool = True,
    num_warps: int | None = None,
) -> None:
    """Launch :func:`cross_entropy_overwrite_kernel` over checked arguments and allocated outputs."""
    rows, n_cols = logits.shape
    if rows == 0:
        return
    block, fwd_warps = fwd_config(n_cols)
    eps, target_weight = _bwd_scalars(label_smoothing, n_cols)  # eps: the forward's too
    class_weights, smooth_total = class_weight_args(weight, eps, loss_rows)
    cross_entropy_overwrite_kernel[(programs or overwrite_programs(logits),)](
        logits,
        n_cols,
        target.contiguous(),
        loss_rows,
        stats[SHIFT],
        stats[LOG_SUM],
        grad_rows,
        grad_rows.stride(0),
        rows,
        n_cols,
        ignore_index,
        label_smoothing,
        class_weights,
        smooth_total,
        eps,
        target_weight,
        z_loss,
        feature_args(z_loss, softcap)["z_loss2"],
        **_fwd_feature_args(z_loss, softcap),
        BLOCK=block,
        GRAD_BLOCK=grad_block,
        ALIGN=peel_align(logits),
        GRAD_ALIGN=16 // logits.element_size(),
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_WEIGHT=weight is not None,
        REVERSE=reverse,
        num_warps=num_warps or fwd_warps,
    )
