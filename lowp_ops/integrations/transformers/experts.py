"""MoE experts of transformers 5.x through :func:`lowp_ops.grouped_swiglu_mlp`: the (token, choice)
rows sorted by expert on the device, padded per expert for the quantized recipes."""

from __future__ import annotations

import torch
from torch import nn

from ... import grouped_swiglu_mlp
from ...meta.grouped_mm import expert_sizes_problem
from .layers import _as_autocast_would, _silu_classes

EXPERT_RECIPES = ("bf16", "mxfp8", "nvfp4")


ROW_ALIGNMENT = {"bf16": 1, "mxfp8": 32, "nvfp4": 16}
"""Rows per expert are padded to these multiples: MXFP8 column-wise blocks are 32 tokens long, NVFP4's
RHT and column-wise blocks 16 (lowp_ops.composite.grouped_linear)."""


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    """The fused experts modules of transformers 5.x (3-D ``gate_up_proj`` and ``down_proj``)."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
        and module.gate_up_proj.dim() == 3
    ]


def _unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` is not the SwiGLU expert layout of grouped_swiglu_mlp (None when it is)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    experts, two_ffn, hidden = gate_up.shape
    checks = [
        (getattr(module, "has_bias", False), "biases"),
        (getattr(module, "is_transposed", False), "transposed weights (E, in, out)"),
        (not getattr(module, "is_concatenated", True), "interleaved gate/up columns"),
        (not getattr(module, "has_gate", True), "no gate"),
        (getattr(module, "has_post_expert_norm", False), "a norm after each expert"),
        (_has_own_gate(module), "its own gate function"),
        (not isinstance(getattr(module, "act_fn", None), _silu_classes()), "an activation other than SiLU"),
        (getattr(module, "_is_expert_parallel", False), "expert parallelism"),
        (tuple(down.shape) != (experts, hidden, two_ffn // 2), f"down_proj {tuple(down.shape)}"),
        (
            {gate_up.dtype, down.dtype} - {torch.bfloat16, torch.float32},
            f"{gate_up.dtype} weights, not bf16 (or fp32 under bf16 autocast)",
        ),
        (hidden % 8 != 0 or two_ffn % 16 != 0, "hidden or intermediate size not a multiple of 8"),
    ]
    reasons = [reason for failed, reason in checks if failed]
    return ", ".join(reasons) if reasons else None


def _has_own_gate(module: nn.Module) -> bool:
    """True when the experts class replaces transformers' default ``silu(gate) * up`` (``_apply_gate``)."""
    gate = getattr(type(module), "_apply_gate", None)
    return gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate"


def _supported_experts(model: nn.Module, recipe: str = "bf16") -> list[nn.Module]:
    modules = _experts_modules(model)
    if not modules:
        raise ValueError(f"experts= was given but {type(model).__name__} has no fused MoE experts module")
    for module in modules:
        reason = _unsupported_reason(module)
        if reason is None:
            _, hidden, ffn = module.down_proj.shape
            reason = expert_sizes_problem(hidden, ffn, recipe)
        if reason is not None:
            raise NotImplementedError(
                f"apply_lowp_ops(experts=...): {type(module).__name__} is not the SwiGLU expert layout of "
                f"lowp_ops.grouped_swiglu_mlp: {reason}"
            )
    return modules


def _sort_by_expert(expert_of_choice: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order (n,) sorting the (token, choice) rows by expert, stably; split sizes (E,) int64), both on
    the device."""
    order = torch.argsort(expert_of_choice, stable=True)
    ones = torch.ones_like(expert_of_choice)
    split_sizes = torch.zeros(experts, dtype=torch.int64, device=ones.device).scatter_add_(
        0, expert_of_choice, ones
    )
    return order, split_sizes


def padded_capacity(choices: int, experts: int, alignment: int) -> int:
    """Rows of the padded layout: enough for any routing of ``choices`` rows, a multiple of ``alignment``."""
    return -(-(choices + experts * (alignment - 1)) // alignment) * alignment


def _padded_rows(
    sorted_expert: torch.Tensor, split_sizes: torch.Tensor, alignment: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each sorted choice in the padded layout (n,), padded split sizes (E,)): every expert's
    rows start at a multiple of ``alignment``; the rows in between stay zero, and the last expert also
    owns the zero rows up to ``capacity`` (the split sizes sum to it, as the CPU references require)."""
    padded_sizes = (split_sizes + (alignment - 1)) // alignment * alignment
    starts = torch.cumsum(split_sizes, 0) - split_sizes
    padded_starts = torch.cumsum(padded_sizes, 0) - padded_sizes
    rank_in_expert = torch.arange(sorted_expert.shape[0], device=sorted_expert.device) - starts[sorted_expert]
    slack = capacity - padded_sizes.sum()
    padded_sizes = torch.cat((padded_sizes[:-1], padded_sizes[-1:] + slack))
    return padded_starts[sorted_expert] + rank_in_expert, padded_sizes


def _grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward (tokens (T, H), top-k expert ids and weights (T, k)) through
    ``grouped_swiglu_mlp``; (T, H) in hidden_states' dtype, the k choices summed."""
    gate_up, down, out_dtype = self.gate_up_proj, self.down_proj, hidden_states.dtype
    if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
        hidden_as, gate_up, down = _as_autocast_would(hidden_states, gate_up, down)
        if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
            raise ValueError(
                f"apply_lowp_ops(experts={self._lowp_recipe!r}): {type(self).__name__}'s weights are "
                f"{self.gate_up_proj.dtype}; the lowp experts take bf16 weights, or fp32 ones inside a bf16 "
                "autocast region (mixed precision): convert the model to bf16, train under "
                "torch.autocast(dtype=torch.bfloat16), or patch it without experts="
            )
        hidden_states = hidden_as
    tokens, top_k = top_k_index.shape
    experts, hidden = self.gate_up_proj.shape[0], hidden_states.shape[-1]
    alignment = ROW_ALIGNMENT[self._lowp_recipe]
    expert_of_choice = top_k_index.reshape(-1)
    order, split_sizes = _sort_by_expert(expert_of_choice, experts)
    x = hidden_states[order // top_k]
    probs = top_k_weights.reshape(-1)[order]
    if alignment == 1:
        row = torch.arange(order.shape[0], device=order.device)
    else:
        capacity = padded_capacity(order.shape[0], experts, alignment)
        row, split_sizes = _padded_rows(expert_of_choice[order], split_sizes, alignment, capacity)
        x = x.new_zeros(capacity, hidden).index_copy(0, row, x)
        probs = probs.new_zeros(capacity).index_copy(0, row, probs)
    y = grouped_swiglu_mlp(x, gate_up, down, split_sizes, probs, recipe=self._lowp_recipe)
    row_of_choice = torch.empty_like(order).scatter_(0, order, row)
    return y[row_of_choice].view(tokens, top_k, hidden).sum(dim=1).to(out_dtype)
