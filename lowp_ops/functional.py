"""Public loss and softmax functions (thin wrappers over ``torch.ops.lowp``), named like
``torch.nn.functional`` so that users swap one import."""

from __future__ import annotations

import torch

from . import library  # noqa: F401  (registers the ops)
from .formats import FP8_DTYPES, MXFP8Tensor
from .meta.checks import require
from .meta.cross_entropy import check_label_smoothing, check_logits_target, check_reduction
from .meta.mxfp8 import check_fp8_dtype, check_scale_layout
from .meta.softmax import check_masked_rows


def _rows(
    logits: torch.Tensor, target: torch.Tensor, label_smoothing: float, reduction: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and view ``(..., V)`` logits and ``(...)`` targets as ``(N, V)`` and ``(N,)``."""
    check_logits_target(logits, target)
    check_label_smoothing(label_smoothing)
    check_reduction(reduction)
    n_cols = logits.shape[-1]
    require(n_cols >= 1, lambda: "logits must have a non-empty last (vocabulary) dimension")
    return logits.reshape(-1, n_cols), target.reshape(-1)


def reduce_row_losses(
    loss_rows: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int
) -> torch.Tensor:
    """As ``F.cross_entropy``'s reductions of per-row fp32 losses (N,) for ``target`` (any shape, N
    elements): ``"none"`` in ``target``'s shape, the sum, or the mean over non-ignored rows (NaN when
    every row is ignored, as PyTorch); one ``lowp::cross_entropy_reduce``, the count on the device."""
    return _reduce(loss_rows, target, reduction, ignore_index)[0]


def _reduce(
    loss_rows: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(reduced loss, dloss/dloss_row as a 0-d tensor; None for ``"none"``)."""
    if reduction == "none":
        return loss_rows.view(target.shape), None
    return torch.ops.lowp.cross_entropy_reduce(
        loss_rows, target.reshape(-1), int(ignore_index), reduction == "mean"
    )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    process_group=None,
) -> torch.Tensor:
    """``F.cross_entropy`` on ``(..., V)`` logits (bf16/fp16/fp32, any strides) with int64/int32 targets.

    Returns a float32 loss (0-d for ``mean``/``sum``, ``target.shape`` for ``none``). The forward keeps
    only per-row statistics (loss, log-sum-exp); the backward recomputes the gradient from the saved
    logits (never modified) and returns it in the logits' dtype. Masked-safe: ``-inf`` logits anywhere
    (also whole leading blocks) are exact; an all ``-inf`` row gives NaN like PyTorch. Ignored rows give
    loss 0 and gradient 0 (also all ``-inf`` ones). A target outside ``[0, V)`` other than
    ``ignore_index`` gives a NaN loss and NaN gradient row (checked on device, no host sync).

    ``process_group``: vocabulary-parallel loss (:mod:`lowp_ops.distributed`). Each rank passes the logits
    of its equal-width vocabulary shard (rank order) and the same global targets; every rank returns the
    same loss (one all-gather of per-row statistics in the forward, none in the backward), and its
    gradient is its shard of the single-rank gradient.
    """
    logits_rows, target_rows = _rows(logits, target, label_smoothing, reduction)
    if process_group is None:
        loss_rows, _ = torch.ops.lowp.cross_entropy_fwd(
            logits_rows, target_rows, float(label_smoothing), int(ignore_index)
        )
    else:
        from .distributed import vocab_parallel_cross_entropy_rows

        loss_rows = vocab_parallel_cross_entropy_rows(
            logits_rows, target_rows, float(label_smoothing), int(ignore_index), process_group
        )
    return reduce_row_losses(loss_rows, target, reduction, ignore_index)


