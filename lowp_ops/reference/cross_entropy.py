"""Cross entropy on ``(N, V)`` logits with masked-safe row statistics, in fp32.

The forward keeps per row ``row_stats = (shift, log_sum)`` (:mod:`lowp_ops.meta.cross_entropy`): the
masked-safe row maximum and ``log Σ exp(x - shift)``, never their rounded sum ``lse``, so every
difference below is formed between values of similar magnitude and the digits survive at any logit
magnitude (as in PyTorch's fp32). With ``ls`` the label smoothing and ``eps = fp32(ls / V)``, per
non-ignored row:

- loss ``= (1 - ls) * ((shift - x_y) + log_sum) + ls * (log_sum - Σ (x - shift) / V)`` (the smoothing
  term never sums raw logits, which overflows at 3e38); ignored rows: 0; a target outside ``[0, V)`` that
  is not ``ignore_index``: NaN (documented; no host sync checks it);
- gradient ``g = (exp((x - shift) - log_sum) - eps - (1 - ls) [i == y]) * grad_row`` rounded to the
  logits' dtype; ignored rows: exactly 0 (also when the row is all -inf, where PyTorch gives NaN).

The backward also serves one rank of a vocabulary-parallel loss (:mod:`lowp_ops.distributed`): its logits
are the ids ``[vocab_start, vocab_start + V)`` of ``vocab_total``, ``row_stats`` the global ones, ``eps =
fp32(ls / vocab_total)``, a target in another rank's shard gets no one-hot and a target outside
``[0, vocab_total)`` gives NaN. With the defaults (0, 0 = V) it is the single-rank backward.

An all -inf row gives NaN loss and gradient like PyTorch (``log_sum = -inf``), and so does a row holding
``+inf`` (``log_sum`` NaN); ``-inf`` at the target gives loss +inf.

Class weights ``w`` (``F.cross_entropy``'s ``weight=``, aten's ``cross_entropy_loss_label_smoothing``):
with ``W = Σ_c w_c`` and ``s_w = fp32(eps * W)``, per non-ignored row

- loss ``= (1 - ls) w_y ((shift - x_y) + log_sum) + s_w log_sum - eps Σ_c w_c (x_c - shift)``, i.e.
  ``-(1 - ls) w_y log p_y - (ls / V) Σ_c w_c log p_c`` (``w_c = 0`` at a -inf logit gives NaN, as
  PyTorch's ``0 * -inf``);
- gradient ``g = (p_i α - eps w_i - (1 - ls) w_y [i == y]) * grad_row`` with ``α = (1 - ls) w_y + s_w``;
- the mean divides by ``Σ w_y`` over the non-ignored rows (:func:`cross_entropy_reduce`).

Loss features (0.0 = off; docs/cross_entropy.md#z-loss-and-soft-capping):

- ``softcap = c > 0``: every logit is first replaced by ``cap(x) = c tanh(x · fp32(1/c))`` (Gemma 2/3's
  final-logit soft-capping), except that ``-inf`` stays ``-inf`` (a masked class stays masked; ``+inf``
  becomes ``c``, NaN stays NaN). The row statistics, the target logit and ``p`` are those of the capped
  logits, and the gradient is the capped logits' gradient times ``cap'(x) = 1 - tanh²`` (0 at ``-inf``).
- ``z_loss = z > 0``: each non-ignored row's loss gains ``z · lse²`` with ``lse = shift + log_sum`` (the
  log-sum-exp of the, possibly capped, logits; PaLM's z-loss), not multiplied by a class weight; its
  gradient ``2 z lse p_i`` joins the softmax term: ``p_i`` becomes ``p_i (1 + 2 z lse)`` (with class
  weights ``α`` becomes ``α + 2 z lse``).
"""

from __future__ import annotations

import torch

from ..formats import round_to_fp32
from ..meta.cross_entropy import (
    LOG_SUM,
    SHIFT,
    cross_entropy_bwd_output,
    cross_entropy_fwd_bwd_outputs,
    cross_entropy_fwd_outputs,
    cross_entropy_mxfp8_grad_outputs,
    cross_entropy_reduce_outputs,
    cross_entropy_scale_grad_output,
)
from ..meta.mxfp8 import check_quantize_args
from .mxfp8 import mxfp8_quantize
from .softmax import finish_log_sum, row_stats


def softcap_logits(x: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cap(x), tanh(x · fp32(1/c)))`` of fp32 ``x`` (module docstring): ``-inf`` stays ``-inf``;
    ``1 - tanh²`` is the cap's derivative."""
    t = torch.tanh(x * round_to_fp32(1.0 / softcap))
    return torch.where(x == float("-inf"), float("-inf"), softcap * t), t


