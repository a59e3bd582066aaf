"""NVFP4 recipe of the grouped linear layers, emulated with bf16 grouped GEMMs
(docs/grouped_mlp.md#nvfp4-recipe), as TE's NVFP4BlockScaling with stochastic rounding off:

- activations and gradients: 1x16 blocks along the contraction dim with the expert's global amax
  (row-wise copy; fprop and dgrad); for wgrad the column-wise copy: 16-point RHT along the expert's
  tokens, blocks along tokens, the expert's post-RHT amax;
- weights: 16x16 blocks, no RHT, one amax per expert (row- and column-wise copies hold the same values);
- GEMM: the local values ``e2m1 * s_b`` are exact in bf16 (docs/nvfp4.md), the bf16 grouped GEMM accumulates
  in fp32 and rounds to bf16, then ``alpha_e = (amax_a / 2688)(amax_b / 2688)`` scales the rows (or the
  wgrad block) of expert e in fp32 with one more bf16 rounding (TE applies alpha before its only
  rounding: ours rounds twice, ``torch._grouped_mm`` has no fp32 output on its fast path).

Split sizes must be multiples of 16 (the RHT and column-wise blocks never straddle experts; TE needs
128): checked on CPU (``meta.grouped_mm``), not read on CUDA. Both passes first replace them by their
effective sizes with multiple 16 (``meta.split_sizes``; the identity for well-formed sizes), so that
every op of the recipe sees the same boundaries whatever the sizes hold. Per-expert amaxes are device
reductions (no host sync).

The activations and gradients go through ``lowp::nvfp4_group_quantize`` (one read per operand, Triton on
CUDA) and the weights through it too (16x16 blocks, the experts' rows stacked: one call); the local
values are decoded from their codes and E4M3 scales by ``lowp::nvfp4_decode_rows`` and
``lowp::nvfp4_group_decode_columns`` (one read of codes and scales, one bf16 write).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..formats import NVFP4_BLOCK_SIZE, NVFP4_GLOBAL_SCALE_NUMERATOR
from ..meta.checks import require
from ..meta.grouped_mm import NVFP4_SPLIT_MULTIPLE
from ..meta.split_sizes import effective_split_sizes, expert_of_rows
from . import registry

_GLOBAL_RCP = 1.0 / NVFP4_GLOBAL_SCALE_NUMERATOR


class ExpertRows(NamedTuple):
    """One pass's view of the tokens' experts, computed once and shared by its GEMMs and scalings:
    effective split sizes (E,) with multiple 16, their int32 prefix sums (the group ends, valid ``offs``
    of ``lowp::grouped_mm``), and the expert of every token (T,), E for a token of no expert."""

    split_sizes: torch.Tensor
    ends: torch.Tensor
    expert_of_row: torch.Tensor


def expert_rows(split_sizes: torch.Tensor, tokens: int) -> ExpertRows:
    sizes = effective_split_sizes(split_sizes, tokens, NVFP4_SPLIT_MULTIPLE)
    # The effective sizes are well formed: their prefix sums are the effective boundaries, valid ends.
    ends = torch.cumsum(sizes, dim=0, dtype=torch.int32)
    rows = torch.arange(tokens, device=split_sizes.device)
    return ExpertRows(sizes, ends, torch.bucketize(rows, ends, right=True))


def per_expert_amax(
    values_abs_max: torch.Tensor,
    split_sizes: torch.Tensor,
    axis_len: int,
    expert_of_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """(E,) fp32 max of per-token ``values_abs_max`` (T,) over each expert's tokens; 0 when empty.
    ``expert_of_row``: :class:`ExpertRows`'s, when the caller has it."""
    experts = split_sizes.shape[0]
    if expert_of_row is None:
        expert_of_row = expert_of_rows(split_sizes, axis_len)
    out = values_abs_max.new_zeros(experts + 1, dtype=torch.float32)
    out.scatter_reduce_(0, expert_of_row, values_abs_max.float(), reduce="amax")
    return out[:experts]


