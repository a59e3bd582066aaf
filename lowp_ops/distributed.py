"""Vocabulary-parallel cross entropy over ``torch.distributed`` (docs/cross_entropy.md#vocabulary-parallel).

Layout: rank ``r`` of the process group's ``W`` ranks holds the logits of the vocabulary ids
``[r * V, (r + 1) * V)``: contiguous shards of EQUAL width ``V``, in group-rank order (pad the vocabulary
to a multiple of ``W``, as Megatron does). Targets are global ids, replicated on every rank. Equal widths
keep ``vocab_start`` and ``vocab_total`` host integers taken from shapes (no host sync, static under
``torch.compile`` and CUDA graphs); the merge checks on device that every rank sent the same width and
otherwise returns NaN loss and row statistics on every rank (hence NaN gradients). Every rank must pass
the same rows (N, hidden size), targets and options (``label_smoothing``, ``ignore_index``, ``z_loss``,
...): a mismatch is not detected (that would need a host sync); rows of different counts make the
all-gather itself fail as the backend does (gloo aborts the process; another rank may read a partly
filled buffer), and other differences give each rank a different loss.

Forward: one pass over the shard packs per-row statistics (``lowp::vocab_parallel_ce_stats``: the shard's
row maximum and log-sum of exponentials, the target logit where this shard holds it, the shard's sum of
``x - max`` for label smoothing — the term TE forgets — and the width; no rounded lse and no raw
logit sum travel, so the merged loss keeps its digits at any logit magnitude), ONE all-gather through
``torch.distributed._functional_collectives`` (so
``torch.compile(fullgraph=True)`` keeps one graph, and NCCL captures into CUDA graphs), then every rank
merges the packets in rank order with the same ops (``lowp::vocab_parallel_ce_merge``): the loss is
bit-identical on every rank. It matches the single-rank loss to fp32 rounding (the log-sum-exp is summed
in a different order), not bit for bit.

Backward: no collective. Each rank's gradient is ``lowp::cross_entropy_bwd`` (or ``_bwd_mxfp8``) on its
shard with the merged row statistics, ``vocab_start = r V``, ``vocab_total = W V``; so it equals, byte for
byte, the columns ``[r V, (r + 1) V)`` of the single-rank backward given the same statistics — for MXFP8
when ``V`` is a
multiple of 32 (row-wise blocks do not straddle shards; column-wise blocks run along rows), compared on
the valid scale region (each shard pads its own compact scales).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import library
from .library import refuse_double_backward

__all__ = [
    "linear_vocab_parallel_cross_entropy_rows",
    "linear_vocab_parallel_cross_entropy_stats",
    "vocab_parallel_cross_entropy_rows",
    "vocab_parallel_cross_entropy_stats",
]

# torch 2.13 deprecates all_gather_tensor for all_gather_single, which torch 2.11 lacks.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def check_process_group(process_group) -> None:
    """Only a ``torch.distributed.ProcessGroup`` is supported (not a DeviceMesh or a list of ranks), on a
    rank that belongs to it."""
    if type(process_group) is int and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        # What new_group returns on the ranks it leaves out.
        raise ValueError(
            "process_group: this process is not a member of the group; call the loss only on its ranks"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise NotImplementedError(
            "process_group must be a torch.distributed.ProcessGroup (other group kinds are not supported), "
            f"got {type(process_group).__name__}"
        )


def vocab_shard(shard_width: int, process_group: dist.ProcessGroup) -> tuple[int, int]:
    """``(vocab_start, vocab_total)`` of this rank's shard of width ``shard_width``."""
    return dist.get_rank(process_group) * shard_width, dist.get_world_size(process_group) * shard_width