def row_lse(stats: torch.Tensor) -> torch.Tensor:
    """fp32 ``(N,)`` log-sum-exp ``shift + log_sum`` of ``(2, N)`` row statistics (rounded once)."""
    return stats[SHIFT] + stats[LOG_SUM]


def z_loss_rows(shift: torch.Tensor, log_sum: torch.Tensor, z_loss: float) -> torch.Tensor:
    """fp32 ``z · lse · lse`` per row (``(z lse) lse``: the kernels' order), ``lse = shift + log_sum``."""
    lse = shift + log_sum
    return z_loss * lse * lse


def _target_logit(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """x[r, target[r]] in fp32; NaN where the target is out of range."""
    n_cols = x.shape[1]
    in_range = (target >= 0) & (target < n_cols)
    picked = x.gather(1, target.clamp(0, max(n_cols - 1, 0)).long().unsqueeze(1)).squeeze(1).float()
    return torch.where(in_range, picked, float("nan"))


def row_loss(
    shift: torch.Tensor,
    log_sum: torch.Tensor,
    target_logit: torch.Tensor,
    shifted_sum: torch.Tensor,
    n_vocab: int,
    label_smoothing: float,
) -> torch.Tensor:
    """fp32 loss of rows from their statistics, the target logit (NaN: out of range) and, for label
    smoothing, ``Σ (x - shift)`` over the ``n_vocab`` classes (ignored rows are the caller's)."""
    loss = (shift - target_logit) + log_sum
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum - shifted_sum / n_vocab)
    return loss


