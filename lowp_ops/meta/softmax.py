"""Argument checks and output allocation for the softmax-family ops (rows of a 2-D tensor)."""

from __future__ import annotations

import torch

from ..formats import HIGH_PRECISION_DTYPES
from .checks import require

MASKED_ROWS_MODES = ("nan", "zero")


def check_rows(x: torch.Tensor, name: str = "x") -> None:
    require(
        x.dtype in HIGH_PRECISION_DTYPES,
        lambda: f"{name} must be float32, bfloat16 or float16, got {x.dtype}",
    )
    require(x.dim() == 2, lambda: f"{name} must be 2-D (rows, cols), got {x.dim()}-D")


def check_masked_rows(masked_rows: str) -> None:
    require(
        masked_rows in MASKED_ROWS_MODES,
        lambda: f"masked_rows must be one of {list(MASKED_ROWS_MODES)}, got {masked_rows!r}",
    )


def logsumexp_output(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``(rows,)``."""
    check_rows(x)
    return x.new_empty((x.shape[0],), dtype=torch.float32)


def softmax_fwd_output(x: torch.Tensor, log: bool, masked_rows: str) -> torch.Tensor:
    """x's shape and dtype, contiguous."""
    check_rows(x)
    check_masked_rows(masked_rows)
    return x.new_empty(x.shape)


def softmax_bwd_output(out: torch.Tensor, grad: torch.Tensor, log: bool) -> torch.Tensor:
    """out's shape and dtype, contiguous."""
    check_rows(out, "out")
    require(
        grad.shape == out.shape, lambda: f"grad must have shape {tuple(out.shape)}, got {tuple(grad.shape)}"
    )
    return out.new_empty(out.shape)
