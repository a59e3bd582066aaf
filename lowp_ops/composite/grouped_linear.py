"""Grouped linear layers of MoE experts under the bf16 / MXFP8 / NVFP4 recipes, and the FC1 + SwiGLU
node of the grouped MLP (docs/grouped_mlp.md#recipes).

Each expert ``e`` owns the rows ``[sum(split_sizes[:e]), sum(split_sizes[:e+1]))`` of the tokens and a
weight ``w[e]`` (N, K) in ``nn.Linear`` layout. Three GEMMs per layer, all grouped (``lowp::grouped_mm``):
fprop ``y = x w^T``, dgrad ``dx = dy w``, wgrad ``dw = dy^T x`` (contraction over the expert's tokens).

Recipes, emulated on GPUs without block-scaled GEMMs (Hopper): the operands are quantized with our ops,
dequantized to bf16 (MXFP8: both in one kernel, ``lowp::mxfp8_round_trip``) and multiplied by a bf16
grouped GEMM with fp32 accumulation. Equal to TE's recipe up to the accumulation order, except where
noted.

- ``bf16``: no quantization.
- ``mxfp8`` (E4M3 everywhere, as TE's MXFP8BlockScaling): each GEMM operand quantized along its
  contraction dim: row-wise copies for x, w, dy in fprop/dgrad inputs, column-wise (32-row blocks) for w
  in dgrad and for dy, x in wgrad. Every block is one expert's, as when TE quantizes each expert's
  tensor: w's dgrad blocks through ``_mxfp8_dgrad_weight``; the column-wise blocks of dy and x run
  along tokens and restart at each expert's first row (``mxfp8_round_trip``'s ``group_ends``), an
  expert's last block partial when its split size is not a multiple of 32. E4M3 x 2^k dequantizes
  exactly to bf16.
- ``nvfp4``: TE's NVFP4 recipe (RHT on the wgrad operands, 16x16 weights, global scales applied to
  the GEMM outputs), see :mod:`lowp_ops.composite.grouped_nvfp4`.

Split sizes stay on the device; nothing here reads a tensor value on the host (the output functions
of ``meta`` check them on CPU). Sizes that are not well formed (negative, not summing to T; CUDA, or
checks off) take the effective boundaries of :mod:`lowp_ops.meta.split_sizes` (multiples of 16 for
``nvfp4``): rows of no expert give zero outputs and zero input gradients and add nothing to the weight
gradients.
"""

from __future__ import annotations

import torch

from ..formats import MXFP8_BLOCK_SIZE
from ..meta.grouped_mm import (
    check_grouped_linear,
    check_grouped_linear_bwd,
    check_grouped_swiglu_mlp,
    check_grouped_swiglu_mlp_bwd,
)
from . import registry
from .grouped_nvfp4 import expert_plan, nvfp4_backward, nvfp4_fprop


def group_ends(split_sizes: torch.Tensor, rows: int, with_extended: bool = False) -> torch.Tensor:
    """int32 effective group ends (``meta.split_sizes``, on the device), valid ``offs`` for every
    ``lowp::grouped_mm`` of the pass (passed with ``ends_valid=True``); ``with_extended``: (2, E), the
    second row with the last end ``rows`` (for ``last_end_is_rows=True``)."""
    return registry().group_ends(split_sizes, rows, with_extended)


