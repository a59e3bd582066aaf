"""Vocabulary-parallel cross entropy (Triton): one pass over this rank's shard for its per-row packet,
and the merge of the gathered packets in rank order (semantics: :mod:`lowp_ops.reference.vocab_parallel`).

The backward needs no kernel of its own: it is ``lowp::cross_entropy_bwd`` (or ``_bwd_mxfp8``) on the shard
with the merged row statistics, ``vocab_start`` and ``vocab_total``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import ceil_div, round_to_fp32
from ..meta.cross_entropy import LOG_SUM, SHIFT
from ..meta.vocab_parallel import (
    SHARD_LOG_SUM,
    SHARD_SHIFT,
    SHARD_STATS,
    SHIFTED_SUM,
    TARGET_LOGIT,
    WIDTH,
    vocab_parallel_ce_merge_outputs,
    vocab_parallel_ce_stats_output,
)
from .cross_entropy import fwd_config
from .cross_entropy_math import loss_of_rows, row_stats_weighted_or_capped, softcap_logits
from .launch import rows_with_unit_stride
from .softmax import finish_log_sum, masked_safe_shift, row_stats_and_shifted_sum

MERGE_BLOCK_ROWS = 1024


@triton.jit
def vocab_parallel_ce_stats_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    stats_ptr,
    rows,
    n_cols,
    vocab_start,
    width_value,
    weight_ptr,
    softcap,
    softcap_rcp,
    BLOCK: tl.constexpr,
    LOGIT_SUM_ON: tl.constexpr,
    WEIGHTED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SHIFT_ROW: tl.constexpr,
    LOG_SUM_ROW: tl.constexpr,
    TARGET_ROW: tl.constexpr,
    SUM_ROW: tl.constexpr,
    WIDTH_ROW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    # An all -inf shard gives log_sum = -inf (d = 0), which the merge's exp turns into a 0 contribution.
    if HAS_SOFTCAP or WEIGHTED:
        m, d, shifted_sum = row_stats_weighted_or_capped(
            row_ptr, weight_ptr + vocab_start, n_cols, softcap, softcap_rcp, BLOCK, LOGIT_SUM_ON, WEIGHTED,
            HAS_SOFTCAP,
        )  # fmt: skip
    else:
        m, d, shifted_sum = row_stats_and_shifted_sum(row_ptr, n_cols, BLOCK, LOGIT_SUM_ON)

    local_target = tl.load(target_ptr + row).to(tl.int64) - vocab_start
    in_shard = (local_target >= 0) & (local_target < n_cols)
    target_logit = tl.load(row_ptr + local_target, mask=in_shard, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:  # 0 (not this shard's target) stays 0
        target_logit, _ = softcap_logits(target_logit, softcap, softcap_rcp)
    tl.store(stats_ptr + SHIFT_ROW * rows + row, masked_safe_shift(m))
    tl.store(stats_ptr + LOG_SUM_ROW * rows + row, finish_log_sum(d))
    tl.store(stats_ptr + TARGET_ROW * rows + row, target_logit)
    tl.store(stats_ptr + SUM_ROW * rows + row, shifted_sum)
    tl.store(stats_ptr + WIDTH_ROW * rows + row, width_value)


@triton.jit
def vocab_parallel_ce_merge_kernel(
    gathered_ptr,
    target_ptr,
    loss_ptr,
    shift_ptr,
    log_sum_ptr,
    rows,
    n_ranks,
    shard_width_value,
    vocab_total,
    vocab_total_value,
    ignore_index,
    label_smoothing,
    weight_ptr,
    shard_weight_ptr,
    smooth_total_ptr,
    smoothing_eps,
    z_loss,
    BLOCK_ROWS: tl.constexpr,
    N_STATS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    SHIFT_ROW: tl.constexpr,
    LOG_SUM_ROW: tl.constexpr,
    TARGET_ROW: tl.constexpr,
    SUM_ROW: tl.constexpr,
    WIDTH_ROW: tl.constexpr,
):
    """The reference's merge (:mod:`lowp_ops.reference.vocab_parallel`), ranks in order; with class
    weights each shard's shifted sum is rebased with its classes' total weight (``shard_weight_ptr``)."""
    rows_idx = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows_idx < rows
    row_max = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    for rank in range(n_ranks):
        packet_ptr = gathered_ptr + rank * N_STATS * rows + rows_idx
        shard_shift = tl.load(packet_ptr + SHIFT_ROW * rows, mask=row_ok, other=0.0)
        shard_log_sum = tl.load(packet_ptr + LOG_SUM_ROW * rows, mask=row_ok, other=0.0)
        row_max = tl.maximum(row_max, tl.where(shard_log_sum == float("-inf"), float("-inf"), shard_shift))
    shift = masked_safe_shift(row_max)
    sum_exp = tl.zeros((BLOCK_ROWS,), tl.float32)
    target_logit = tl.zeros((BLOCK_ROWS,), tl.float32)
    shifted_sum = tl.zeros((BLOCK_ROWS,), tl.float32)
    bad_widths = tl.zeros((BLOCK_ROWS,), tl.int32)
    for rank in range(n_ranks):  # rank order: every rank adds in the same order
        packet_ptr = gathered_ptr + rank * N_STATS * rows + rows_idx
        shard_shift = tl.load(packet_ptr + SHIFT_ROW * rows, mask=row_ok, other=0.0)
        shard_log_sum = tl.load(packet_ptr + LOG_SUM_ROW * rows, mask=row_ok, other=0.0)
        sum_exp += tl.exp((shard_shift - shift) + shard_log_sum)
        target_logit += tl.load(packet_ptr + TARGET_ROW * rows, mask=row_ok, other=0.0)
        if HAS_SMOOTHING:
            shard_sum = tl.load(packet_ptr + SUM_ROW * rows, mask=row_ok, other=0.0)
            if HAS_WEIGHT:
                rebased = shard_sum + tl.load(shard_weight_ptr + rank) * (shard_shift - shift)
            else:
                rebased = shard_sum + shard_width_value * (shard_shift - shift)
            shifted_sum += tl.where(shard_log_sum == float("-inf"), shard_sum, rebased)
        width = tl.load(packet_ptr + WIDTH_ROW * rows, mask=row_ok, other=0.0)
        bad_widths += (width != shard_width_value).to(tl.int32)
    log_sum = tl.log(sum_exp)

    target = tl.load(target_ptr + rows_idx, mask=row_ok, other=ignore_index).to(tl.int64)
    loss = loss_of_rows(
        target, target_logit, shift, log_sum, shifted_sum, weight_ptr, smooth_total_ptr, vocab_total,
        vocab_total_value, ignore_index, label_smoothing, smoothing_eps, z_loss, row_ok, HAS_SMOOTHING,
        HAS_WEIGHT, HAS_Z_LOSS,
    )  # fmt: skip
    widths_ok = bad_widths == 0
    tl.store(loss_ptr + rows_idx, tl.where(widths_ok, loss, float("nan")), mask=row_ok)
    tl.store(shift_ptr + rows_idx, tl.where(widths_ok, shift, float("nan")), mask=row_ok)
    tl.store(log_sum_ptr + rows_idx, tl.where(widths_ok, log_sum, float("nan")), mask=row_ok)


def launch_vocab_parallel_ce_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    logit_sum: bool,
    weight: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    stats = vocab_parallel_ce_stats_output(logits, target, vocab_start, logit_sum, weight, softcap)
    rows, n_cols = logits.shape
    if rows == 0:
        return stats
    logits = rows_with_unit_stride(logits)
    block, num_warps = fwd_config(n_cols)
    vocab_parallel_ce_stats_kernel[(rows,)](
        logits,
        logits.stride(0),
        target.contiguous(),
        stats,
        rows,
        n_cols,
        vocab_start,
        float(n_cols),
        stats if weight is None else weight.float().contiguous(),
        softcap,
        round_to_fp32(1.0 / softcap) if softcap > 0 else 0.0,
        BLOCK=block,
        LOGIT_SUM_ON=logit_sum,
        WEIGHTED=weight is not None,
        HAS_SOFTCAP=softcap > 0,
        SHIFT_ROW=SHARD_SHIFT,
        LOG_SUM_ROW=SHARD_LOG_SUM,
        TARGET_ROW=TARGET_LOGIT,
        SUM_ROW=SHIFTED_SUM,
        WIDTH_ROW=WIDTH,
        num_warps=num_warps,
    )
    return stats


def merge_weight_args(weight, n_ranks: int, shard_width: int, eps: float, placeholder: torch.Tensor):
    """(fp32 class weights, each shard's total weight (W,), 0-d ``eps * Σ w``) for the merge kernel, or a
    placeholder for all three without weights (``HAS_WEIGHT=False`` never reads them)."""
    if weight is None:
        return placeholder, placeholder, placeholder
    weight = weight.float().contiguous()
    return weight, weight.view(n_ranks, shard_width).sum(dim=1), weight.sum() * eps


def launch_vocab_parallel_ce_merge(
    gathered: torch.Tensor,
    target: torch.Tensor,
    shard_width: int,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    loss, stats = vocab_parallel_ce_merge_outputs(
        gathered, target, shard_width, label_smoothing, ignore_index, weight, z_loss
    )
    rows = gathered.shape[1]
    if rows == 0:
        return loss, stats
    n_ranks = gathered.shape[0] // len(SHARD_STATS)
    vocab_total = n_ranks * shard_width
    eps = round_to_fp32(label_smoothing / vocab_total)
    # Widths and vocab_total go in as fp32 scalars too (an int argument equal to 1 becomes a constexpr).
    vocab_parallel_ce_merge_kernel[(ceil_div(rows, MERGE_BLOCK_ROWS),)](
        gathered.contiguous(),
        target.contiguous(),
        loss,
        stats[SHIFT],
        stats[LOG_SUM],
        rows,
        n_ranks,
        float(shard_width),
        vocab_total,
        float(vocab_total),
        ignore_index,
        label_smoothing,
        *merge_weight_args(weight, n_ranks, shard_width, eps, loss),
        eps,
        z_loss,
        BLOCK_ROWS=MERGE_BLOCK_ROWS,
        N_STATS=len(SHARD_STATS),
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_WEIGHT=weight is not None,
        HAS_Z_LOSS=z_loss > 0,
        SHIFT_ROW=SHARD_SHIFT,
        LOG_SUM_ROW=SHARD_LOG_SUM,
        TARGET_ROW=TARGET_LOGIT,
        SUM_ROW=SHIFTED_SUM,
        WIDTH_ROW=WIDTH,
        num_warps=4,
    )
    return loss, stats
