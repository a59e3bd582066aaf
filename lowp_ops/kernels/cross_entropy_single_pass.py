"""Cross entropy forward and backward in one read of the logits (Triton), for ``overwrite_logits=True``
and for each chunk of the LM head's gradient-in-the-forward schedule (per-row gradient factors).

One program per row holds the whole row in registers (rows of up to ``SINGLE_PASS_MAX_COLS`` classes, one
warp per 2048 of them: 64 fp32 values a thread), folds its statistics, and writes the loss, the statistics
and the gradient for the given row factors over the row it read: 4 bytes of traffic per bf16 element
where the forward, the reduction and the in-place backward take 6. Its block and warps are the
forward's (``cross_entropy.fwd_config``) and it calls the same helpers in the same order
(``fold_masked_block``, ``store_row_loss``, ``grad_of_logits``), so its loss, statistics and gradient are the
two-pass path's bytes. Wider rows take the same pass through shared memory (``cross_entropy_wide_pass``,
CUDA: one program per row up to 32768 classes, one per 32768-class part past that); soft-capping, class
weights with label smoothing and rows that are not 16-byte aligned take the two passes
(``launch_cross_entropy_fwd_bwd_``).

Why 8192 classes: wider rows are several blocks in the forward, whose reduction order a one-row
program can repeat only holding every block at once. On the H200 (2026-12-02; benchmarks/RESULTS.md,
"What we tried") the forward as one block of 16 warps ran at 39% of copy at 8192 x 32000 (0.315 against
0.136 ms: one 512-thread program per SM, nothing overlaps its load), and a one-pass kernel of that shape
took 0.42-0.50 ms against 0.40 ms for the two passes. A row of one block also keeps the forward's online
fold exact here (``d = 0`` and ``m = -inf`` before it); with several blocks its rescaling products
(``softmax.online_softmax_update``) would need explicit FMAs for the bytes to agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import round_to_fp32
from ..meta.cross_entropy import LOG_SUM, SHIFT, cross_entropy_fwd_bwd_outputs, cross_entropy_fwd_outputs
from .bf16_pairs import to_dtype_rne
from .cross_entropy import (
    FWD_BLOCK,
    class_weight_args,
    fwd_config,
    launch_cross_entropy_bwd_,
    launch_cross_entropy_fwd,
    launch_cross_entropy_grad_scale,
    launch_cross_entropy_reduce,
    peel_align,
)
from .cross_entropy_math import grad_of_logits, one_row_grad_terms, store_row_loss
from .cross_entropy_wide_pass import launch_wide_pass, one_pass_folds_like_the_forward, wide_pass_applies
from .launch import PlanCache, cached_launch
from .softmax import finish_log_sum, fold_masked_block, masked_safe_shift

SINGLE_PASS_MAX_COLS = FWD_BLOCK
"""The widest row held in registers: the forward's one-block rows, 64 fp32 values per thread at 4 warps."""


