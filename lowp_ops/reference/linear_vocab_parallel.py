"""Vocabulary-parallel LM head + cross entropy: one rank's part (pure PyTorch: semantics and CPU ops).

Rank ``r`` holds the weight rows of the vocabulary ids ``[vocab_start, vocab_start + V)`` of
``vocab_total``; ``hidden (N, H)`` and the global ``target (N,)`` are the same on every rank.

- Forward (``lowp::linear_vocab_parallel_ce_stats``): per chunk of tokens, ``logits_c = dtype(hidden_c @
  weight^T)`` exactly as the single-rank op computes them, then the shard's per-row packet of
  :func:`lowp_ops.reference.vocab_parallel.vocab_parallel_ce_stats`; only one chunk's logits exist. The
  packets are then all-gathered and merged (``lowp::vocab_parallel_ce_merge``) into the loss and global
  row statistics.
- Backward (``lowp::linear_vocab_parallel_ce_bwd``): the single-rank chunk schedule
  (:func:`~lowp_ops.reference.linear_cross_entropy.backward_chunks`) whose cross-entropy steps know the
  shard (``vocab_start``, ``vocab_total``: global ``eps``, one-hot only on the rank holding the target).
  Given the same global row statistics, its dlogits (bf16, or the MXFP8 payload when ``V`` is a multiple
  of 32) are the columns of the single-rank dlogits, so ``dweight`` is this rank's rows of the
  single-rank ``dweight``; ``dhidden`` is this shard's partial sum (the caller all-reduces it over ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..meta.linear_cross_entropy import chunk_bounds
from ..meta.linear_vocab_parallel import check_weight_shard, linear_vocab_parallel_ce_stats_output
from .linear_cross_entropy import REFERENCE_STEPS, Steps, backward_chunks
from .vocab_parallel import vocab_parallel_ce_stats as shard_stats_ref


def stats_chunks(
    hidden,
    weight,
    target,
    vocab_start,
    logit_sum,
    chunk_size,
    softcap=0.0,
    ce_weight=None,
    *,
    logits: Callable,
    shard_stats,
):
    """``lowp::linear_vocab_parallel_ce_stats`` with the given ``logits`` and ``shard_stats`` steps;
    ``ce_weight``: optional class weights of the whole vocabulary (the shard's class-weighted sum)."""
    stats = linear_vocab_parallel_ce_stats_output(
        hidden, weight, target, vocab_start, logit_sum, chunk_size, softcap, ce_weight
    )
    for start, end in chunk_bounds(hidden.shape[0], weight.shape[0], chunk_size):
        logits_c = logits(hidden[start:end], weight)
        stats[:, start:end] = shard_stats(
            logits_c, target[start:end], vocab_start, logit_sum, ce_weight, softcap
        )
    return stats


SINGLE_RANK_BWD_ARGS = 12
"""``lowp::linear_cross_entropy_bwd``'s arguments before its loss features."""


def bwd_chunks(*args, steps: Steps, on_dlogits=None):
    """``lowp::linear_vocab_parallel_ce_bwd``: the first 12 arguments of ``lowp::linear_cross_entropy_bwd``,
    then ``vocab_start, vocab_total``, the loss features ``z_loss, softcap`` and the class weights
    ``ce_weight`` of the whole vocabulary (optional)."""
    single_rank_args = args[:SINGLE_RANK_BWD_ARGS]
    vocab_start, vocab_total, *features = args[SINGLE_RANK_BWD_ARGS:]
    check_weight_shard(single_rank_args[1], vocab_start, vocab_total)
    return backward_chunks(
        *single_rank_args, *features, steps=steps, on_dlogits=on_dlogits, vocab=(vocab_start, vocab_total)
    )


def linear_vocab_parallel_ce_stats(
    hidden, weight, target, vocab_start, logit_sum, chunk_size, softcap=0.0, ce_weight=None
):
    """Reference of ``lowp::linear_vocab_parallel_ce_stats``: the packet ``(SHARD_STATS, N)`` fp32."""
    return stats_chunks(
        hidden,
        weight,
        target,
        vocab_start,
        logit_sum,
        chunk_size,
        softcap,
        ce_weight,
        logits=REFERENCE_STEPS.logits,
        shard_stats=shard_stats_ref,
    )


def linear_vocab_parallel_ce_bwd(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::linear_vocab_parallel_ce_bwd``: ``(dhidden partial, dweight)``."""
    return bwd_chunks(*args, steps=REFERENCE_STEPS)
