"""Argument checks and output allocation for the grouped GEMM and the grouped SwiGLU MLP ops."""

from __future__ import annotations

import torch

from .checks import require
from .split_sizes import check_group_end_values, check_split_size_values, check_split_sizes
from .swiglu import check_glu_inputs

RECIPES = ("bf16", "mxfp8", "nvfp4")
NVFP4_SPLIT_MULTIPLE = 16
"""The NVFP4 recipe's split sizes are multiples of 16 (RHT and column-wise blocks never straddle experts)."""
GEMM_ALIGNMENT = 8
"""bf16 elements per 16 bytes: ``torch._grouped_mm`` (TMA) needs 16-byte aligned leading strides."""


def check_recipe(recipe: str) -> None:
    require(recipe in RECIPES, lambda: f"recipe must be one of {RECIPES}, got {recipe!r}")


def _check_bf16_matrix(t: torch.Tensor, name: str, dims: int, device: torch.device | None = None) -> None:
    """``t`` is a bf16 tensor of ``dims`` dims (on ``device`` when given: x's)."""
    require(t.dim() == dims, lambda: f"{name} must be {dims}-D, got {t.dim()}-D")
    require(t.dtype == torch.bfloat16, lambda: f"{name} must be bfloat16, got {t.dtype}")
    require(
        device is None or t.device == device, lambda: f"{name} must be on x's device {device}, got {t.device}"
    )


def grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> tuple[int, ...]:
    """The checked shape of ``lowp::grouped_mm``'s bf16 output: ``a`` (T, K) x ``b`` (E, K, N) -> (T, N);
    ``a`` (M, T) x ``b`` (T, N) -> (E, M, N) (groups along the contraction dim T). ``offs`` int32/int64
    (E,) group ends; on the host (CPU, or any device in mode "all", see ``meta.split_sizes``) they must
    be non-decreasing within [0, T]."""
    # One expression for the valid case (each MLP pass runs several GEMMs: their checks are host time).
    b_dim = b.dim()
    valid = (
        a.dim() == 2
        and b_dim in (2, 3)
        and a.dtype == torch.bfloat16
        and b.dtype == torch.bfloat16
        and offs.dim() == 1
        and offs.dtype in _INT_ENDS
        and offs.device == a.device
        and a.shape[1] == b.shape[-2]
        and (b_dim == 2 or offs.shape[0] == b.shape[0])
    )
    if not valid:
        _explain_grouped_mm_args(a, b, offs)
    if b_dim == 3:
        check_group_end_values(offs, a.shape[0])
        return (a.shape[0], b.shape[2])
    check_group_end_values(offs, a.shape[1])
    return (offs.shape[0], a.shape[0], b.shape[1])


_INT_ENDS = (torch.int32, torch.int64)


def _explain_grouped_mm_args(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    """Raise the ValueError that names the first bad argument of :func:`grouped_mm_shape`."""
    require(a.dim() == 2, lambda: f"a must be 2-D, got {a.dim()}-D")
    require(b.dim() in (2, 3), lambda: f"b must be 2-D or 3-D, got {b.dim()}-D")
    require(
        a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16,
        lambda: f"a and b must be bfloat16, got {a.dtype} and {b.dtype}",
    )
    require(
        offs.dim() == 1 and offs.dtype in (torch.int32, torch.int64),
        lambda: f"offs must be a 1-D int32/int64 tensor of group ends, got {offs.dtype} {offs.dim()}-D",
    )
    require(
        offs.device == a.device, lambda: f"offs must be on the device of a, got {offs.device} and {a.device}"
    )
    require(
        a.shape[1] == b.shape[-2],
        lambda: f"a and b must share the contraction dim, got {tuple(a.shape)} and {tuple(b.shape)}",
    )
    require(
        b.dim() == 2 or offs.shape[0] == b.shape[0],
        lambda: f"offs must have one entry per group of b ({b.shape[0]}), got {offs.shape[0]}",
    )


def grouped_mm_output(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    ends_valid: bool = False,
    last_end_is_rows: bool = False,
) -> torch.Tensor:
    """``lowp::grouped_mm``'s output, allocated (:func:`grouped_mm_shape`); the flags change no shape."""
    return a.new_empty(grouped_mm_shape(a, b, offs))


def check_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor, recipe: str, weight_name: str = "weight"
) -> None:
    """x (T, K) bf16, weight (E, N, K) bf16 (``nn.Linear`` layout per expert), K and N multiples of 8;
    split sizes summing to T (multiples of 16 for the NVFP4 recipe), checked on the host where
    ``meta.split_sizes`` says."""
    _check_bf16_matrix(x, "x", 2)
    _check_bf16_matrix(weight, weight_name, 3, x.device)
    require(
        x.shape[1] == weight.shape[2],
        lambda: f"x (T, {x.shape[1]}) and weight (E, N, K={weight.shape[2]}) must share K",
    )
    require(
        x.shape[1] % GEMM_ALIGNMENT == 0 and weight.shape[1] % GEMM_ALIGNMENT == 0,
        lambda: (
            f"in and out features must be multiples of {GEMM_ALIGNMENT} (16-byte rows for the grouped GEMM), "
            f"got {x.shape[1]} and {weight.shape[1]}"
        ),
    )
    check_split_sizes(split_sizes, weight.shape[0], x.device)
    check_recipe(recipe)
    check_nvfp4_out_features(weight, recipe, weight_name)
    # The backward quantizes x column-wise in 16-token blocks: refused here, not after the forward ran.
    require(
        recipe != "nvfp4" or x.shape[0] % NVFP4_SPLIT_MULTIPLE == 0,
        lambda: f"recipe='nvfp4' needs a token count (x's rows) divisible by 16, got {x.shape[0]}",
    )
    multiple = NVFP4_SPLIT_MULTIPLE if recipe == "nvfp4" else 1
    check_split_size_values(split_sizes, x.shape[0], multiple=multiple, why="the nvfp4 recipe")


