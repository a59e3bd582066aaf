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
``lowp::nvfp4_group_decode_columns`` (one read of codes and scales, one bf16 write); each GEMM output is
scaled by its experts' alpha in one ``lowp::nvfp4_scale_rows``.
"""

from __future__ import annotations

import torch

from ..formats import NVFP4_BLOCK_SIZE
from ..meta.checks import require
from ..meta.grouped_mm import NVFP4_SPLIT_MULTIPLE
from ..meta.split_sizes import group_ends
from . import registry


def expert_plan(split_sizes: torch.Tensor, tokens: int) -> torch.Tensor:
    """(2, E) int32 on the device: the effective group ends with multiple 16 (``meta.split_sizes``; valid
    ``offs`` of ``lowp::grouped_mm`` and ``ends`` of ``lowp::nvfp4_scale_rows``), then the effective
    split sizes (well formed: what the quantize and decode ops take). An MLP call computes it once, in
    its forward, and its backward reuses it."""
    ends = group_ends(split_sizes, tokens, NVFP4_SPLIT_MULTIPLE)
    return torch.stack((ends, torch.diff(ends, prepend=ends.new_zeros(1)))).to(torch.int32)


def rowwise_operand(t: torch.Tensor, split_sizes: torch.Tensor, amax: torch.Tensor | None = None):
    """(local values (T, C), per-expert amax (E,)) of the row-wise copy of tokens ``t`` (T, C); without
    ``amax`` the quantize op computes each expert's (its amax pass, no separate reduction)."""
    row_data, row_scale, _, _, amax, _ = registry().nvfp4_group_quantize(
        t, split_sizes, True, False, False, amax, None
    )
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
    """(local values (E, N, K), amax (E,)): each expert's 16x16-block quantization with its own amax
    (computed by the quantize op), all experts in one grouped call over the stacked (E * N, K) rows (N is
    a multiple of 16, so no block straddles two experts), decoded at once."""
    experts, out_features, in_features = weight.shape
    rows_per_expert = torch.full((experts,), out_features, dtype=torch.int64, device=weight.device)
    row_data, row_scale, _, _, amax, _ = registry().nvfp4_group_quantize(
        weight.reshape(-1, in_features), rows_per_expert, True, False, False, None, None, None, True
    )
    return registry().nvfp4_decode_rows(row_data, row_scale).view(weight.shape), amax


def nvfp4_fprop(
    x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor, plan: torch.Tensor | None = None
) -> torch.Tensor:
    """y (T, N) bf16 of the NVFP4 recipe; ``plan``: :func:`expert_plan`'s, when the caller has it."""
    ends, sizes = expert_plan(split_sizes, x.shape[0]) if plan is None else plan
    x_local, amax_x = rowwise_operand(x, sizes)
    w_local, amax_w = weight_operand(weight)
    y = registry().grouped_mm(x_local, w_local.transpose(1, 2), ends, True)
    return registry().nvfp4_scale_rows(y, amax_x, amax_w, ends)


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
    plan: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) bf16; ``grad_amax`` given: no amax pass over ``grad`` (see :func:`grad_amaxes`);
    ``plan`` as in :func:`nvfp4_fprop`. The weight gradient comes first, and ``x`` is dropped before the
    input gradient is formed."""
    ends, sizes = expert_plan(split_sizes, x.shape[0]) if plan is None else plan
    amax_row, amax_col = grad_amaxes(grad_amax) if grad_amax is not None else (None, None)
    x_col, amax_x_col = columnwise_operand(x, sizes)
    del x
    grad_col, amax_col = columnwise_operand(grad, sizes, amax_col)
    dweight = registry().grouped_mm(grad_col, x_col.t(), ends, True)
    del grad_col, x_col
    dweight = registry().nvfp4_scale_rows(dweight.flatten(0, 1), amax_col, amax_x_col, None)
    grad_row, amax_row = rowwise_operand(grad, sizes, amax_row)
    w_local, amax_w = weight_operand(weight)
    dx = registry().grouped_mm(grad_row, w_local, ends, True)
    return registry().nvfp4_scale_rows(dx, amax_row, amax_w, ends), dweight.view(weight.shape)