@cached_launch
@triton.jit
def cross_entropy_fwd_bwd_kernel(
    logits_ptr,
    target_ptr,
    loss_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    n_cols,
    ignore_index,
    label_smoothing,
    smoothing_eps,
    target_weight,
    weight_ptr,
    smooth_total_ptr,
    z_loss,
    z_loss2,
    BLOCK: tl.constexpr,
    HAS_GRAD_ROWS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """Row ``program_id`` of contiguous ``(N, n_cols)`` logits: loss, (shift, log_sum) and the gradient for
    the row factor ``grad_ptr[row * grad_stride]`` (1 without ``HAS_GRAD_ROWS``), written over the row."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * n_cols
    target = tl.load(target_ptr + row).to(tl.int64)
    is_valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    # Loaded before the row: the reductions below then order it, like every load, before any store.
    target_logit = tl.load(row_ptr + target, mask=is_valid & in_range, other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n_cols
    x = tl.load(row_ptr + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    m = float("-inf")  # assigned, not passed as literals: literal arguments would be constexprs
    d = 0.0
    total = 0.0
    m, d, shifted_sum = fold_masked_block(m, d, total, 0, x, in_row, HAS_SMOOTHING)
    shift = masked_safe_shift(m)
    log_sum = finish_log_sum(d)

    store_row_loss(
        row, target, target_logit, shift, log_sum, shifted_sum, loss_ptr, shift_ptr, log_sum_ptr, weight_ptr,
        smooth_total_ptr, n_cols, ignore_index, label_smoothing, smoothing_eps, z_loss, HAS_SMOOTHING,
        HAS_WEIGHT, HAS_Z_LOSS,
    )  # fmt: skip

    target_col, row_scale, ignored, class_weight, alpha, factor = one_row_grad_terms(
        row, target, shift, log_sum, target_ptr, grad_ptr, grad_stride, weight_ptr, smooth_total_ptr, n_cols,
        ignore_index, target_weight, z_loss2, HAS_GRAD_ROWS, HAS_WEIGHT, HAS_Z_LOSS,
    )  # fmt: skip
    grad = grad_of_logits(
        x, cols, shift, log_sum * 1.4426950408889634, target_col, row_scale, ignored, True, class_weight,
        alpha, 0.0, factor, smoothing_eps, target_weight, 0.0, 0.0, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
        False,
    )  # fmt: skip
    tl.store(row_ptr + cols, to_dtype_rne(grad, logits_ptr.dtype.element_ty), mask=in_row)


def single_pass_applies(
    logits: torch.Tensor, label_smoothing: float, weight: torch.Tensor | None, softcap: float
) -> bool:
    """Whether one pass serves the call: past ``SINGLE_PASS_MAX_COLS`` classes,
    :func:`cross_entropy_wide_pass.wide_pass_applies`; else :func:`cross_entropy_fwd_bwd_kernel`'s
    conditions: contiguous logits with rows that start 16-byte aligned (the forward's one-block
    configuration, whose reduction order it repeats), no soft-capping and not class weights with label
    smoothing (those forwards fold the row in other helpers)."""
    n_cols = logits.shape[1]
    if n_cols > SINGLE_PASS_MAX_COLS:
        return wide_pass_applies(logits, label_smoothing, weight, softcap)
    return (
        n_cols > 0
        and peel_align(logits) == 0
        and one_pass_folds_like_the_forward(logits, label_smoothing, weight, softcap)
    )


def launch_cross_entropy_fwd_bwd_(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::cross_entropy_fwd_bwd_``: (loss, row statistics), the gradient for ``grad_loss = 1`` written
    over the logits. One pass where :func:`single_pass_applies` (the mean's gradient scale first, from
    the targets), else the forward, the reduction and the in-place backward. Either way the bytes of
    ``cross_entropy_fwd``, ``cross_entropy_reduce`` and ``cross_entropy_bwd``."""
    loss, stats = cross_entropy_fwd_bwd_outputs(
        logits, target, label_smoothing, ignore_index, reduction, weight, z_loss, softcap
    )
    if not logits.is_contiguous():
        # A compiled graph may hand over a strided view (Inductor pads a matmul's rows): the gradient is
        # formed in a contiguous copy and written back; the bytes are the same, the memory saving lost.
        work = logits.contiguous()
        result = launch_cross_entropy_fwd_bwd_(
            work, target, label_smoothing, ignore_index, reduction, weight, z_loss, softcap
        )
        logits.copy_(work)
        return result
    rows = logits.shape[0]
    mean = reduction == "mean"
    target = target.contiguous()
    if rows == 0 or not single_pass_applies(logits, label_smoothing, weight, softcap):
        return _two_passes(logits, target, label_smoothing, ignore_index, reduction, weight, z_loss, softcap)
    loss_rows = loss if reduction == "none" else stats.new_empty((rows,))
    # Without the mean the row factor is 1; with it, the mean's one scale for every row (stride 0).
    grad_scale = launch_cross_entropy_grad_scale(target, ignore_index, weight).expand(rows) if mean else None
    loss_terms = (label_smoothing, ignore_index, weight, z_loss)
    _launch_one_pass(logits, target, loss_rows, stats, grad_scale, *loss_terms)
    if reduction == "none":
        return loss, stats
    return launch_cross_entropy_reduce(loss_rows, target, ignore_index, mean, weight)[0], stats


def launch_cross_entropy_rows_fwd_bwd_(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LM head's chunk step: ``(loss_rows (N,) fp32, row statistics (2, N) fp32, dlogits)``, where
    ``dlogits`` is the gradient of ``Σ grad_rows[r] · loss[r]`` (``grad_rows`` (N,) fp32, any stride)
    written over the contiguous logits, which it returns. One pass where :func:`single_pass_applies`,
    else ``cross_entropy_fwd`` then the in-place ``cross_entropy_bwd``: the bytes of those two."""
    rows = logits.shape[0]
    if rows == 0 or not single_pass_applies(logits, label_smoothing, weight, softcap):
        loss_rows, stats = launch_cross_entropy_fwd(
            logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
        )
        launch_cross_entropy_bwd_(
            logits, target, stats, grad_rows, label_smoothing, ignore_index, weight, z_loss, softcap
        )
        return loss_rows, stats, logits
    loss_rows, stats = cross_entropy_fwd_outputs(
        logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    target = target.contiguous()
    loss_terms = (label_smoothing, ignore_index, weight, z_loss)
    _launch_one_pass(logits, target, loss_rows, stats, grad_rows, *loss_terms)
    return loss_rows, stats, logits


def _launch_one_pass(
    logits, target, loss_rows, stats, grad_rows, label_smoothing, ignore_index, weight, z_loss
) -> None:
    """:func:`cross_entropy_fwd_bwd_kernel` (or, past one block, the wide kernel) over every row;
    ``grad_rows`` None: row factors of 1."""
    n_cols = logits.shape[1]
    eps = round_to_fp32(label_smoothing / n_cols)
    class_weights, smooth_total = class_weight_args(weight, eps, loss_rows)
    # Without row factors HAS_GRAD_ROWS=False never reads the placeholder pointer.
    grad_ptr, grad_stride = (loss_rows, 0) if grad_rows is None else (grad_rows, grad_rows.stride(0))
    args = (
        logits, target, loss_rows, stats[SHIFT], stats[LOG_SUM], grad_ptr, grad_stride, n_cols, ignore_index,
        label_smoothing, eps, 1.0 - label_smoothing, class_weights, smooth_total, z_loss, 2.0 * z_loss,
    )  # fmt: skip
    flags = {
        "HAS_GRAD_ROWS": grad_rows is not None,
        "HAS_SMOOTHING": label_smoothing > 0,
        "HAS_WEIGHT": weight is not None,
        "HAS_Z_LOSS": z_loss > 0,
    }
    if n_cols > SINGLE_PASS_MAX_COLS:
        launch_wide_pass(args, flags)
        return
    key = (logits.shape[0], n_cols, *flags.values())
    _ONE_PASS_LAUNCHES.get(key, _one_pass_launch, logits.shape[0], n_cols, flags)(*args)


# The one-pass kernel bound to its grid and constexprs, per (rows, classes, flags): a call makes a
# bound launch instead of a keyword one.
_ONE_PASS_LAUNCHES = PlanCache()


def _one_pass_launch(rows: int, n_cols: int, flags: dict):
    block, num_warps = fwd_config(n_cols)
    return cross_entropy_fwd_bwd_kernel.bind((rows,), BLOCK=block, **flags, num_warps=num_warps)


def _two_passes(logits, target, label_smoothing, ignore_index, reduction, weight, z_loss, softcap):
    """:func:`launch_cross_entropy_fwd_bwd_` as three launches: forward, reduction, in-place backward."""
    loss, stats = launch_cross_entropy_fwd(
        logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    if reduction == "none":
        grad_rows = torch.ones((), dtype=torch.float32, device=logits.device).expand(logits.shape[0])
    else:
        loss, grad_scale = launch_cross_entropy_reduce(
            loss, target, ignore_index, reduction == "mean", weight
        )
        grad_rows = grad_scale.expand(logits.shape[0])
    launch_cross_entropy_bwd_(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    return loss, stats