def _mxfp8_dequantized(t: torch.Tensor, use: str, ends: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` (R, C) through MXFP8 E4M3 and back to bf16: 1x32 blocks along C (``rowwise``) or 32x1 along
    R (``columnwise``; with ``ends``, the experts' group ends, blocks within each expert's rows), one
    kernel (``lowp::mxfp8_round_trip``)."""
    rowwise = use == "rowwise"
    row, col = registry().mxfp8_round_trip(t, "e4m3", rowwise, not rowwise, ends)
    return row if rowwise else col


def _mxfp8_both(t: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise and column-wise (within each expert's rows) MXFP8 round trips of ``t`` from one read."""
    return registry().mxfp8_round_trip(t, "e4m3", True, True, ends)


def _flat(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(-1, weight.shape[-1])


def _mxfp8_dgrad_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weights (E, N, K) through MXFP8 blocks of 32 along N within each expert (dgrad contracts over
    N), as TE quantizes each expert's tensor. With N a multiple of 32 the column-wise blocks of the
    stacked (E * N, K) rows are those blocks; otherwise a block would span two experts (one expert's
    large weights flushing the other's), so each expert's rows go through the row-wise blocks of its
    transpose (a partial last block per expert), at the cost of two copies."""
    experts, n, k = weight.shape
    if n % MXFP8_BLOCK_SIZE == 0:
        return _mxfp8_dequantized(_flat(weight), "columnwise").view(weight.shape)
    per_expert_rows = weight.transpose(1, 2).reshape(experts * k, n)
    return _mxfp8_dequantized(per_expert_rows, "rowwise").view(experts, k, n).transpose(1, 2).contiguous()


def linear_fprop(
    x: torch.Tensor,
    weight: torch.Tensor,
    split_sizes: torch.Tensor,
    recipe: str,
    offs: torch.Tensor | None = None,
    extended: bool = False,
) -> torch.Tensor:
    """y (T, N) = x_e (T_e, K) w[e]^T per expert, bf16. ``offs``: ``group_ends(split_sizes, T)`` (bf16 and
    mxfp8) or ``grouped_nvfp4.expert_plan(split_sizes, T)`` (nvfp4) when the caller has it already.
    ``extended`` (bf16 and mxfp8): ``offs`` is the extended row of ``group_ends(..., with_extended=True)``
    (last end T): the rows past the last true end get x's rows there times the last expert's weight
    instead of zeros, with no zeroing launch."""
    if recipe == "nvfp4":
        return nvfp4_fprop(x, weight, split_sizes, offs)
    offs = group_ends(split_sizes, x.shape[0]) if offs is None else offs
    if recipe == "bf16":
        return registry().grouped_mm(x, weight.transpose(1, 2), offs, True, extended)
    x_deq = _mxfp8_dequantized(x, "rowwise")
    w_deq = _mxfp8_dequantized(_flat(weight), "rowwise").view(weight.shape)
    return registry().grouped_mm(x_deq, w_deq.transpose(1, 2), offs, True, extended)


def linear_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    split_sizes: torch.Tensor,
    recipe: str,
    grad_amax: torch.Tensor | None = None,
    offs: torch.Tensor | None = None,
    dgrad_offs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (T, K), dweight (E, N, K)) bf16 from grad = dy (T, N). ``grad_amax`` (E,) fp32: the per-expert
    amax of ``grad`` before its bf16 rounding (nvfp4 only; from the dGLU epilogue), so that no amax
    pass over ``grad`` runs. ``offs`` as in :func:`linear_fprop`. ``dgrad_offs`` (bf16 and mxfp8): the
    extended row of ``group_ends(..., with_extended=True)``, for the input gradient: the rows of ``dx``
    past the last end are then ``grad``'s rows there times the last expert's weight (zeros when those
    rows of ``grad`` are zeros; values a consumer ignores otherwise) instead of zeros, with no zeroing
    launch.

    The weight gradient comes first and ``x`` is dropped before the input gradient's GEMM: a caller that
    hands over its only reference (``linear_backward(g, taken.pop(), ...)``) frees ``x`` there."""
    if recipe == "nvfp4":
        handed = [x]
        del x
        return nvfp4_backward(grad, handed.pop(), weight, split_sizes, grad_amax, offs)
    offs = group_ends(split_sizes, x.shape[0]) if offs is None else offs
    extended = dgrad_offs is not None
    dgrad_offs = offs if dgrad_offs is None else dgrad_offs
    if recipe == "bf16":
        dweight = registry().grouped_mm(grad.t(), x, offs, True)
        del x
        return registry().grouped_mm(grad, weight, dgrad_offs, True, extended), dweight
    grad_row, grad_col = _mxfp8_both(grad, offs)
    x_col = _mxfp8_dequantized(x, "columnwise", offs)
    del x
    dweight = registry().grouped_mm(grad_col.t(), x_col, offs, True)
    del grad_col, x_col
    w_col = _mxfp8_dgrad_weight(weight)
    return registry().grouped_mm(grad_row, w_col, dgrad_offs, True, extended), dweight


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor, recipe: str
) -> torch.Tensor:
    """Implementation of ``lowp::grouped_linear`` (composed of ``lowp::`` ops on every device)."""
    check_grouped_linear(x, weight, split_sizes, recipe)
    return linear_fprop(x, weight, split_sizes, recipe)


def grouped_linear_bwd(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor, recipe: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Implementation of ``lowp::grouped_linear_bwd``: :func:`linear_backward` as one op (a compiled
    backward calls it once instead of its GEMM and quantize ops one by one)."""
    check_grouped_linear_bwd(grad, x, weight, split_sizes, recipe)
    return linear_backward(grad, x, weight, split_sizes, recipe)


def fc1_probs(probs: torch.Tensor, recipe: str) -> torch.Tensor:
    """The probabilities the forward multiplies by: TE's MXFP8 path rounds them to bf16 first; the
    backward always uses them as given (docs/grouped_mlp.md#router-probability-gradient)."""
    return probs.to(torch.bfloat16) if recipe == "mxfp8" else probs


def _shared_group_ends(split_sizes: torch.Tensor, rows: int, recipe: str) -> torch.Tensor:
    """(2, E) int32 that every GEMM of one MLP call uses, computed once by the forward and kept for the
    backward: bf16 / mxfp8, the group ends and their extended row (the backward's input gradients);
    nvfp4, its recipe's plan (``grouped_nvfp4.expert_plan``: ends, then effective split sizes)."""
    if recipe == "nvfp4":
        return expert_plan(split_sizes, rows)
    return group_ends(split_sizes, rows, True)


def grouped_swiglu_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    recipe: str,
    interleave: int,
    fc1_dy_amax_from_dglu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Implementation of ``lowp::grouped_swiglu_mlp``: ``(y, c, ends)`` with ``c = FC1(x)`` (bf16, saved
    for the backward), ``h = silu(gate) * linear * probs`` (bf16, not kept), ``y = FC2(h)`` (bf16) and
    the GEMMs' int32 group ends (:func:`_shared_group_ends`), which the backward reuses.

    Rows past the last end (of no expert) get ``y = 0`` without a zeroing launch (bf16 and mxfp8): both
    GEMMs run on the extended ends, so such rows of ``c`` hold the last expert's product (which the
    backward's dGLU ignores), and the SwiGLU writes +0 to those rows of ``h``, so FC2 gives them zeros
    (+-0; NaN only where the last expert's FC2 weight holds an inf or NaN)."""
    check_grouped_swiglu_mlp(
        x, fc1_weight, fc2_weight, probs, split_sizes, recipe, interleave, fc1_dy_amax_from_dglu
    )
    ends = _shared_group_ends(split_sizes, x.shape[0], recipe)
    # (the GEMMs' ends, whether they are the extended ones, the true ends that bound h's rows)
    offs, extended, h_ends = (ends, False, None) if recipe == "nvfp4" else (ends[1], True, ends[0])
    c = linear_fprop(x, fc1_weight, split_sizes, recipe, offs, extended)
    h = registry().swiglu_fwd(c, fc1_probs(probs, recipe), interleave, h_ends)
    return linear_fprop(h, fc2_weight, split_sizes, recipe, offs, extended), c, ends


def grouped_swiglu_mlp_backward(
    grad: torch.Tensor,
    activations: list[torch.Tensor],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    ends: torch.Tensor,
    recipe: str,
    interleave: int,
    fc1_dy_amax_from_dglu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (T, H), dW1 (E, 2F, H), dW2 (E, H, F) bf16; dprobs (T,) fp32) from grad = dy (T, H), with the
    forward's (2, E) group ends ``ends`` (:func:`_shared_group_ends`).

    ``activations`` is ``[x, c]`` and is emptied here, so that each is freed after its last use: ``c``
    (T, 2F) after the dGLU, ``x`` (T, H) after FC1's weight gradient, before the GEMMs that follow
    allocate. ``h`` is recomputed from ``c`` (one SwiGLU kernel, the forward's bits) rather than kept
    alive from forward to backward: (T, F) bf16 less per layer for one more read of ``c``.

    Rows past the last end (of no expert) get zero gradients without a zeroing launch: the input
    gradients' GEMMs give them to the last expert (the extended ends), FC2's for the dGLU, which gives
    rows of no expert ``dc = 0`` whatever its input holds there, and FC1's then multiplies those zero
    rows of ``dc``."""
    c = activations.pop()
    offs, dgrad_offs = (ends, None) if recipe == "nvfp4" else (ends[0], ends[1])
    # The forward's h, bit for bit (rows of no expert +0 as there).
    h = registry().swiglu_fwd(c, fc1_probs(probs, recipe), interleave, None if recipe == "nvfp4" else offs)
    handed = [h]
    del h  # linear_backward holds the only reference and drops it after FC2's weight gradient
    dh, dfc2_weight = linear_backward(
        grad, handed.pop(), fc2_weight, split_sizes, recipe, offs=offs, dgrad_offs=dgrad_offs
    )
    dc, dprobs, dc_amax = registry().dglu(dh, c, probs, split_sizes, interleave)
    del dh, c
    amax = dc_amax if fc1_dy_amax_from_dglu else None
    dx, dfc1_weight = linear_backward(
        dc, activations.pop(), fc1_weight, split_sizes, recipe, amax, offs, dgrad_offs
    )
    return dx, dfc1_weight, dfc2_weight, dprobs


def grouped_swiglu_mlp_bwd(
    grad: torch.Tensor,
    x: torch.Tensor,
    c: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    ends: torch.Tensor,
    recipe: str,
    interleave: int,
    fc1_dy_amax_from_dglu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Implementation of ``lowp::grouped_swiglu_mlp_bwd``: :func:`grouped_swiglu_mlp_backward` as one op,
    which a compiled backward calls once instead of its GEMM, SwiGLU and dGLU ops one by one. ``x`` and
    ``c`` stay alive until it returns (the caller holds them)."""
    check_grouped_swiglu_mlp_bwd(
        grad, x, c, fc1_weight, fc2_weight, probs, split_sizes, ends, recipe, interleave,
        fc1_dy_amax_from_dglu,
    )  # fmt: skip
    return grouped_swiglu_mlp_backward(
        grad, [x, c], fc1_weight, fc2_weight, probs, split_sizes, ends, recipe, interleave,
        fc1_dy_amax_from_dglu,
    )  # fmt: skip