def vocab_parallel_cross_entropy_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    process_group: dist.ProcessGroup,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (per-row loss (N,) fp32, global row_stats (2, N) fp32), identical on every rank; not
    differentiable.

    ``logits`` (N, V) is this rank's shard, ``target`` (N,) global ids, ``weight`` optional class weights
    of the whole vocabulary (W V,), the same on every rank; ``z_loss``, ``softcap`` the loss features
    (0.0 = off): each shard caps its own logits, the merge adds the z-loss. One all-gather of a ``(5, N)``
    fp32 packet per rank (:mod:`lowp_ops.meta.vocab_parallel`)."""
    check_process_group(process_group)
    shard_width = logits.shape[1]
    vocab_start, _ = vocab_shard(shard_width, process_group)
    stats = library.vocab_parallel_ce_stats(logits, target, vocab_start, label_smoothing > 0, weight, softcap)
    return _gather_and_merge(
        stats, target, shard_width, label_smoothing, ignore_index, process_group, weight, z_loss
    )


def _gather_and_merge(
    stats, target, shard_width, label_smoothing, ignore_index, process_group, weight=None, z_loss=0.0
):
    """This rank's packet -> (loss, row_stats) of all ranks: one all-gather, then the same merge
    everywhere."""
    gathered = funcol.wait_tensor(_all_gather(stats, 0, process_group))
    merge = library.vocab_parallel_ce_merge
    return merge(gathered, target, shard_width, label_smoothing, ignore_index, weight, z_loss)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row loss of vocabulary-sharded logits and the merged row statistics (not differentiable);
    the backward is local (no collective)."""

    @staticmethod
    def forward(
        ctx, logits, target, label_smoothing, ignore_index, process_group, weight=None, z_loss=0.0,
        softcap=0.0,
    ):  # fmt: skip
        if weight is not None and weight.requires_grad:
            raise ValueError("weight (class weights) must not require grad: lowp_ops gives it no gradient")
        loss, row_stats = vocab_parallel_cross_entropy_stats(
            logits, target, label_smoothing, ignore_index, process_group, weight, z_loss, softcap
        )
        ctx.config = (label_smoothing, ignore_index, *vocab_shard(logits.shape[1], process_group))
        ctx.features = (z_loss, softcap)
        ctx.save_for_backward(logits, target, row_stats, weight)
        ctx.mark_non_differentiable(row_stats)
        return loss, row_stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_row_stats):
        refuse_double_backward("vocab_parallel_cross_entropy")
        logits, target, row_stats, weight = ctx.saved_tensors
        dlogits = library.cross_entropy_bwd(
            logits, target, row_stats, grad_loss.float(), *ctx.config, weight, *ctx.features
        )
        return dlogits, *(None,) * 7


def vocab_parallel_cross_entropy_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    process_group: dist.ProcessGroup,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    *,
    with_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable per-row loss (N,) fp32 of this rank's ``(N, V)`` shard (see the module docstring);
    ``weight``: optional class weights of the whole vocabulary (``W V``,), the same on every rank (the
    mean then divides by the target weights: pass them to ``lowp::cross_entropy_reduce`` too);
    ``z_loss``, ``softcap``: the loss features (0.0 = off). ``with_stats``: also return the merged
    ``(2, N)`` row statistics (not differentiable)."""
    loss, row_stats = VocabParallelCrossEntropy.apply(
        logits, target, label_smoothing, ignore_index, process_group, weight, z_loss, softcap
    )
    return (loss, row_stats) if with_stats else loss


# ------------------------------------------------- vocabulary-parallel LM head + cross entropy
# lowp_ops.linear_cross_entropy(..., process_group=pg): rank r holds the weight rows of the vocabulary ids
# [r V, (r + 1) V) (the layout above, checked the same way: unequal widths give NaN everywhere).


def linear_vocab_parallel_cross_entropy_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    chunk_size: int,
    process_group: dist.ProcessGroup,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    ce_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (per-row loss (N,) fp32, global row_stats (2, N) fp32) of ``hidden @ weight^T``, identical on
    every rank; not differentiable. Only one ``chunk_size`` chunk of this rank's logits exists at a time.
    ``z_loss``, ``softcap``: the loss features (0.0 = off); ``ce_weight``: optional class weights of the
    whole vocabulary (``W V``,), the same on every rank (each shard sends its class-weighted sum)."""
    check_process_group(process_group)
    shard_width = weight.shape[0]
    vocab_start, _ = vocab_shard(shard_width, process_group)
    stats = library.linear_vocab_parallel_ce_stats(
        hidden, weight, target, vocab_start, label_smoothing > 0, chunk_size, softcap, ce_weight
    )
    return _gather_and_merge(
        stats, target, shard_width, label_smoothing, ignore_index, process_group, ce_weight, z_loss
    )


class LinearVocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row loss of ``hidden @ weight_shard^T``; one all-gather in the forward, and in the backward
    one all-reduce of the hidden gradient (unless the caller reduces it itself)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        label_smoothing,
        ignore_index,
        grad_format,
        other_operand,
        chunk_size,
        process_group,
        reduce_hidden_grad,
        z_loss=0.0,
        softcap=0.0,
        ce_weight=None,
    ):
        loss, row_stats = linear_vocab_parallel_cross_entropy_stats(
            hidden, weight, target, label_smoothing, ignore_index, chunk_size, process_group, z_loss, softcap,
            ce_weight,
        )  # fmt: skip
        ctx.config = (label_smoothing, ignore_index, grad_format, other_operand, chunk_size)
        ctx.shard = vocab_shard(weight.shape[0], process_group)
        ctx.features = (z_loss, softcap)
        ctx.process_group, ctx.reduce_hidden_grad = process_group, reduce_hidden_grad
        ctx.save_for_backward(hidden, weight, target, row_stats, ce_weight)
        ctx.mark_non_differentiable(row_stats)
        return loss, row_stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_row_stats):
        refuse_double_backward("linear_vocab_parallel_cross_entropy")
        hidden, weight, target, row_stats, ce_weight = ctx.saved_tensors
        need_dhidden, need_dweight = ctx.needs_input_grad[:2]
        dhidden, dweight = library.linear_vocab_parallel_ce_bwd(
            hidden,
            weight,
            target,
            row_stats,
            grad_loss.float(),
            *ctx.config,
            need_dhidden,
            need_dweight,
            *ctx.shard,
            *ctx.features,
            ce_weight,
        )
        if need_dhidden and ctx.reduce_hidden_grad:
            # Summed in fp32 (one rounding of the W shard partials), identical on every rank.
            summed = funcol.all_reduce(dhidden.float(), "sum", ctx.process_group)
            dhidden = funcol.wait_tensor(summed).to(hidden.dtype)
        return (dhidden if need_dhidden else None, dweight if need_dweight else None, *[None] * 11)


def linear_vocab_parallel_cross_entropy_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    grad_format: str,
    other_operand: str,
    chunk_size: int,
    process_group: dist.ProcessGroup,
    reduce_hidden_grad: bool,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    ce_weight: torch.Tensor | None = None,
    *,
    with_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable per-row loss (N,) fp32, identical on every rank, of ``hidden (N, H)`` (replicated)
    and this rank's ``weight (V, H)`` rows; ``grad_format`` as the op's (``"none"``, ``"mxfp8_e4m3"``, ...).

    Gradients: ``weight``'s is this rank's rows of the single-rank gradient (given the same row
    statistics: byte for byte); ``hidden``'s is summed over the ranks (all-reduce in fp32) unless
    ``reduce_hidden_grad`` is False, when it is this shard's partial sum for a caller that all-reduces
    input gradients itself. ``z_loss``, ``softcap``: the loss features (0.0 = off); ``ce_weight``:
    optional class weights of the whole vocabulary (``W V``,), the same on every rank (each row's loss is
    class-weighted; the mean's denominator is the caller's, ``lowp::cross_entropy_reduce`` with them);
    ``with_stats``: also return the merged ``(2, N)`` row statistics (not differentiable)."""
    loss, row_stats = LinearVocabParallelCrossEntropy.apply(
        hidden,
        weight,
        target,
        label_smoothing,
        ignore_index,
        grad_format,
        other_operand,
        chunk_size,
        process_group,
        reduce_hidden_grad,
        z_loss,
        softcap,
        ce_weight,
    )
    return (loss, row_stats) if with_stats else loss
