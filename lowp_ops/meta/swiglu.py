"""Argument checks and output allocation for the SwiGLU-times-probs ops (MoE expert activations)."""

from __future__ import annotations

import torch

from .checks import require
from .split_sizes import check_split_size_values, check_split_sizes

GLU_INTERLEAVE_SIZES = (0, 32)
"""0: ``c = [gate | linear]`` halves (TE's convention); 32: alternating 32-wide gate / linear blocks."""


def check_glu_inputs(
    c: torch.Tensor, probs: torch.Tensor, interleave: int, device: torch.device | None = None
) -> None:
    """c (tokens, 2 ffn) floating, probs (tokens,) fp32/bf16 on ``device`` (default c's), interleave 0 or
    32 (dividing ffn); raises a ValueError naming the first bad argument."""
    device = c.device if device is None else device
    # One expression for the valid case (the MLP's backward checks three GLU calls: host time).
    valid = (
        c.dim() == 2
        and c.dtype in _GLU_DTYPES
        and c.shape[1] > 0
        and c.shape[1] % 2 == 0
        and probs.dim() == 1
        and probs.shape[0] == c.shape[0]
        and probs.dtype in _PROBS_DTYPES
        and probs.device == device
        and (interleave == 0 or (interleave == 32 and (c.shape[1] // 2) % 32 == 0))
    )
    if not valid:
        _explain_glu_inputs(c, probs, interleave, device)


_GLU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PROBS_DTYPES = (torch.float32, torch.bfloat16)


def _explain_glu_inputs(c: torch.Tensor, probs: torch.Tensor, interleave: int, device: torch.device) -> None:
    """Raise the ValueError that names the first bad argument of :func:`check_glu_inputs`."""
    require(c.dim() == 2, lambda: f"c must be 2-D (tokens, 2 * ffn), got {c.dim()}-D")
    require(
        c.dtype in (torch.bfloat16, torch.float16, torch.float32),
        lambda: f"c must be bfloat16, float16 or float32, got {c.dtype}",
    )
    require(
        c.shape[1] > 0 and c.shape[1] % 2 == 0,
        lambda: f"c must have an even, non-zero last dim (gate and linear halves), got {c.shape[1]}",
    )
    require(
        probs.dim() == 1 and probs.shape[0] == c.shape[0],
        lambda: f"probs must have shape ({c.shape[0]},), got {tuple(probs.shape)}",
    )
    require(
        probs.dtype in (torch.float32, torch.bfloat16),
        lambda: f"probs must be float32 or bfloat16, got {probs.dtype}",
    )
    require(probs.device == device, lambda: f"probs must be on {device}, got {probs.device}")
    require(
        interleave in GLU_INTERLEAVE_SIZES,
        lambda: f"glu_interleave_size must be None or 32, got {interleave}",
    )
    require(
        interleave == 0 or (c.shape[1] // 2) % interleave == 0,
        lambda: f"glu_interleave_size=32 needs ffn divisible by 32, got {c.shape[1] // 2}",
    )


def swiglu_fwd_output(
    c: torch.Tensor, probs: torch.Tensor, interleave: int, ends: torch.Tensor | None = None
) -> torch.Tensor:
    """h = silu(gate) * linear * probs: ``(tokens, ffn)`` in c's dtype. ``ends``: int32 (E,) group ends on
    c's device, valid (``lowp::group_ends``), whose last bounds the rows that get values."""
    check_glu_inputs(c, probs, interleave)
    if ends is not None:
        require(
            ends.dtype == torch.int32 and ends.dim() == 1 and ends.shape[0] > 0 and ends.device == c.device,
            lambda: (
                f"ends must be a non-empty 1-D int32 tensor on c's device, got {ends.dtype} "
                f"{tuple(ends.shape)} on {ends.device}"
            ),
        )
    return c.new_empty((c.shape[0], c.shape[1] // 2))


def dglu_outputs(
    grad: torch.Tensor, c: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor, interleave: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dc (tokens, 2 ffn) in c's dtype, dprobs (tokens,) fp32, amax (experts,) fp32)``. Split sizes:
    int32/int64 (experts,) on c's device, >= 0 with a total of at most the tokens (checked on the host
    where ``meta.split_sizes`` says)."""
    check_glu_inputs(c, probs, interleave)
    require(
        grad.shape == (c.shape[0], c.shape[1] // 2),
        lambda: f"grad must have shape {(c.shape[0], c.shape[1] // 2)}, got {tuple(grad.shape)}",
    )
    require(grad.device == c.device, lambda: f"grad must be on c's device {c.device}, got {grad.device}")
    check_split_sizes(split_sizes, device=c.device, of="c")
    check_split_size_values(split_sizes, c.shape[0], total="at_most")
    return (
        c.new_empty(c.shape),
        c.new_empty((c.shape[0],), dtype=torch.float32),
        c.new_empty((split_sizes.shape[0],), dtype=torch.float32),
    )
