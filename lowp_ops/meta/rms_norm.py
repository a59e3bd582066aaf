"""Argument checks and output allocation for the RMSNorm ops (rows of a 2-D tensor)."""

from __future__ import annotations

import torch

from ..formats import HIGH_PRECISION_DTYPES
from .checks import require

MAX_HIDDEN = 16384
"""Widest row the kernels hold in registers (one row per program, no loop over the hidden dim): the
hidden size of the largest Llama (405B)."""


def check_rms_norm_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    require(
        x.dtype in HIGH_PRECISION_DTYPES, lambda: f"x must be float32, bfloat16 or float16, got {x.dtype}"
    )
    require(x.dim() == 2, lambda: f"x must be 2-D (rows, hidden), got {x.dim()}-D")
    require(
        weight.dim() == 1 and weight.shape[0] == x.shape[1],
        lambda: f"weight must have shape ({x.shape[1]},), got {tuple(weight.shape)}",
    )
    require(
        weight.dtype in (x.dtype, torch.float32),
        lambda: f"weight must have x's dtype {x.dtype} or be float32, got {weight.dtype}",
    )
    require(weight.device == x.device, lambda: f"weight must be on {x.device}, got {weight.device}")
    require(
        0 < x.shape[1] <= MAX_HIDDEN, lambda: f"x's hidden size must be 1 to {MAX_HIDDEN}, got {x.shape[1]}"
    )


def rms_norm_fwd_outputs(
    x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y (rows, hidden) in x's dtype, rstd (rows,) fp32)``."""
    check_rms_norm_inputs(x, weight)
    return x.new_empty(x.shape), x.new_empty((x.shape[0],), dtype=torch.float32)


def rms_norm_bwd_outputs(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, round_normalized: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx (rows, hidden) in x's dtype, dweight (hidden,) in weight's dtype: x's or fp32)``."""
    check_rms_norm_inputs(x, weight)
    require(grad.shape == x.shape, lambda: f"grad must have shape {tuple(x.shape)}, got {tuple(grad.shape)}")
    require(
        rstd.shape == (x.shape[0],) and rstd.dtype == torch.float32,
        lambda: f"rstd must be float32 of shape ({x.shape[0]},), got {rstd.dtype} {tuple(rstd.shape)}",
    )
    return x.new_empty(x.shape), weight.new_empty(weight.shape)
