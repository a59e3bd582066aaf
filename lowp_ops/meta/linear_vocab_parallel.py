"""Argument checks and output allocation for the vocabulary-parallel LM head + cross entropy.

Shapes as :mod:`lowp_ops.meta.linear_cross_entropy`, except that ``weight (V_shard, H)`` holds this rank's
vocabulary rows ``[vocab_start, vocab_start + V_shard)`` of ``vocab_total`` and ``target (N,)`` holds
global ids. The forward's output is the per-row packet of :mod:`lowp_ops.meta.vocab_parallel`.
"""

from __future__ import annotations

import torch

from .checks import require
from .cross_entropy import check_softcap, check_vocab_shard
from .linear_cross_entropy import (
    check_chunk_size,
    check_hidden_weight_target,
    linear_cross_entropy_bwd_outputs,
)
from .vocab_parallel import MAX_EXACT_WIDTH, SHARD_STATS, check_vocab_weight


def linear_vocab_parallel_ce_stats_output(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    logit_sum: bool,
    chunk_size: int,
    softcap: float = 0.0,
    ce_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The packet ``(SHARD_STATS, N)`` fp32 of the logits ``hidden @ weight^T`` (ids ``vocab_start + i``),
    capped by ``softcap`` (0.0 = no cap); ``ce_weight``: optional class weights of the whole vocabulary."""
    check_softcap(softcap)
    check_vocab_weight(ce_weight, vocab_start + weight.shape[0], hidden)
    require(hidden.dim() == 2, lambda: f"hidden must be 2-D (N, H) here, got {hidden.dim()}-D")
    check_hidden_weight_target(hidden, weight, target)
    check_chunk_size(chunk_size)
    require(vocab_start >= 0, lambda: f"vocab_start must be >= 0, got {vocab_start}")
    require(
        weight.shape[0] <= MAX_EXACT_WIDTH,
        lambda: f"a vocabulary shard must be at most {MAX_EXACT_WIDTH} rows of weight, got {weight.shape[0]}",
    )
    return hidden.new_empty((len(SHARD_STATS), hidden.shape[0]), dtype=torch.float32)


def check_weight_shard(weight: torch.Tensor, vocab_start: int, vocab_total: int) -> None:
    """``weight``'s rows are the ids ``[vocab_start, vocab_start + V)`` of ``vocab_total``."""
    require(vocab_total >= 1, lambda: f"vocab_total must be >= 1, got {vocab_total}")
    check_vocab_shard(weight.shape[0], vocab_start, vocab_total)


def linear_vocab_parallel_ce_bwd_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    grad_format: str,
    other_operand: str,
    chunk_size: int,
    compute_dhidden: bool,
    compute_dweight: bool,
    vocab_start: int,
    vocab_total: int,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    ce_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden (N, H), dweight (V_shard, H))`` in the inputs' dtype (an empty ``(0,)`` when not
    computed); ``dhidden`` is this shard's partial sum, ``stats`` the global row statistics (2, N),
    ``ce_weight`` optional class weights ``(vocab_total,)``."""
    check_weight_shard(weight, vocab_start, vocab_total)
    return linear_cross_entropy_bwd_outputs(
        hidden,
        weight,
        target,
        stats,
        grad_rows,
        label_smoothing,
        ignore_index,
        grad_format,
        other_operand,
        chunk_size,
        compute_dhidden,
        compute_dweight,
        z_loss,
        softcap,
        ce_weight,
        vocab_total,
    )
