"""Public grouped SwiGLU MLP of MoE experts (thin wrapper over ``torch.ops.lowp``)."""

from __future__ import annotations

import torch

from . import library
from .meta.checks import check_bool, require, require_tensor
from .meta.grouped_mm import RECIPES
from .meta.split_sizes import check_split_sizes

__all__ = ["grouped_swiglu_mlp"]


def check_mlp_options(recipe: str, fc1_dy_amax_from_dglu: bool, glu_interleave_size: int | None) -> None:
    """The experts' options, named when wrong (also checked by ``nn.GroupedSwiGLUMLP`` when built)."""
    require(recipe in RECIPES, lambda: f"recipe must be one of {RECIPES}, got {recipe!r}")
    check_bool(fc1_dy_amax_from_dglu, "fc1_dy_amax_from_dglu")
    require(
        glu_interleave_size in (None, 32),
        lambda: f"glu_interleave_size must be None or 32, got {glu_interleave_size!r}",
    )


def grouped_swiglu_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    split_sizes: torch.Tensor,
    probs: torch.Tensor,
    *,
    recipe: str = "bf16",
    fc1_dy_amax_from_dglu: bool = False,
    glu_interleave_size: int | None = None,
) -> torch.Tensor:
    """MoE experts' SwiGLU MLP: ``y_t = W2_e (silu(gate) * linear * p_t)`` with ``(gate, linear) = W1_e x_t``.

    Args:
        x: (T, H) bf16 tokens sorted by expert: expert ``e`` owns rows ``[sum(split_sizes[:e]),
            sum(split_sizes[:e+1]))``. ``sum(split_sizes)`` must equal T: checked on CPU (ValueError);
            on CUDA, without a host sync, malformed sizes follow the effective-boundary rule of
            :mod:`lowp_ops.meta.split_sizes` (rows of no expert give y = 0 and zero gradients), and
            ``LOWP_OPS_CHECK_SPLIT_SIZES=1`` checks them on the host.
        fc1_weight: (E, 2F, H) bf16, per expert ``nn.Linear(H, 2F)``; gate rows first (TE's order) or,
            with ``glu_interleave_size=32``, alternating 32-row gate/linear blocks.
        fc2_weight: (E, H, F) bf16, per expert ``nn.Linear(F, H)``.
        split_sizes: (E,) integer tensor on x's device; zeros (empty experts) allowed. Never read on the
            host: forward and backward run without a sync and inside CUDA graphs.
        probs: (T,) or (T, 1) fp32 or bf16 router probabilities, multiplied after the activation, before
            FC2.
        recipe: ``"bf16"``, ``"mxfp8"`` or ``"nvfp4"`` (emulated with bf16 grouped GEMMs on Hopper; see
            :mod:`lowp_ops.composite.grouped_linear`). MXFP8 takes any split sizes (its 32-blocks
            restart at each expert), NVFP4 multiples of 16.
        fc1_dy_amax_from_dglu: nvfp4 only: the FC1 gradient's NVFP4 amaxes come from the dGLU epilogue
            (row-wise ``bf16(amax)``, column-wise ``4 x`` that) instead of an amax pass.
        glu_interleave_size: None or 32.

    Returns y (T, H) bf16. H and F must be multiples of 8 (16-byte GEMM rows); the nvfp4 recipe needs H
    a multiple of 16 (its 16x16 weight blocks). Gradients flow to x,
    both weights and probs; fp32 probs get an fp32 gradient that was never rounded to bf16, bf16 probs
    get ``bf16(fp32 dprobs)``. The backward keeps x and ``c = FC1(x)`` (not the FC2 input, which it
    recomputes) and frees each at its last use, so it runs once: a second backward through the same
    call (``retain_graph=True``) raises; under saved-tensor hooks (checkpointing, CPU offload) they are
    saved tensors as usual (docs/grouped_mlp.md#memory).
    """
    check_mlp_options(recipe, fc1_dy_amax_from_dglu, glu_interleave_size)
    for value, name in ((x, "x"), (fc1_weight, "fc1_weight"), (fc2_weight, "fc2_weight"), (probs, "probs")):
        require_tensor(value, name)
    require(x.dim() == 2, lambda: f"x must be 2-D (tokens, hidden), got {x.dim()}-D {tuple(x.shape)}")
    require(
        tuple(probs.shape) in ((x.shape[0],), (x.shape[0], 1)),
        lambda: f"probs must have shape ({x.shape[0]},) or ({x.shape[0]}, 1), got {tuple(probs.shape)}",
    )
    check_split_sizes(split_sizes, experts=fc1_weight.shape[0], device=x.device)
    y, _, _ = library.grouped_swiglu_mlp(
        x,
        fc1_weight,
        fc2_weight,
        probs.reshape(-1),
        split_sizes,
        recipe,
        glu_interleave_size or 0,
        fc1_dy_amax_from_dglu,
    )
    return y