def expert_sizes_problem(hidden: int, ffn: int, recipe: str) -> str | None:
    """Why experts of ``hidden`` and ``ffn`` sizes cannot run ``recipe`` (None if they can): both are
    multiples of ``GEMM_ALIGNMENT`` (16-byte GEMM rows), hidden of ``NVFP4_SPLIT_MULTIPLE`` for nvfp4 (FC2's
    16x16 weight blocks, :func:`check_nvfp4_out_features`). For callers that refuse before any call: a
    module's constructor, the transformers integration before it patches."""
    multiple = NVFP4_SPLIT_MULTIPLE if recipe == "nvfp4" else GEMM_ALIGNMENT
    if hidden % multiple == 0 and ffn % GEMM_ALIGNMENT == 0:
        return None
    return (
        f"hidden and ffn must be multiples of {GEMM_ALIGNMENT} (hidden of {NVFP4_SPLIT_MULTIPLE} for "
        f"recipe='nvfp4'), got hidden={hidden}, ffn={ffn}"
    )


def check_nvfp4_out_features(weight: torch.Tensor, recipe: str, weight_name: str = "weight") -> None:
    """The NVFP4 recipe quantizes all experts' weights (E, N, K) in one call over their stacked rows, in
    16x16 blocks: N must be a multiple of 16, or a block would span two experts (and the rows past the
    last whole block of the stack were left zero)."""
    require(
        recipe != "nvfp4" or weight.shape[1] % NVFP4_SPLIT_MULTIPLE == 0,
        lambda: (
            f"{weight_name} (E, N, K) needs N a multiple of {NVFP4_SPLIT_MULTIPLE} for recipe='nvfp4' (16x16 "
            f"blocks of each expert's weight), got N={weight.shape[1]}"
        ),
    )


def grouped_linear_output(
    x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor, recipe: str
) -> torch.Tensor:
    """y (T, N) bf16."""
    check_grouped_linear(x, weight, split_sizes, recipe)
    return x.new_empty((x.shape[0], weight.shape[1]))


def grouped_linear_bwd_outputs(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor, recipe: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (T, K), dweight (E, N, K)) bf16 of ``lowp::grouped_linear_bwd``, after
    :func:`check_grouped_linear_bwd`."""
    check_grouped_linear_bwd(grad, x, weight, split_sizes, recipe)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def check_grouped_linear_bwd(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor, recipe: str
) -> None:
    """The forward's arguments (:func:`check_grouped_linear`), then ``grad`` = dy (T, N) like ``x``."""
    check_grouped_linear(x, weight, split_sizes, recipe)
    expected = (x.shape[0], weight.shape[1])
    require(
        grad.dtype == x.dtype and grad.shape == expected,
        lambda: f"grad must be {x.dtype} of shape {expected}, got {grad.dtype} {tuple(grad.shape)}",
    )


