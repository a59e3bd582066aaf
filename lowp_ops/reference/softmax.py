"""Masked-safe softmax family over the rows of a 2-D tensor, in fp32 (the semantics and CPU kernels).

An all ``-inf`` row has ``lse = -inf`` and, like PyTorch, NaN (log-)probabilities; with
``masked_rows="zero"`` it gets probabilities 0 (log-probabilities ``-inf``) and a zero gradient.
"""

from __future__ import annotations

import torch

from ..meta.softmax import logsumexp_output, softmax_bwd_output, softmax_fwd_output


def masked_safe_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``log Σ exp(x)`` per row, shifting by 0 when the row max is -inf (no ``-inf - -inf``)."""
    x = x.float()
    row_max = x.amax(dim=1, keepdim=True)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    return (shift + torch.exp(x - shift).sum(dim=1, keepdim=True).log()).squeeze(1)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    out = logsumexp_output(x)
    out.copy_(masked_safe_logsumexp(x))
    return out


def softmax_fwd(x: torch.Tensor, log: bool, masked_rows: str) -> torch.Tensor:
    out = softmax_fwd_output(x, log, masked_rows)
    lse = masked_safe_logsumexp(x).unsqueeze(1)
    values = x.float() - lse if log else torch.exp(x.float() - lse)
    if masked_rows == "zero":
        values = torch.where(lse == float("-inf"), float("-inf") if log else 0.0, values)
    out.copy_(values)
    return out


def softmax_bwd(out: torch.Tensor, grad: torch.Tensor, log: bool) -> torch.Tensor:
    dx = softmax_bwd_output(out, grad, log)
    y = out.float()
    dy = grad.float()
    if log:
        values = dy - torch.exp(y) * dy.sum(dim=1, keepdim=True)
        values = torch.where(y.amax(dim=1, keepdim=True) == float("-inf"), 0.0, values)
    else:
        values = y * (dy - (dy * y).sum(dim=1, keepdim=True))
    dx.copy_(values)
    return dx
