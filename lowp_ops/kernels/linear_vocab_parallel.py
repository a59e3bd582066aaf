"""Vocabulary-parallel LM head + cross entropy on CUDA (or interpreted CPU) tensors: the reference's chunk
schedules (:mod:`lowp_ops.reference.linear_vocab_parallel`) run with the single-rank op's cuBLAS logits,
the Triton shard-statistics kernel and the single-rank backward steps bound to this rank's shard."""

from __future__ import annotations

import torch

from ..reference.linear_vocab_parallel import bwd_chunks, stats_chunks
from .linear_cross_entropy import KERNEL_STEPS
from .vocab_parallel import launch_vocab_parallel_ce_stats


def launch_linear_vocab_parallel_ce_stats(
    hidden, weight, target, vocab_start, logit_sum, chunk_size, softcap=0.0, ce_weight=None
):
    """``lowp::linear_vocab_parallel_ce_stats``."""
    return stats_chunks(
        hidden,
        weight,
        target,
        vocab_start,
        logit_sum,
        chunk_size,
        softcap,
        ce_weight,
        logits=KERNEL_STEPS.logits,
        shard_stats=launch_vocab_parallel_ce_stats,
    )


def launch_linear_vocab_parallel_ce_bwd(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::linear_vocab_parallel_ce_bwd``."""
    return bwd_chunks(*args, steps=KERNEL_STEPS)
