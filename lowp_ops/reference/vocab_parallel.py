"""Vocabulary-parallel cross entropy: per-shard statistics and their merge (semantics and CPU kernels).

Rank ``r`` of ``W`` holds the logits of the vocabulary ids ``[r * V, (r + 1) * V)`` (equal shards, in rank
order). Per row it packs (:mod:`lowp_ops.meta.vocab_parallel`) its row statistics ``(shift_r, log_sum_r)``
(the single-rank forward's), the target's logit if it holds the target (else 0) and ``t_r = Σ (x -
shift_r)`` over its shard; after an all-gather every rank merges the ``W`` packets in rank order with the
same ops, so all ranks compute the same bits:

- ``shift = max_r shift_r`` over the shards that are not all -inf (``log_sum_r > -inf``; 0 when none is:
  an all -inf row keeps ``log_sum = -inf`` like the single-rank forward);
- ``log_sum = log Σ_r exp((shift_r - shift) + log_sum_r)``: every exponent is a difference of values of
  similar magnitude, so the digits survive at any logit magnitude;
- ``Σ (x - shift) = Σ_r t_r + V (shift_r - shift)`` (a shard whose ``t_r`` sums -inf elements only keeps
  it as it is);
- ``x_y = Σ_r target_logit_r`` (exactly one rank adds a nonzero value); NaN for a target outside
  ``[0, W V)``;
- loss as the single-rank forward's (:func:`lowp_ops.reference.cross_entropy.row_loss`); ignored rows 0;
- unequal shard widths make loss and row statistics NaN on every row (checked on device, no host sync).

With class weights ``w`` (the whole vocabulary's, on every rank) the shards send ``t_r = Σ_c w_c (x_c -
shift_r)``, rebased with the shard's weight ``Σ_{c in r} w_c`` instead of ``V``, and the loss is the
single-rank weighted one (:func:`lowp_ops.reference.cross_entropy.weighted_row_loss`).

Loss features: with ``softcap`` every shard caps its logits before its statistics (the packet then holds
the capped logits' statistics and target logit); with ``z_loss`` the merge adds ``z · lse²`` of the merged
statistics to each non-ignored row's loss. The backward gets both (``lowp::cross_entropy_bwd``).
"""

from __future__ import annotations

import torch

from ..formats import round_to_fp32
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
from .cross_entropy import (
    row_loss,
    smoothing_weight_total,
    softcap_logits,
    target_class_weight,
    weighted_row_loss,
    z_loss_rows,
)
from .softmax import finish_log_sum, masked_safe_shift, row_stats


def vocab_parallel_ce_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    logit_sum: bool,
    weight: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """-> the packet ``(SHARD_STATS, N)`` fp32 of this rank's ``(N, V)`` logits; ``logit_sum``: fill
    the shifted sum (label smoothing; class-weighted with ``weight``), else 0; ``softcap``: the statistics
    of the capped logits (0.0 = no cap)."""
    stats = vocab_parallel_ce_stats_output(logits, target, vocab_start, logit_sum, weight, softcap)
    x = logits.float()
    if softcap > 0:
        x = softcap_logits(x, softcap)[0]
    n_cols = x.shape[1]
    local_target = target.long() - vocab_start
    in_shard = (local_target >= 0) & (local_target < n_cols)
    picked = x.gather(1, local_target.clamp(0, max(n_cols - 1, 0)).unsqueeze(1)).squeeze(1)
    shift, log_sum, shifted = row_stats(x)
    stats[SHARD_SHIFT] = shift
    stats[SHARD_LOG_SUM] = finish_log_sum(log_sum)
    stats[TARGET_LOGIT] = torch.where(in_shard, picked, 0.0)
    if weight is not None:
        shifted = shifted * weight.float()[vocab_start : vocab_start + n_cols]
    stats[SHIFTED_SUM] = shifted.sum(dim=1) if logit_sum else 0.0
    stats[WIDTH] = n_cols
    return stats


def vocab_parallel_ce_merge(
    gathered: torch.Tensor,
    target: torch.Tensor,
    shard_width: int,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (loss (N,) fp32, global row_stats (2, N) fp32) from the ranks' packets ``(W * SHARD_STATS, N)``;
    ``weight``: optional class weights ``(W * shard_width,)``; ``z_loss``: the z-loss coefficient."""
    args = (gathered, target, shard_width, label_smoothing, ignore_index, weight, z_loss)
    loss, stats = vocab_parallel_ce_merge_outputs(*args)
    n_stats = len(SHARD_STATS)
    packets = gathered.view(gathered.shape[0] // n_stats, n_stats, gathered.shape[1]).unbind(0)
    vocab_total = len(packets) * shard_width
    live_max = [
        torch.where(p[SHARD_LOG_SUM] == float("-inf"), float("-inf"), p[SHARD_SHIFT]) for p in packets
    ]
    row_max = live_max[0]
    for shard_max in live_max[1:]:
        row_max = torch.maximum(row_max, shard_max)
    shift = masked_safe_shift(row_max)
    # What a shard's shifted sum is rebased with: its width, or its classes' total weight.
    shard_weights = [float(shard_width)] * len(packets)
    if weight is not None:
        shard_weights = list(weight.float().view(len(packets), shard_width).sum(dim=1).unbind(0))
    sum_exp, target_logit, shifted_sum = (torch.zeros_like(shift) for _ in range(3))
    widths_ok = torch.ones_like(shift, dtype=torch.bool)
    for packet, shard_weight in zip(packets, shard_weights, strict=True):  # rank order
        sum_exp = sum_exp + torch.exp((packet[SHARD_SHIFT] - shift) + packet[SHARD_LOG_SUM])
        target_logit = target_logit + packet[TARGET_LOGIT]
        rebased = packet[SHIFTED_SUM] + shard_weight * (packet[SHARD_SHIFT] - shift)
        shifted_sum = shifted_sum + torch.where(
            packet[SHARD_LOG_SUM] == float("-inf"), packet[SHIFTED_SUM], rebased
        )
        widths_ok = widths_ok & (packet[WIDTH] == shard_width)
    log_sum = torch.log(sum_exp)
    in_range = (target >= 0) & (target < vocab_total)
    picked = torch.where(in_range, target_logit, float("nan"))
    if weight is None:
        loss_rows = row_loss(shift, log_sum, picked, shifted_sum, vocab_total, label_smoothing)
    else:
        eps = round_to_fp32(label_smoothing / vocab_total)
        class_weight = target_class_weight(weight, target)
        smooth_total = smoothing_weight_total(weight, eps) if label_smoothing > 0 else None
        loss_rows = weighted_row_loss(
            shift, log_sum, picked, class_weight, shifted_sum, smooth_total, eps, label_smoothing
        )
    if z_loss > 0:
        loss_rows = loss_rows + z_loss_rows(shift, log_sum, z_loss)
    loss_rows = torch.where(target != ignore_index, loss_rows, 0.0)
    loss.copy_(torch.where(widths_ok, loss_rows, float("nan")))
    stats[SHIFT] = torch.where(widths_ok, shift, float("nan"))
    stats[LOG_SUM] = torch.where(widths_ok, log_sum, float("nan"))
    return loss, stats