def _token_values(per_expert: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """(T,) the value of each token's expert (0 past the last expert)."""
    padded = torch.cat((per_expert, per_expert.new_zeros(1)))
    return padded[expert_of_row]


def rowwise_operand(
    t: torch.Tensor,
    split_sizes: torch.Tensor,
    amax: torch.Tensor | None = None,
    expert_of_row: torch.Tensor | None = None,
):
    """(local values (T, C), per-expert amax (E,)) of the row-wise copy of tokens ``t`` (T, C)."""
    tokens = t.shape[0]
    if amax is None:
        amax = per_expert_amax(t.abs().amax(dim=1), split_sizes, tokens, expert_of_row)
    row_data, row_scale, *_ = registry().nvfp4_group_quantize(t, split_sizes, True, False, False, amax, None)
    return registry().nvfp4_decode_rows(row_data, row_scale), amax


def columnwise_operand(t: torch.Tensor, split_sizes: torch.Tensor, amax: torch.Tensor | None = None):
    """(local values of ``RHT(t^T)`` (C, T), per-expert post-RHT amax (E,)): 16-token blocks."""
    tokens, hidden = t.shape
    require(
        tokens % NVFP4_BLOCK_SIZE == 0, lambda: f"nvfp4 needs a token count divisible by 16, got {tokens}"
    )
    outputs = registry().nvfp4_group_quantize(t, split_sizes, False, True, True, None, amax)
    _, _, col_data, col_scale, _, amax = outputs
    local = registry().nvfp4_group_decode_columns(col_data, col_scale, split_sizes, hidden, tokens)
    return local, amax


def weight_operand(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(local values (E, N, K), amax (E,)): each expert's 16x16-block quantization with its own amax,
    all experts in one grouped call over the stacked (E * N, K) rows (N is a multiple of 16, so no
    block straddles two experts), decoded at once."""
    experts, out_features, in_features = weight.shape
    amax = weight.abs().amax(dim=(1, 2)).float()
    rows_per_expert = torch.full((experts,), out_features, dtype=torch.int64, device=weight.device)
    row_data, row_scale, *_ = registry().nvfp4_group_quantize(
        weight.reshape(-1, in_features), rows_per_expert, True, False, False, amax, None, None, True
    )
    return registry().nvfp4_decode_rows(row_data, row_scale).view(weight.shape), amax


def _scale_rows(out: torch.Tensor, alpha: tuple[torch.Tensor, torch.Tensor], expert_of_row: torch.Tensor):
    """bf16 ``out * alpha_e`` per expert's rows, ``alpha`` as :func:`_alpha` returns it."""
    first, second = (_token_values(factor, expert_of_row)[:, None] for factor in alpha)
    return out.float().mul_(first).mul_(second).to(torch.bfloat16)  # in place: one fp32 temporary


def _alpha(amax_a: torch.Tensor, amax_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert, two fp32 factors whose product, applied in turn, is ``(amax_a / 2688)(amax_b / 2688)``:
    ``(alpha, 1)`` (the result bit-identical to one multiply by alpha) where alpha is finite, and the two
    quotients where it overflows (a product that overflows alone can still give finite outputs)."""
    a, b = amax_a * _GLOBAL_RCP, amax_b * _GLOBAL_RCP
    alpha = a * b
    overflows = torch.isinf(alpha) & torch.isfinite(a) & torch.isfinite(b)
    return torch.where(overflows, a, alpha), torch.where(overflows, b, 1.0)


def nvfp4_fprop(x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """y (T, N) bf16 of the NVFP4 recipe."""
    plan = expert_rows(split_sizes, x.shape[0])
    x_local, amax_x = rowwise_operand(x, plan.split_sizes, None, plan.expert_of_row)
    w_local, amax_w = weight_operand(weight)
    y = registry().grouped_mm(x_local, w_local.transpose(1, 2), plan.ends, True)
    return _scale_rows(y, _alpha(amax_x, amax_w), plan.expert_of_row)


def grad_amaxes(dglu_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE PR #3755 (docs/grouped_mlp.md#fc1-gradient-amaxes-from-the-dglu): the FC1 gradient's row-wise
    amax ``bf16(dGLU amax)`` (== max |dc_bf16| per expert exactly, docs/nvfp4.md#amax-of-a-rounded-tensor)
    and its column-wise post-RHT bound ``4 x`` that (docs/nvfp4.md#the-4x-bound)."""
    rowwise = dglu_amax.to(torch.bfloat16).float()
    return rowwise, 4.0 * rowwise


def nvfp4_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    split_sizes: torch.Tensor,
    grad_amax: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) bf16; ``grad_amax`` given: no amax pass over ``grad`` (see :func:`grad_amaxes`).
    The weight gradient comes first, and ``x`` is dropped before the input gradient is formed."""
    plan = expert_rows(split_sizes, x.shape[0])
    split_sizes = plan.split_sizes
    amax_row, amax_col = grad_amaxes(grad_amax) if grad_amax is not None else (None, None)
    x_col, amax_x_col = columnwise_operand(x, split_sizes)
    del x
    grad_col, amax_col = columnwise_operand(grad, split_sizes, amax_col)
    dweight = registry().grouped_mm(grad_col, x_col.t(), plan.ends, True)
    del grad_col, x_col
    first, second = _alpha(amax_col, amax_x_col)
    dweight = dweight.float().mul_(first[:, None, None]).mul_(second[:, None, None]).to(torch.bfloat16)
    grad_row, amax_row = rowwise_operand(grad, split_sizes, amax_row, plan.expert_of_row)
    w_local, amax_w = weight_operand(weight)
    dx = registry().grouped_mm(grad_row, w_local, plan.ends, True)
    dx = _scale_rows(dx, _alpha(amax_row, amax_w), plan.expert_of_row)
    return dx, dweight