def grouped_swiglu_mlp_outputs(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    recipe: str,
    interleave: int,
    fc1_dy_amax_from_dglu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (T, H), c (T, 2F)) bf16 from x (T, H), fc1_weight (E, 2F, H) and fc2_weight (E, H, F), and the
    int32 (2, E) the backward reuses: the GEMMs' group ends with their extended row
    (``group_ends(..., with_extended=True)``) for the bf16 and mxfp8 recipes, the recipe's plan for
    nvfp4 (``composite.grouped_nvfp4.expert_plan``); after :func:`check_grouped_swiglu_mlp`."""
    check_grouped_swiglu_mlp(
        x, fc1_weight, fc2_weight, probs, split_sizes, recipe, interleave, fc1_dy_amax_from_dglu
    )
    ends = split_sizes.new_empty((2, split_sizes.shape[0]), dtype=torch.int32)
    return x.new_empty(x.shape), x.new_empty((x.shape[0], fc1_weight.shape[1])), ends


def grouped_swiglu_mlp_bwd_outputs(
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
    """(dx (T, H), dW1 (E, 2F, H), dW2 (E, H, F) bf16; dprobs (T,) fp32) of ``lowp::grouped_swiglu_mlp_bwd``,
    after :func:`check_grouped_swiglu_mlp_bwd`."""
    check_grouped_swiglu_mlp_bwd(
        grad, x, c, fc1_weight, fc2_weight, probs, split_sizes, ends, recipe, interleave,
        fc1_dy_amax_from_dglu,
    )  # fmt: skip
    dx = x.new_empty(x.shape)
    dprobs = probs.new_empty(probs.shape, dtype=torch.float32)
    return dx, fc1_weight.new_empty(fc1_weight.shape), fc2_weight.new_empty(fc2_weight.shape), dprobs


def check_grouped_swiglu_mlp_bwd(
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
) -> None:
    """The forward's arguments (:func:`check_grouped_swiglu_mlp`), then ``grad`` = dy like ``x`` (T, H)
    and what the forward kept: ``c`` (T, 2F) like ``x``, ``ends`` (2, E) int32."""
    check_grouped_swiglu_mlp(
        x, fc1_weight, fc2_weight, probs, split_sizes, recipe, interleave, fc1_dy_amax_from_dglu
    )
    experts = split_sizes.shape[0]
    require(
        grad.dtype == x.dtype and grad.shape == x.shape,
        lambda: f"grad must be {x.dtype} of shape {tuple(x.shape)}, got {grad.dtype} {tuple(grad.shape)}",
    )
    c_shape = (x.shape[0], fc1_weight.shape[1])
    require(
        c.dtype == x.dtype and tuple(c.shape) == c_shape,
        lambda: f"c must be {x.dtype} of shape {c_shape}, got {c.dtype} {tuple(c.shape)}",
    )
    require(
        ends.dtype == torch.int32 and tuple(ends.shape) == (2, experts),
        lambda: f"ends must be int32 of shape (2, {experts}), got {ends.dtype} {tuple(ends.shape)}",
    )


def check_grouped_swiglu_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    recipe: str,
    interleave: int,
    fc1_dy_amax_from_dglu: bool,
) -> None:
    """The checks of :func:`grouped_swiglu_mlp_outputs`, allocating nothing on x's device (the op's
    implementation runs them before computing its outputs)."""
    check_grouped_linear(x, fc1_weight, split_sizes, recipe, "fc1_weight")
    # c's metadata only: a meta tensor, no memory.
    c = torch.empty((x.shape[0], fc1_weight.shape[1]), dtype=x.dtype, device="meta")
    check_glu_inputs(c, probs, interleave, device=x.device)
    _check_bf16_matrix(fc2_weight, "fc2_weight", 3, x.device)
    require(
        fc2_weight.shape[-1] % GEMM_ALIGNMENT == 0,
        lambda: f"fc2_weight (E, H, F) needs F a multiple of {GEMM_ALIGNMENT}, got {fc2_weight.shape[-1]}",
    )
    expected_fc2 = (fc1_weight.shape[0], x.shape[1], fc1_weight.shape[1] // 2)
    require(
        tuple(fc2_weight.shape) == expected_fc2,
        lambda: (
            f"fc2_weight must have shape {expected_fc2} for fc1_weight {tuple(fc1_weight.shape)}, "
            f"got {tuple(fc2_weight.shape)}"
        ),
    )
    check_nvfp4_out_features(fc2_weight, recipe, "fc2_weight")
    require(
        not fc1_dy_amax_from_dglu or recipe == "nvfp4",
        lambda: f"fc1_dy_amax_from_dglu needs recipe='nvfp4' (it feeds the NVFP4 amaxes), got {recipe!r}",
    )
