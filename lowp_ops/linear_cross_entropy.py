"""The LM head and its loss in one autograd node: ``linear_cross_entropy``."""

from __future__ import annotations

import math

import torch

from . import library
from .functional import check_return_flags, loss_extras, reduce_row_losses
from .meta.checks import check_bool, check_int, require
from .meta.cross_entropy import check_reduction, public_label_smoothing, public_softcap, public_z_loss
from .meta.linear_cross_entropy import check_ce_weight, check_hidden_weight_target
from .meta.mxfp8_gemm import check_other_operand
from .reference.cross_entropy import reduce_denominator

__all__ = ["linear_cross_entropy"]

PUBLIC_GRAD_FORMATS = (None, "mxfp8_e4m3", "mxfp8_e5m2")


def _check_process_group(process_group, reduce_hidden_grad) -> None:
    check_bool(reduce_hidden_grad, "reduce_hidden_grad")
    if process_group is not None:
        from .distributed import check_process_group

        check_process_group(process_group)


def _row_weight(
    target_rows: torch.Tensor, reduction: str, ignore_index: int, ce_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 (N,) weights of the per-row losses in the reduced loss: 1 (sum) or 1 / n_valid (mean), on
    the device (an expanded 0-d tensor; inf when every row is ignored, so the mean is NaN like PyTorch).
    With class weights ``ce_weight`` (V,) the mean's ``n_valid`` is the non-ignored rows' target weights
    ``Σ w_y`` (torch's definition; the per-row losses already carry their ``w_y``)."""
    if reduction == "sum":
        weight = torch.ones((), dtype=torch.float32, device=target_rows.device)
    else:
        weight = torch.reciprocal(reduce_denominator(target_rows, ignore_index, ce_weight))
    return weight.expand(target_rows.shape)


def _public_ce_weight(ce_weight, weight: torch.Tensor, process_group) -> torch.Tensor | None:
    """Checked class weights, float64 ones as fp32 (the kernels compute in fp32); ``(V,)``, or with a
    process group ``(W·V,)`` of the whole vocabulary."""
    n_classes = weight.shape[0]
    if process_group is not None:
        from .distributed import vocab_shard

        n_classes = vocab_shard(n_classes, process_group)[1]
    if isinstance(ce_weight, torch.Tensor) and ce_weight.dtype == torch.float64:
        ce_weight = ce_weight.float()
    check_ce_weight(ce_weight, n_classes, weight)
    return ce_weight


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    grad_format: str | None = None,
    label_smoothing: float = 0,
    ignore_index: int = -100,
    reduction: str = "mean",
    process_group=None,
    chunk_size: int | None = None,
    other_operand: str = "bf16",
    reduce_hidden_grad: bool = True,
    z_loss: float = 0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_lse: bool = False,
    ce_weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``F.cross_entropy(F.linear(hidden, weight), target)`` without the ``(N, V)`` logits in memory.

    Args:
        hidden: ``(..., H)`` bf16/fp16/fp32; weight: ``(V, H)`` of the same dtype; target: ``(...)``
            int64/int32 (``ignore_index`` rows give loss 0 and gradient 0).
        grad_format: ``None``: the logits gradient stays in the inputs' dtype and feeds cuBLAS GEMMs.
            ``"mxfp8_e4m3"`` / ``"mxfp8_e5m2"``: the cross-entropy backward writes it directly as MXFP8
            (row- and column-wise copies, byte for byte ``cross_entropy_with_mxfp8_grad``'s), and the
            dgrad GEMM reads the row-wise copy (blocks along V), the wgrad GEMM the column-wise one
            (blocks along tokens): docs/cross_entropy.md#lm-head-schedules.
        other_operand: for the MXFP8 GEMMs: ``"bf16"`` keeps weight / hidden as given; ``"mxfp8"``
            quantizes them to E4M3 with blocks along K as TransformerEngine's MXFP8 recipe does (an
            MXFP8 ``grad_format`` only: with ``grad_format=None`` it raises).
        chunk_size: tokens per chunk (None: the largest multiple of 256 with at most 2^28 logits).
            Peak extra memory beyond the gradients, on CUDA: ``chunk·V·b`` (bf16 gradient, written over
            its logits chunk) or ``chunk·V·(b + 2.06)`` bytes (MXFP8; on sm90 plus ``2·chunk·V`` unless
            the inputs are bf16, whose dead logits chunk takes the dequantized copy), b the inputs'
            element size; see :mod:`lowp_ops.meta.linear_cross_entropy`. With None, a reduced
            loss, a bf16 gradient that ``weight`` needs, at most H tokens and at least 2^25 logits, the
            logits are not chunked at all: they live in ``weight``'s gradient until the wgrad GEMMs
            overwrite them, and the peak is ``3072·N·b`` bytes beyond the gradients (on CUDA and under
            the Triton interpreter); fewer logits take one chunk (at most 64 MiB of bf16).
        label_smoothing, ignore_index, reduction: as ``F.cross_entropy``.
        process_group: vocabulary-parallel LM head (:mod:`lowp_ops.distributed`). Each rank passes the
            same ``hidden`` and global ``target`` and the weight rows of its vocabulary shard: equal
            widths, in rank order (unequal widths give a NaN loss on every rank, checked on device).
            Every rank returns the same loss: per chunk the rank's logits give per-row statistics, one
            all-gather exchanges them. The forward keeps no gradient (the global log-sum-exp is known
            only after the exchange): the backward recomputes each chunk's logits (four GEMMs per chunk).
            ``weight``'s gradient is this rank's rows of the single-rank one.
        reduce_hidden_grad: with ``process_group``, ``hidden``'s gradient is summed over the ranks by an
            fp32 all-reduce in the backward (default). False: each rank gets its shard's partial sum, for
            tensor-parallel regions that all-reduce the input gradient themselves (Megatron's
            column-parallel LM head).
        z_loss, softcap, return_z_loss, return_lse: the loss features of
            :func:`lowp_ops.cross_entropy` (z-loss ``z · lse²`` per non-ignored row, final-logit soft-cap
            ``c · tanh(x / c)`` of the logits, the z-loss and the per-row lse returned apart, detached),
            applied to every chunk's logits inside the cross-entropy kernels; the in-gradient schedule
            (the logits inside ``weight``'s gradient) does not run with ``z_loss`` or ``softcap``: the chunk
            schedule serves those calls.
        ce_weight: class weights, ``F.cross_entropy``'s ``weight=`` (named apart from the LM-head matrix
            ``weight``, as Liger does): a 1-D float ``(V,)`` tensor on ``hidden``'s device (with
            ``process_group``: the whole vocabulary's ``(W·V,)``, the same on every rank), no gradient;
            float32/bf16/fp16 are read as they are and float64 is cast to fp32. Torch's semantics: a row's
            loss is ``w_y`` times its NLL, label smoothing's term is ``(ls / V) Σ_c w_c (-log p_c)``, the
            mean divides by the non-ignored rows' ``Σ w_y`` (NaN when that is 0); the z-loss is not
            weighted. Applied inside the cross-entropy kernels of every chunk (no extra pass over the
            logits); the in-gradient schedule takes no class weights (the chunk schedule serves them).

    Returns the fp32 loss (0-d, or ``target.shape`` for ``reduction="none"``); gradients come in the
    inputs' dtypes. Logits are ``dtype(hidden @ weight^T)`` with fp32 accumulation, per chunk.

    When a gradient is needed and the loss is reduced (``mean``/``sum``), the forward also computes the
    gradients (three GEMMs per chunk, like Liger's fused linear cross entropy; or the in-gradient schedule
    above) and the backward only scales them by the upstream gradient, in fp32.
    With ``reduction="none"``, and for fp16 inputs whatever the reduction, the forward keeps ``hidden``,
    ``weight``, ``target`` and the per-row log-sum-exp, and the backward recomputes each chunk's logits
    (four GEMMs per chunk) with the upstream gradient folded into the logits' gradient before the GEMMs,
    as in torch's graph: fp16 gradients formed for an upstream gradient of 1 would overflow (a ``sum``
    loss's weight gradient past 65504) or round to subnormals (a ``mean`` loss's ``p / N``) whatever loss
    scale (``torch.amp.GradScaler``) multiplies them afterwards. No host synchronization either way.
    With ``return_z_loss`` / ``return_lse``: ``(loss, z_loss, lse)`` holding only the requested extras.
    """
    _check_process_group(process_group, reduce_hidden_grad)
    check_hidden_weight_target(hidden, weight, target)
    check_int(ignore_index, "ignore_index")
    smoothing = public_label_smoothing(label_smoothing)
    check_reduction(reduction)
    require(
        grad_format in PUBLIC_GRAD_FORMATS,
        lambda: f"grad_format must be one of {list(PUBLIC_GRAD_FORMATS)}, got {grad_format!r}",
    )
    check_other_operand(other_operand)
    require(
        grad_format is not None or other_operand == "bf16",
        lambda: (
            f"other_operand={other_operand!r} quantizes the operands of the MXFP8 GEMMs, which only a "
            "grad_format of 'mxfp8_e4m3' or 'mxfp8_e5m2' runs; with grad_format=None pass "
            "other_operand='bf16'"
        ),
    )
    if chunk_size is not None:
        check_int(chunk_size, "chunk_size")
        require(chunk_size > 0, lambda: f"chunk_size must be positive (None: automatic), got {chunk_size}")
    z_loss, softcap = public_z_loss(z_loss), public_softcap(softcap)
    check_return_flags(return_z_loss, return_lse)
    ce_weight = _public_ce_weight(ce_weight, weight, process_group)
    loss, stats = _loss_and_stats(
        hidden, weight, target, grad_format, smoothing, int(ignore_index), reduction,
        process_group, chunk_size, other_operand, reduce_hidden_grad, z_loss, softcap, ce_weight,
    )  # fmt: skip
    if not (return_z_loss or return_lse):
        return loss
    extras = loss_extras(stats, target, reduction, ignore_index, ce_weight, z_loss, return_z_loss, return_lse)
    return (loss, *extras)


def _loss_and_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    grad_format: str | None,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    process_group,
    chunk_size: int | None,
    other_operand: str,
    reduce_hidden_grad: bool,
    z_loss: float,
    softcap: float,
    ce_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the reduced or per-row loss, the ``(2, N)`` row statistics) of checked arguments."""
    chunk = 0 if chunk_size is None else chunk_size

    hidden_rows = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # -1 fails for H = 0
    target_rows = target.reshape(-1)
    op_format = grad_format or "none"
    if process_group is not None:
        from .distributed import linear_vocab_parallel_cross_entropy_rows

        loss_rows, stats = linear_vocab_parallel_cross_entropy_rows(
            hidden_rows,
            weight,
            target_rows,
            label_smoothing,
            ignore_index,
            op_format,
            other_operand,
            chunk,
            process_group,
            reduce_hidden_grad,
            z_loss,
            softcap,
            ce_weight,
            with_stats=True,
        )
        return reduce_row_losses(loss_rows, target, reduction, ignore_index, ce_weight), stats
    need_dhidden, need_dweight = hidden.requires_grad, weight.requires_grad
    # No rows: the mean is NaN as in torch, which the reduction kernel gives and the fused schedule does not.
    # fp16: gradients formed for an upstream gradient of 1 overflow (sums past 65504) or lose their low
    # bits (subnormals) where a loss scale folded in first, as torch's graph does, keeps them.
    fused = reduction != "none" and target_rows.shape[0] > 0 and hidden.dtype != torch.float16
    if torch.is_grad_enabled() and (need_dhidden or need_dweight) and fused:
        loss, _, _, stats = library.linear_cross_entropy_fwd_bwd(
            hidden_rows,
            weight,
            target_rows,
            _row_weight(target_rows, reduction, ignore_index, ce_weight),
            label_smoothing,
            ignore_index,
            op_format,
            other_operand,
            chunk,
            need_dhidden,
            need_dweight,
            z_loss,
            softcap,
            ce_weight,
        )
        return loss, stats
    loss_rows, stats = library.linear_cross_entropy_fwd(
        hidden_rows,
        weight,
        target_rows,
        label_smoothing,
        ignore_index,
        op_format,
        other_operand,
        chunk,
        z_loss,
        softcap,
        ce_weight,
    )
    return reduce_row_losses(loss_rows, target, reduction, ignore_index, ce_weight), stats
