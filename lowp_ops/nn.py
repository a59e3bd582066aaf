"""Modules built on the ``lowp::`` ops."""

from __future__ import annotations

import math

import torch

from .functional import rms_norm
from .losses import CrossEntropyLoss, LinearCrossEntropyLoss
from .meta.checks import check_int, require
from .meta.grouped_mm import expert_sizes_problem
from .moe import check_mlp_options, grouped_swiglu_mlp

__all__ = ["CrossEntropyLoss", "GroupedSwiGLUMLP", "LinearCrossEntropyLoss", "RMSNorm"]


class GroupedSwiGLUMLP(torch.nn.Module):
    """The experts of an MoE layer: per expert ``nn.Linear(hidden, 2 * ffn)``, SwiGLU times the router
    probability, ``nn.Linear(ffn, hidden)``, no biases. Called as ``mlp(x, split_sizes, probs)`` with x
    (T, hidden) sorted by expert and device ``split_sizes`` (see :func:`lowp_ops.grouped_swiglu_mlp`).

    Weights: ``fc1_weight`` (E, 2 ffn, hidden), ``fc2_weight`` (E, hidden, ffn), bf16 by default,
    initialized per expert like ``nn.Linear`` (uniform in +-1/sqrt(in_features)).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        recipe: str = "bf16",
        fc1_dy_amax_from_dglu: bool = False,
        glu_interleave_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        check_mlp_options(recipe, fc1_dy_amax_from_dglu, glu_interleave_size)
        for value, name in ((num_experts, "num_experts"), (hidden, "hidden"), (ffn, "ffn")):
            check_int(value, name)
            require(value > 0, lambda value=value, name=name: f"{name} must be positive, got {value}")
        problem = expert_sizes_problem(hidden, ffn, recipe)
        require(problem is None, lambda: problem)
        if dtype != torch.bfloat16:  # the grouped GEMMs take bf16 operands, whatever the recipe
            raise ValueError(
                f"dtype must be torch.bfloat16 (the experts' grouped GEMMs take bf16), got {dtype}"
            )
        self.num_experts, self.hidden, self.ffn = num_experts, hidden, ffn
        self.recipe = recipe
        self.fc1_dy_amax_from_dglu = fc1_dy_amax_from_dglu
        self.glu_interleave_size = glu_interleave_size
        factory = {"device": device, "dtype": dtype}
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden, **factory))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_experts, hidden, ffn, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for weight in (self.fc1_weight, self.fc2_weight):
                bound = 1.0 / math.sqrt(weight.shape[2])
                weight.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, split_sizes: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu_mlp(
            x,
            self.fc1_weight,
            self.fc2_weight,
            split_sizes,
            probs,
            recipe=self.recipe,
            fc1_dy_amax_from_dglu=self.fc1_dy_amax_from_dglu,
            glu_interleave_size=self.glu_interleave_size,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden}, ffn={self.ffn}, "
            f"recipe={self.recipe!r}, fc1_dy_amax_from_dglu={self.fc1_dy_amax_from_dglu}, "
            f"glu_interleave_size={self.glu_interleave_size}"
        )


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dim through :func:`lowp_ops.rms_norm`: ``weight`` (hidden,) initialized to
    ones, bf16 by default; ``round_normalized`` as there (True: the Llama form)."""

    def __init__(
        self,
        hidden: int,
        eps: float = 1e-6,
        *,
        round_normalized: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        self.hidden, self.eps, self.round_normalized = hidden, eps, round_normalized
        self.weight = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Ones, as ``torch.nn.RMSNorm`` (deferred initialization: build on ``meta``, ``to_empty``, then
        this)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, round_normalized=self.round_normalized)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, eps={self.eps}, round_normalized={self.round_normalized}"