def target_class_weight(weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """fp32 ``weight[target]`` per row; NaN where the target is outside ``[0, C)`` (an ignored row's
    value is never used)."""
    n_classes = weight.shape[0]
    in_range = (target >= 0) & (target < n_classes)
    picked = weight.float()[target.clamp(0, max(n_classes - 1, 0)).long()]
    return torch.where(in_range, picked, float("nan"))


def smoothing_weight_total(weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``s_w = fp32(eps * Σ_c w_c)`` (0-d fp32), the weighted smoothing term's share of every class."""
    return weight.float().sum() * eps


def weighted_row_loss(
    shift: torch.Tensor,
    log_sum: torch.Tensor,
    target_logit: torch.Tensor,
    target_weight: torch.Tensor,
    weighted_shifted_sum: torch.Tensor | None,
    smooth_total: torch.Tensor | None,
    eps: float,
    label_smoothing: float,
) -> torch.Tensor:
    """fp32 class-weighted loss of rows (module docstring); ``weighted_shifted_sum`` is ``Σ_c w_c (x_c -
    shift)`` and ``smooth_total`` ``s_w`` (both only for label smoothing)."""
    loss = (1.0 - label_smoothing) * target_weight * ((shift - target_logit) + log_sum)
    if label_smoothing > 0:
        loss = loss + (smooth_total * log_sum - eps * weighted_shifted_sum)
    return loss


def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (per-row loss (N,) fp32, row_stats (2, N) fp32); ``weight``: optional class weights (V,);
    ``z_loss``, ``softcap``: the loss features of the module docstring (0.0 = off). The row statistics
    are those of the capped logits."""
    loss, stats = cross_entropy_fwd_outputs(
        logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    x = logits.float()
    if softcap > 0:
        x = softcap_logits(x, softcap)[0]
    shift, log_sum, shifted = row_stats(x)
    log_sum = finish_log_sum(log_sum)
    target_logit = _target_logit(x, target)
    if weight is None:
        shifted_sum = shifted.sum(dim=1) if label_smoothing > 0 else None
        loss_rows = row_loss(shift, log_sum, target_logit, shifted_sum, x.shape[1], label_smoothing)
    else:
        eps = round_to_fp32(label_smoothing / x.shape[1])
        smoothing = label_smoothing > 0
        loss_rows = weighted_row_loss(
            shift,
            log_sum,
            target_logit,
            target_class_weight(weight, target),
            (shifted * weight.float()).sum(dim=1) if smoothing else None,
            smoothing_weight_total(weight, eps) if smoothing else None,
            eps,
            label_smoothing,
        )
    if z_loss > 0:
        loss_rows = loss_rows + z_loss_rows(shift, log_sum, z_loss)
    loss.copy_(torch.where(target != ignore_index, loss_rows, 0.0))
    stats[SHIFT] = shift
    stats[LOG_SUM] = log_sum
    return loss, stats


def probabilities(logits: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """fp32 ``exp((x - shift) - log_sum)`` of ``(N, V)`` logits given their ``(2, N)`` row statistics."""
    shift, log_sum = stats[SHIFT].unsqueeze(1), stats[LOG_SUM].unsqueeze(1)
    return torch.exp((logits.float() - shift) - log_sum)


def cross_entropy_grad_fp32(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    vocab_start: int = 0,
    vocab_total: int = 0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The fp32 gradient before rounding to the logits' dtype."""
    x = logits.float()
    if softcap > 0:
        x, tanh = softcap_logits(x, softcap)
    # d(z lse^2)/dx_i = 2 z lse p_i: a per-row factor of the softmax term.
    z_term = (2.0 * z_loss) * row_lse(stats).unsqueeze(1) if z_loss > 0 else None
    n_cols = x.shape[1]
    vocab_total = vocab_total or n_cols
    eps = round_to_fp32(label_smoothing / vocab_total)
    # A target in another rank's shard matches no column of this one.
    is_target = torch.arange(n_cols, device=x.device).unsqueeze(0) == (target - vocab_start).unsqueeze(1)
    if weight is None:
        p = probabilities(x, stats)
        grad = (p if z_term is None else p * (1.0 + z_term)) - eps
        grad = torch.where(is_target, grad - (1.0 - label_smoothing), grad)
    else:
        target_weight = target_class_weight(weight, target).unsqueeze(1)
        alpha = (1.0 - label_smoothing) * target_weight + smoothing_weight_total(weight, eps)
        if z_term is not None:
            alpha = alpha + z_term
        column_eps = eps * weight.float()[vocab_start : vocab_start + n_cols]
        grad = probabilities(x, stats) * alpha - column_eps
        grad = torch.where(is_target, grad - (1.0 - label_smoothing) * target_weight, grad)
    grad = grad * grad_rows.unsqueeze(1)
    if softcap > 0:
        grad = grad * (1.0 - tanh * tanh)
    in_range = ((target >= 0) & (target < vocab_total)).unsqueeze(1)
    grad = torch.where(in_range, grad, float("nan"))
    return torch.where((target != ignore_index).unsqueeze(1), grad, 0.0)


def cross_entropy_bwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    vocab_start: int = 0,
    vocab_total: int = 0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """-> dlogits (N, V) in the logits' dtype; ``stats`` (2, N) fp32 the forward's row statistics,
    ``grad_rows`` (N,) fp32 dloss per row, ``weight`` optional class weights (vocab_total,); ``z_loss``,
    ``softcap`` the forward's."""
    args = (
        logits, target, stats, grad_rows, label_smoothing, ignore_index, vocab_start, vocab_total, weight,
        z_loss, softcap,
    )  # fmt: skip
    dlogits = cross_entropy_bwd_output(*args)
    dlogits.copy_(cross_entropy_grad_fp32(*args))
    return dlogits


def cross_entropy_bwd_mxfp8(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    vocab_start: int = 0,
    vocab_total: int = 0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> the MXFP8 payload of :func:`cross_entropy_bwd` (by definition: quantize its output)."""
    # Reject bad MXFP8 arguments before computing the gradient (the bf16 backward checks the rest).
    check_quantize_args(logits, fp8_dtype, rowwise, columnwise, scale_layout)
    dlogits = cross_entropy_bwd(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, vocab_start, vocab_total, weight,
        z_loss, softcap,
    )  # fmt: skip
    return mxfp8_quantize(dlogits, fp8_dtype, rowwise, columnwise, scale_layout)


def cross_entropy_mxfp8_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor | None,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """Reference of ``lowp::cross_entropy_mxfp8_grad``: :func:`cross_entropy_fwd`, for ``mean`` / ``sum``
    :func:`cross_entropy_reduce`, then :func:`cross_entropy_bwd_mxfp8` for the rows' upstream gradient
    (:func:`loss_grad_rows`). Returns ``(loss, row_stats, row_data, row_scale, col_data, col_scale)``."""
    cross_entropy_mxfp8_grad_outputs(
        logits, target, grad_loss, label_smoothing, ignore_index, reduction, fp8_dtype, rowwise, columnwise,
        scale_layout, weight, z_loss, softcap,
    )  # fmt: skip
    loss, stats = cross_entropy_fwd(logits, target, label_smoothing, ignore_index, weight, z_loss, softcap)
    grad_scale = None
    if reduction != "none":
        loss, grad_scale = cross_entropy_reduce(loss, target, ignore_index, reduction == "mean", weight)
    grad_rows = loss_grad_rows(grad_loss, grad_scale, logits.shape[0], loss)
    payload = cross_entropy_bwd_mxfp8(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, fp8_dtype, rowwise, columnwise,
        scale_layout, 0, 0, weight, z_loss, softcap,
    )  # fmt: skip
    return loss, stats, *payload


def loss_grad_rows(
    grad_loss: torch.Tensor | None, grad_scale: torch.Tensor | None, rows: int, like: torch.Tensor
) -> torch.Tensor:
    """Each row's fp32 upstream gradient (N,) of ``grad_loss · loss``: ``grad_loss * grad_scale`` (the
    reduction's, 0-d) broadcast to the rows (stride 0), or without a reduction ``grad_loss`` (N,) itself;
    ones on ``like``'s device where ``grad_loss`` is None. The one formula of every path that turns a
    loss's gradient into row factors (the MXFP8 loss, the autograd backward, the vocabulary-parallel
    call)."""
    if grad_scale is None and grad_loss is None:
        return torch.ones((rows,), dtype=torch.float32, device=like.device)
    if grad_scale is None:
        return grad_loss.float()
    return (grad_scale if grad_loss is None else grad_loss.float() * grad_scale).expand(rows)


def scaled_grad(dlogits: torch.Tensor, grad_rows: torch.Tensor) -> torch.Tensor:
    """``round(fp32(dlogits[i]) * grad_rows[i])`` in dlogits' dtype, a new tensor: the bytes of
    ``lowp::cross_entropy_scale_grad_`` (a factor of 1 leaves a row's bytes as they are)."""
    return (dlogits.float() * grad_rows[:, None]).to(dlogits.dtype)


def reduce_denominator(target: torch.Tensor, ignore_index: int, weight: torch.Tensor | None) -> torch.Tensor:
    """fp32 0-d: the number of non-ignored rows, or with class weights the sum of their targets'
    weights (NaN if one is outside ``[0, C)``), as ``F.cross_entropy``'s mean."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum().float()
    return torch.where(valid, target_class_weight(weight, target), 0.0).sum()


def cross_entropy_reduce(
    loss_rows: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    mean: bool,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::cross_entropy_reduce``: ``(loss, grad_scale)`` of per-row fp32 losses (N,).

    ``loss`` is their fp32 sum, divided by the number of rows whose target is not ``ignore_index``
    (with class weights ``weight`` (C,): the sum of those rows' target weights) when ``mean`` (NaN when
    that is 0: every row ignored or of weight 0, as PyTorch, whose weighted negative log-likelihood is
    then 0 / 0); ``grad_scale`` is ``dloss / dloss_row``: ``1 / count`` for the mean (inf when the count is
    0), 1 for the sum."""
    loss, grad_scale = cross_entropy_reduce_outputs(loss_rows, target, ignore_index, mean, weight)
    total = loss_rows.sum()
    if mean:
        count = reduce_denominator(target, ignore_index, weight)
        loss.copy_(torch.where(count == 0, float("nan"), total / count))
        grad_scale.copy_(1.0 / count)
    else:
        loss.copy_(total)
        grad_scale.fill_(1.0)
    return loss, grad_scale


def cross_entropy_reduced(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    mean: bool,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::cross_entropy_reduced``: ``(loss, grad_scale, row_stats)``,
    :func:`cross_entropy_fwd` then :func:`cross_entropy_reduce` (their outputs but the per-row losses)."""
    loss_rows, stats = cross_entropy_fwd(
        logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    return (*cross_entropy_reduce(loss_rows, target, ignore_index, mean, weight), stats)


def cross_entropy_fwd_bwd_(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::cross_entropy_fwd_bwd_``: :func:`cross_entropy_fwd`, then for ``mean`` / ``sum``
    :func:`cross_entropy_reduce`, then the logits replaced by :func:`cross_entropy_bwd` for ``grad_loss =
    1`` (row factors: the reduction's ``grad_scale``, or 1). Returns ``(loss, row_stats)``."""
    cross_entropy_fwd_bwd_outputs(
        logits, target, label_smoothing, ignore_index, reduction, weight, z_loss, softcap
    )
    loss, stats = cross_entropy_fwd(logits, target, label_smoothing, ignore_index, weight, z_loss, softcap)
    grad_rows = torch.ones_like(loss)
    if reduction != "none":
        loss, grad_scale = cross_entropy_reduce(loss, target, ignore_index, reduction == "mean", weight)
        grad_rows = grad_scale.expand(logits.shape[0])
    logits.copy_(
        cross_entropy_bwd(
            logits, target, stats, grad_rows, label_smoothing, ignore_index, 0, 0, weight, z_loss, softcap
        )
    )
    return loss, stats


def cross_entropy_scale_grad_(dlogits: torch.Tensor, grad_rows: torch.Tensor) -> None:
    """Reference of ``lowp::cross_entropy_scale_grad_``: ``dlogits[i] = round(fp32(dlogits[i]) *
    grad_rows[i])`` in place (a factor of 1 leaves a row's bytes as they are)."""
    cross_entropy_scale_grad_output(dlogits, grad_rows)
    dlogits.copy_(scaled_grad(dlogits, grad_rows))
