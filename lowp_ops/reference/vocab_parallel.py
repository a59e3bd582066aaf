"""Vocabulary-parallel cross entropy: per-shard statistics and their merge (semantics and CPU kernels).

Rank ``r`` of ``W`` holds the logits of the vocabulary ids ``[r * V, (r + 1) * V)`` (equal shards, in rank
order). Per row it packs (:mod:`lowp_ops.meta.vocab_parallel`) its masked-safe ``lse_r``, the target's
logit if it holds the target (else 0) and ``Σ x`` over its shard; after an all-gather every rank merges
the ``W`` packets in rank order with the same ops, so all ranks compute the same bits:

- ``lse = s + log Σ_r exp(lse_r - s)`` with ``s = max_r lse_r`` (0 when that is -inf: an all -inf shard
  contributes 0, and an all -inf row gives ``-inf`` like the single-rank forward);
- ``x_y = Σ_r target_logit_r`` (exactly one rank adds a nonzero value); NaN for a target outside
  ``[0, W V)``;
- loss ``= (1 - ls) (lse - x_y) + ls (lse - Σ_r logit_sum_r / (W V))``; ignored rows 0;
- unequal shard widths make loss and lse NaN on every row (checked on device, no host sync).
"""

from __future__ import annotations

import torch

from ..meta.vocab_parallel import (
    LOGIT_SUM,
    LSE,
    SHARD_STATS,
    TARGET_LOGIT,
    WIDTH,
    vocab_parallel_ce_merge_outputs,
    vocab_parallel_ce_stats_output,
)
from .softmax import masked_safe_logsumexp


def vocab_parallel_ce_stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, logit_sum: bool
) -> torch.Tensor:
    """-> the packet ``(SHARD_STATS, N)`` fp32 of this rank's ``(N, V)`` logits."""
    stats = vocab_parallel_ce_stats_output(logits, target, vocab_start, logit_sum)
    x = logits.float()
    n_cols = x.shape[1]
    local_target = target.long() - vocab_start
    in_shard = (local_target >= 0) & (local_target < n_cols)
    picked = x.gather(1, local_target.clamp(0, max(n_cols - 1, 0)).unsqueeze(1)).squeeze(1)
    stats[LSE] = masked_safe_logsumexp(x)
    stats[TARGET_LOGIT] = torch.where(in_shard, picked, 0.0)
    stats[LOGIT_SUM] = x.sum(dim=1) if logit_sum else 0.0
    stats[WIDTH] = n_cols
    return stats


def vocab_parallel_ce_merge(
    gathered: torch.Tensor, target: torch.Tensor, shard_width: int, label_smoothing: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (loss (N,) fp32, global lse (N,) fp32) from the ranks' packets ``(W * SHARD_STATS, N)``."""
    loss, lse = vocab_parallel_ce_merge_outputs(gathered, target, shard_width, label_smoothing, ignore_index)
    n_stats = len(SHARD_STATS)
    packets = gathered.view(gathered.shape[0] // n_stats, n_stats, gathered.shape[1]).unbind(0)
    vocab_total = len(packets) * shard_width
    row_max = packets[0][LSE]
    for packet in packets[1:]:
        row_max = torch.maximum(row_max, packet[LSE])
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    sum_exp, target_logit, logit_sum = (torch.zeros_like(shift) for _ in range(3))
    widths_ok = torch.ones_like(shift, dtype=torch.bool)
    for packet in packets:  # rank order
        sum_exp = sum_exp + torch.exp(packet[LSE] - shift)
        target_logit = target_logit + packet[TARGET_LOGIT]
        logit_sum = logit_sum + packet[LOGIT_SUM]
        widths_ok = widths_ok & (packet[WIDTH] == shard_width)
    row_lse = shift + torch.log(sum_exp)
    in_range = (target >= 0) & (target < vocab_total)
    row_loss = row_lse - torch.where(in_range, target_logit, float("nan"))
    if label_smoothing > 0:
        row_loss = (1.0 - label_smoothing) * row_loss + label_smoothing * (row_lse - logit_sum / vocab_total)
    row_loss = torch.where(target != ignore_index, row_loss, 0.0)
    loss.copy_(torch.where(widths_ok, row_loss, float("nan")))
    lse.copy_(torch.where(widths_ok, row_lse, float("nan")))
    return loss, lse