def _loss_and_grad_rows(
    loss_rows: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduced loss and dloss per row (N,) fp32 for the gradient ``grad_loss`` of that loss (ones
    when None): one reduction kernel, plus one multiply when ``grad_loss`` is given."""
    loss, grad_scale = _reduce(loss_rows, target, reduction, ignore_index)
    if grad_loss is not None:
        require(
            grad_loss.shape == loss.shape,
            lambda: f"grad_loss must have the loss's shape {tuple(loss.shape)}, got {tuple(grad_loss.shape)}",
        )
    if grad_scale is None:
        return loss, (torch.ones_like(loss) if grad_loss is None else grad_loss.float()).reshape(-1)
    scale = grad_scale if grad_loss is None else grad_loss.float() * grad_scale
    return loss, scale.expand(loss_rows.shape)


def cross_entropy_with_mxfp8_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    fp8_dtype: str = "e4m3",
    rowwise: bool = True,
    columnwise: bool = True,
    scale_layout: str = "compact",
    process_group=None,
) -> tuple[torch.Tensor, MXFP8Tensor]:
    """The loss and the gradient of ``grad_loss · loss`` w.r.t. the logits, written directly as MXFP8.

    For frameworks that consume the quantized gradient. ``grad_loss`` defaults to ones (a scalar for
    ``mean``/``sum``, ``target.shape`` for ``none``). The returned loss is detached. Contract, byte for
    byte on one device: the payload equals ``mxfp8_quantize(g)`` where ``g`` is the logits' gradient
    :func:`cross_entropy` 's backward returns for the same inputs (both copies and both scale tensors).
    Any N and V.

    ``process_group``: vocabulary-parallel (see :func:`cross_entropy`); the payload is this rank's shard,
    byte-identical to the shard's columns of the single-rank payload given the same lse when the shard
    width is a multiple of 32 (compact scales: compare the valid regions; each shard pads its own).
    """
    logits_rows, target_rows = _rows(logits, target, label_smoothing, reduction)
    check_fp8_dtype(fp8_dtype)
    check_scale_layout(scale_layout)
    require(rowwise or columnwise, lambda: "at least one of rowwise and columnwise must be True")
    shard = (0, 0)
    with torch.no_grad():
        if process_group is None:
            loss_rows, lse = torch.ops.lowp.cross_entropy_fwd(
                logits_rows, target_rows, float(label_smoothing), int(ignore_index)
            )
        else:
            from .distributed import vocab_parallel_cross_entropy_stats, vocab_shard

            loss_rows, lse = vocab_parallel_cross_entropy_stats(
                logits_rows, target_rows, float(label_smoothing), int(ignore_index), process_group
            )
            shard = vocab_shard(logits_rows.shape[1], process_group)
        loss, grad_rows = _loss_and_grad_rows(loss_rows, target, grad_loss, reduction, ignore_index)
        row_data, row_scale, col_data, col_scale = torch.ops.lowp.cross_entropy_bwd_mxfp8(
            logits_rows,
            target_rows,
            lse,
            grad_rows,
            float(label_smoothing),
            int(ignore_index),
            fp8_dtype,
            rowwise,
            columnwise,
            scale_layout,
            *shard,
        )
    data_dtype = FP8_DTYPES[fp8_dtype]
    return loss, MXFP8Tensor(
        row_data=row_data.view(data_dtype).view(logits.shape) if rowwise else None,
        row_scale=row_scale if rowwise else None,
        col_data=col_data.view(data_dtype).view(logits.shape) if columnwise else None,
        col_scale=col_scale if columnwise else None,
        fp8_dtype=fp8_dtype,
        scale_layout=scale_layout,
        shape=logits.shape,
    )


def _as_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Size]:
    require(x.dim() >= 1, lambda: "x must have at least one dimension, got a 0-d tensor")
    moved = x.movedim(dim, -1)
    return moved.reshape(-1, moved.shape[-1]), moved.shape


def _softmax(x: torch.Tensor, dim: int, log: bool, masked_rows: str) -> torch.Tensor:
    check_masked_rows(masked_rows)
    rows, moved_shape = _as_rows(x, dim)
    return torch.ops.lowp.softmax_fwd(rows, log, masked_rows).view(moved_shape).movedim(-1, dim)


def softmax(x: torch.Tensor, dim: int = -1, *, masked_rows: str = "nan") -> torch.Tensor:
    """Masked-safe softmax along ``dim`` (bf16/fp16/fp32 in, same dtype out, fp32 math), differentiable.

    ``masked_rows="nan"`` (default): a slice that is all ``-inf`` gives NaN, like PyTorch;
    ``"zero"``: it gives zeros and a zero gradient (the usual wish for fully masked attention rows).
    """
    return _softmax(x, dim, False, masked_rows)


def log_softmax(x: torch.Tensor, dim: int = -1, *, masked_rows: str = "nan") -> torch.Tensor:
    """Masked-safe log_softmax along ``dim``; ``masked_rows="zero"`` makes an all ``-inf`` slice give
    ``-inf`` (log of zero probabilities) with a zero gradient instead of NaN."""
    return _softmax(x, dim, True, masked_rows)


def logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Masked-safe ``log Σ exp(x)`` along ``dim`` in fp32 math, returned in x's dtype (``-inf`` for an all
    ``-inf`` slice, like ``torch.logsumexp``); differentiable."""
    rows, moved_shape = _as_rows(x, dim)
    lse = torch.ops.lowp.logsumexp(rows).to(x.dtype).view(moved_shape[:-1])
    return lse.unsqueeze(dim) if keepdim else lse


def _interleave(glu_interleave_size: int | None) -> int:
    require(
        glu_interleave_size in (None, 32),
        lambda: f"glu_interleave_size must be None or 32, got {glu_interleave_size!r}",
    )
    return glu_interleave_size or 0


def swiglu(c: torch.Tensor, probs: torch.Tensor, *, glu_interleave_size: int | None = None) -> torch.Tensor:
    """``silu(gate) * linear * probs`` for MoE experts: ``c`` (tokens, 2F) holds the gate half first (TE's
    order) or alternating 32-wide gate/linear blocks (``glu_interleave_size=32``); ``probs`` (tokens,)
    fp32 or bf16. fp32 math, one rounding to c's dtype. Differentiable in ``c`` and ``probs``; the
    probability gradient is computed in fp32 and never rounded to bf16 for fp32 ``probs``."""
    return torch.ops.lowp.swiglu_fwd(c, probs, _interleave(glu_interleave_size))


def dglu(
    grad: torch.Tensor,
    c: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    *,
    glu_interleave_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused SwiGLU backward of grouped experts: ``(dc, dprobs, amax)`` from ``grad = dL/dh`` (tokens, F).

    ``dc`` (tokens, 2F) in c's dtype and layout; ``dprobs`` (tokens,) fp32; ``amax`` (experts,) fp32, the
    per-expert max of ``|dc|`` before rounding, so ``amax.to(c.dtype)`` equals ``max |dc|`` of the expert
    exactly (0 for an empty expert): the NVFP4 quantization of ``dc`` needs no amax pass of its own.
    ``split_sizes`` (experts,) is an integer tensor on c's device (rows sorted by expert)."""
    return torch.ops.lowp.dglu(grad, c, probs, split_sizes, _interleave(glu_interleave_size))
