"""Masked-safe softmax family over the rows of a 2-D tensor, in fp32 (the semantics and CPU kernels).

Every function works from a row's statistics ``(shift, log_sum)`` (:func:`row_stats`) and never from a
single rounded ``lse``: ``log_softmax = (x - shift) - log_sum`` and ``softmax = exp((x - shift) -
log_sum)`` keep their digits at any logit magnitude (as PyTorch's fp32 does), where ``x - lse`` loses
``|lse| * 2^-24`` to the rounding of ``lse``.

An all ``-inf`` row has ``log_sum = -inf`` and, like PyTorch, NaN (log-)probabilities; with
``masked_rows="zero"`` it gets probabilities 0 (log-probabilities ``-inf``) and a zero gradient. A row
holding ``+inf`` gives NaN (log-)probabilities and ``logsumexp = inf``, as PyTorch.
"""

from __future__ import annotations

import torch

from ..meta.softmax import logsumexp_output, softmax_bwd_output, softmax_fwd_output


def masked_safe_shift(row_max: torch.Tensor) -> torch.Tensor:
    """The shift of a row with maximum ``row_max``: the maximum itself, 0 when it is infinite (an all
    ``-inf`` row then sums ``exp(-inf) = 0`` instead of NaN from ``-inf - -inf``; ``+inf`` as PyTorch's
    ``logsumexp``)."""
    return torch.where(row_max.abs() == float("inf"), 0.0, row_max)


def row_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``(shift, log Σ exp(x - shift), x - shift)`` of the rows of ``x`` (N, V): shapes (N,), (N,)
    and (N, V). ``log_sum`` is ``-inf`` for an all ``-inf`` row and ``log(inf)`` or NaN when the row holds
    ``+inf`` (:func:`finish_log_sum` turns that into NaN for the softmax and the loss)."""
    x = x.float()
    shift = masked_safe_shift(x.amax(dim=1)) if x.shape[1] else x.new_zeros(x.shape[0])
    shifted = x - shift.unsqueeze(1)
    return shift, torch.exp(shifted).sum(dim=1).log(), shifted


def finish_log_sum(log_sum: torch.Tensor) -> torch.Tensor:
    """``log_sum`` made NaN on rows that hold ``+inf`` (the only rows where it is ``+inf``: a finite shift
    bounds the sum by V), whose probabilities and loss PyTorch makes NaN."""
    return torch.where(log_sum == float("inf"), float("nan"), log_sum)


def masked_safe_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``log Σ exp(x)`` per row: ``-inf`` for an all ``-inf`` row, ``inf`` for a row holding ``+inf``
    (NaN if it also holds NaN), like ``torch.logsumexp``."""
    shift, log_sum, _ = row_stats(x)
    return shift + log_sum


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    out = logsumexp_output(x)
    out.copy_(masked_safe_logsumexp(x))
    return out


def softmax_fwd(x: torch.Tensor, log: bool, masked_rows: str) -> torch.Tensor:
    out = softmax_fwd_output(x, log, masked_rows)
    _, log_sum, shifted = row_stats(x)
    log_sum = finish_log_sum(log_sum).unsqueeze(1)
    values = shifted - log_sum if log else torch.exp(shifted - log_sum)
    if masked_rows == "zero":
        values = torch.where(log_sum == float("-inf"), float("-inf") if log else 0.0, values)
    out.copy_(values)
    return out


def softmax_bwd(out: torch.Tensor, grad: torch.Tensor, log: bool) -> torch.Tensor:
    """softmax: ``dx = y (dy - Σ dy y)``; log_softmax: ``dx = dy - exp(y) Σ dy``, and 0 on a row whose
    output is all ``-inf`` (a masked row under ``masked_rows="zero"``); a NaN row stays NaN."""
    dx = softmax_bwd_output(out, grad, log)
    y = out.float()
    dy = grad.float()
    if log:
        values = dy - torch.exp(y) * dy.sum(dim=1, keepdim=True)
        all_minus_inf = (y == float("-inf")).all(dim=1, keepdim=True)
        values = torch.where(all_minus_inf, 0.0, values)
    else:
        values = y * (dy - (dy * y).sum(dim=1, keepdim=True))
    dx.copy_(values)
    return dx
