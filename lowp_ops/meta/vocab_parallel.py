"""Argument checks and output allocation for the vocabulary-parallel cross-entropy ops.

Each rank's per-row statistics travel as one packed fp32 tensor ``(SHARD_STATS, N)``, rows in the order
of :data:`SHARD_STATS`; the all-gather stacks the ranks' packets along dim 0 into ``(W * SHARD_STATS, N)``.
"""

from __future__ import annotations

import torch

from .checks import require
from .cross_entropy import (
    TARGET_DTYPES,
    check_class_weight,
    check_ignore_index,
    check_label_smoothing,
    check_logits_target,
    check_softcap,
    check_z_loss,
    row_loss_and_stats_outputs,
)

SHARD_STATS = ("shift", "log_sum", "target_logit", "shifted_sum", "width")
"""Packet rows: the shard's row statistics (its masked-safe maximum and ``log Σ exp(x - shift)``, as the
single-rank ``row_stats`` of :mod:`lowp_ops.meta.cross_entropy`); the target's logit where this shard
holds the target, else 0; ``Σ (x - shift)`` over the shard (label smoothing; with class weights
``Σ_c w_c (x_c - shift)``), else 0; the shard width
(the merge checks that all ranks hold equally wide shards). No row is a raw logit sum or a rounded
log-sum-exp: the merge keeps the digits at any magnitude."""
SHARD_SHIFT, SHARD_LOG_SUM, TARGET_LOGIT, SHIFTED_SUM, WIDTH = range(len(SHARD_STATS))
MAX_EXACT_WIDTH = 1 << 24
"""Widths travel as fp32, exact up to 2**24."""


def check_vocab_weight(weight: torch.Tensor | None, needed: int, like: torch.Tensor) -> None:
    """Class weights of the whole vocabulary: None, or a float ``(C,)`` tensor on ``like``'s device with
    ``C >= needed`` (the stats op sees one shard; the merge checks ``C`` equals the vocabulary)."""
    if weight is None:
        return
    require(
        isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.shape[0] >= needed,
        lambda: f"weight must be the (C,) class weights of the whole vocabulary (C >= {needed})",
    )
    check_class_weight(weight, weight.shape[0], like)


def vocab_parallel_ce_stats_output(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    logit_sum: bool,
    weight: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The packet ``(SHARD_STATS, N)`` fp32 of ``(N, V)`` logits holding ids ``[vocab_start, +V)``;
    ``weight``: optional class weights of the whole vocabulary; ``softcap``: the cap (0.0 = none)."""
    require(logits.dim() == 2, lambda: f"logits must be 2-D (N, V) here, got {logits.dim()}-D")
    check_softcap(softcap)
    check_logits_target(logits, target)
    require(vocab_start >= 0, lambda: f"vocab_start must be >= 0, got {vocab_start}")
    check_vocab_weight(weight, vocab_start + logits.shape[1], logits)
    require(
        logits.shape[1] <= MAX_EXACT_WIDTH,
        lambda: f"a vocabulary shard must be at most {MAX_EXACT_WIDTH} wide, got {logits.shape[1]}",
    )
    return logits.new_empty((len(SHARD_STATS), logits.shape[0]), dtype=torch.float32)


def vocab_parallel_ce_merge_outputs(
    gathered: torch.Tensor,
    target: torch.Tensor,
    shard_width: int,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss (N,) fp32, global row_stats (2, N) fp32)`` from the gathered packets ``(W * SHARD_STATS, N)``
    fp32; ``weight``: optional class weights ``(W * shard_width,)``; ``z_loss``: the z-loss coefficient."""
    check_z_loss(z_loss)
    n_stats = len(SHARD_STATS)
    require(
        gathered.dtype == torch.float32 and gathered.dim() == 2 and gathered.shape[0] % n_stats == 0,
        lambda: (
            f"gathered must be float32 of shape (W * {n_stats}, N), got {gathered.dtype} "
            f"{tuple(gathered.shape)}"
        ),
    )
    require(gathered.shape[0] > 0, lambda: "gathered must hold at least one rank's statistics")
    require(target.dtype in TARGET_DTYPES, lambda: f"target must be int64 or int32, got {target.dtype}")
    require(
        target.dim() == 1 and target.shape[0] == gathered.shape[1],
        lambda: f"target must have shape ({gathered.shape[1]},), got {tuple(target.shape)}",
    )
    require(shard_width >= 1, lambda: f"shard_width must be >= 1, got {shard_width}")
    check_ignore_index(ignore_index, target)
    check_label_smoothing(label_smoothing)
    vocab_total = gathered.shape[0] // n_stats * shard_width
    check_vocab_weight(weight, vocab_total, gathered)
    require(
        weight is None or weight.shape[0] == vocab_total,
        lambda: f"weight must have shape ({vocab_total},) (W * shard_width), got {tuple(weight.shape)}",
    )
    return row_loss_and_stats_outputs(gathered, gathered.shape[1])
