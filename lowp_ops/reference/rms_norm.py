"""RMSNorm forward and backward in fp32 (docs/rms_norm.md).

For a row ``x`` of ``H`` elements and weight ``w``: ``rstd = 1 / sqrt(mean(x^2) + eps)`` and
``xhat = x * rstd`` in fp32; ``n = xhat`` rounded to x's dtype when ``round_normalized`` (the Llama /
Qwen / Mistral form: ``weight * hidden.to(input_dtype)``), else ``n = xhat`` (OLMo 2's
``(weight * hidden).to(input_dtype)``); ``y = w * n`` rounded once to x's dtype.

Backward from ``g = dL/dy`` in fp32, the rounding of ``n`` passed straight through:
``dw = Σ_rows g n`` (rounded once to w's dtype), ``dn = g w`` and
``dx = rstd (dn - xhat mean(dn xhat))``, rounded once to x's dtype.
"""

from __future__ import annotations

import torch

from ..meta.rms_norm import rms_norm_bwd_outputs, rms_norm_fwd_outputs


def normalized(
    x: torch.Tensor, rstd: torch.Tensor, round_normalized: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(xhat, n)`` of the module docstring."""
    xhat = x.float() * rstd.unsqueeze(1)
    return xhat, (xhat.to(x.dtype).float() if round_normalized else xhat)


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::rms_norm_fwd``: ``(y, rstd)``."""
    y, rstd = rms_norm_fwd_outputs(x, weight, eps, round_normalized)
    rstd.copy_(torch.rsqrt(x.float().square().mean(dim=1) + eps))
    _, n = normalized(x, rstd, round_normalized)
    y.copy_(weight.float() * n)
    return y, rstd


def rms_norm_bwd(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, round_normalized: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::rms_norm_bwd``: ``(dx, dweight)``."""
    dx, dweight = rms_norm_bwd_outputs(grad, x, weight, rstd, round_normalized)
    g = grad.float()
    xhat, n = normalized(x, rstd, round_normalized)
    dweight.copy_((g * n).sum(dim=0))
    dn = g * weight.float()
    dx.copy_(rstd.unsqueeze(1) * (dn - xhat * (dn * xhat).mean(dim=1, keepdim=True)))
    return dx, dweight
