"""Triton SwiGLU-times-probs forward and the fused dGLU backward of grouped MoE experts
(docs/grouped_mlp.md#math and #dglu; semantics in ``lowp_ops.reference.swiglu``).

One program owns ``BLOCK_T`` rows and walks the ffn dim in ``BLOCK_F`` chunks, so each row's dprobs
sum stays in registers (deterministic, no atomics) and g and c are read once. The per-expert amax is
an integer ``atomic_max`` on the fp32 bits (the values are ``|d| >= 0``, whose bit patterns order like
the floats; a NaN sorts above Inf and wins, as in the reference). Rows find their expert by comparing
against the effective expert ends (``kernels.split_sizes``), computed in each program from the split
sizes on the device: no host sync, and no sizes can make a row count for an expert it is not in.

fp32 math in the reference's order, one rounding at the store. On the GPU the exponential is
libdevice's ``expf`` (torch's CUDA ``exp``), the division is IEEE (``div_rn``) and kernels launch with
``enable_fp_fusion=False`` (no FMA contraction): the elementwise outputs can then match the reference
run on CUDA bit for bit. Not bit-exact anywhere: dprobs (fp32 sum in a different order than torch's
reduction) and, in the interpreter, ``exp`` (numpy's, which differs from torch's CPU ``exp`` by an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..formats import ceil_div, next_power_of_2
from ..meta.split_sizes import check_split_size_values
from ..meta.swiglu import dglu_outputs, swiglu_fwd_output
from .bf16_pairs import to_dtype_rne
from .launch import INTERPRETING_CONSTEXPR as INTERPRETING
from .launch import PlanCache, cached_launch, tensor_key
from .nvfp4_math import max_keep_nan, maximum_keep_nan
from .split_sizes import effective_bounds, expert_of_rows


@triton.jit
def exp_like_torch(x):
    """``expf`` as torch's CUDA kernels compute it (libdevice); numpy's ``exp`` in the interpreter."""
    if INTERPRETING:  # noqa: SIM108 (a constexpr branch: the other one is never compiled)
        result = tl.exp(x)
    else:
        result = libdevice.exp(x)
    return result


@triton.jit
def sigmoid(x):
    """``1 / (1 + exp(-x))`` with an IEEE division, as the reference writes it."""
    return tl.math.div_rn(1.0, 1.0 + exp_like_torch(-x))


@triton.jit
def glu_columns(ffn_idx, ffn, INTERLEAVE: tl.constexpr):
    """Columns of c holding gate and linear channel ``ffn_idx``: [gate | linear] halves, or alternating
    INTERLEAVE-wide blocks."""
    if INTERLEAVE == 0:
        gate_col = ffn_idx
        linear_col = ffn_idx + ffn
    else:
        gate_col = (ffn_idx // INTERLEAVE) * (2 * INTERLEAVE) + ffn_idx % INTERLEAVE
        linear_col = gate_col + INTERLEAVE
    return gate_col, linear_col


@cached_launch
@triton.jit
def swiglu_fwd_kernel(
    c_ptr,
    probs_ptr,
    out_ptr,
    ends_ptr,
    last_group,
    tokens,
    ffn,
    stride_c,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    EVEN: tl.constexpr,
    MASK_ROWS: tl.constexpr,
):
    """h[t, f] = gate * sigmoid(gate) * linear * p[t], one [BLOCK_T, BLOCK_F] tile per program; with
    ``MASK_ROWS``, rows at or past ``ends[last_group]`` get +0."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ffn_idx = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    gate_col, linear_col = glu_columns(ffn_idx, ffn, INTERLEAVE)
    c_row = c_ptr + rows[:, None].to(tl.int64) * stride_c
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * ffn + ffn_idx[None, :]
    # Upcast right after every load (bf16 math is wrong in the interpreter).
    if EVEN:
        gate = tl.load(c_row + gate_col[None, :]).to(tl.float32)
        linear = tl.load(c_row + linear_col[None, :]).to(tl.float32)
        prob = tl.load(probs_ptr + rows).to(tl.float32)
    else:
        mask = (rows[:, None] < tokens) & (ffn_idx[None, :] < ffn)
        gate = tl.load(c_row + gate_col[None, :], mask=mask, other=0.0).to(tl.float32)
        linear = tl.load(c_row + linear_col[None, :], mask=mask, other=0.0).to(tl.float32)
        prob = tl.load(probs_ptr + rows, mask=rows < tokens, other=0.0).to(tl.float32)
    h = gate * sigmoid(gate) * linear * prob[:, None]
    if MASK_ROWS:
        h = tl.where(rows[:, None] < tl.load(ends_ptr + last_group), h, 0.0)
    h = to_dtype_rne(h, out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(out_ptrs, h)
    else:
        tl.store(out_ptrs, h, mask=mask)


@cached_launch
@triton.jit
def dglu_kernel(
    grad_ptr,
    c_ptr,
    probs_ptr,
    split_ptr,
    dc_ptr,
    dprobs_ptr,
    amax_bits_ptr,
    tokens,
    ffn,
    experts,
    stride_grad,
    stride_c,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    EVEN: tl.constexpr,
):
    """dc, dprobs and the per-expert amax of BLOCK_T rows from one read of grad and c; rows of no expert
    (past the last effective end) get zeros, whatever grad and c hold there."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    # The ends' padding lanes lie past every row (expert_of_rows).
    expert_idx = tl.arange(0, EXPERTS_POW2)
    _, ends = effective_bounds(split_ptr, experts, tokens, EXPERTS_POW2, 1)
    ends = tl.where(expert_idx < experts, ends, tokens)
    expert = expert_of_rows(ends, rows)
    owned = expert < experts
    live = owned[:, None]
    if EVEN:
        prob = tl.load(probs_ptr + rows).to(tl.float32)
    else:
        prob = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    prob = tl.where(owned, prob, 0.0)
    grad_row = grad_ptr + rows[:, None].to(tl.int64) * stride_grad
    c_row = c_ptr + rows[:, None].to(tl.int64) * stride_c
    dc_row = dc_ptr + rows[:, None].to(tl.int64) * (2 * ffn)
    dprob = tl.zeros([BLOCK_T], dtype=tl.float32)
    row_amax = tl.zeros([BLOCK_T], dtype=tl.float32)
    for ffn0 in range(0, ffn, BLOCK_F):
        ffn_idx = ffn0 + tl.arange(0, BLOCK_F)
        gate_col, linear_col = glu_columns(ffn_idx, ffn, INTERLEAVE)
        if EVEN:
            g = tl.load(grad_row + ffn_idx[None, :]).to(tl.float32)
            gate = tl.load(c_row + gate_col[None, :]).to(tl.float32)
            linear = tl.load(c_row + linear_col[None, :]).to(tl.float32)
        else:
            mask = row_ok[:, None] & (ffn_idx[None, :] < ffn)
            g = tl.load(grad_row + ffn_idx[None, :], mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(c_row + gate_col[None, :], mask=mask, other=0.0).to(tl.float32)
            linear = tl.load(c_row + linear_col[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.where(live, g, 0.0)
        gate = tl.where(live, gate, 0.0)
        linear = tl.where(live, linear, 0.0)
        sig = sigmoid(gate)
        swish = gate * sig
        dprob += tl.sum(g * swish * linear, axis=1)
        scaled = g * prob[:, None]
        d_gate = scaled * linear * sig * (1.0 + gate * (1.0 - sig))
        d_linear = scaled * swish
        # Masked lanes hold zeros, so they never raise the amax.
        tile_amax = max_keep_nan(maximum_keep_nan(tl.abs(d_gate), tl.abs(d_linear)), 1)
        row_amax = maximum_keep_nan(row_amax, tile_amax)
        d_gate = to_dtype_rne(d_gate, dc_ptr.dtype.element_ty)
        d_linear = to_dtype_rne(d_linear, dc_ptr.dtype.element_ty)
        if EVEN:
            tl.store(dc_row + gate_col[None, :], d_gate)
            tl.store(dc_row + linear_col[None, :], d_linear)
        else:
            tl.store(dc_row + gate_col[None, :], d_gate, mask=mask)
            tl.store(dc_row + linear_col[None, :], d_linear, mask=mask)
    tl.store(dprobs_ptr + rows, dprob, mask=row_ok)
    tl.atomic_max(
        amax_bits_ptr + expert, row_amax.to(tl.int32, bitcast=True), mask=row_ok & owned, sem="relaxed"
    )


def _block_cols(ffn: int, widest: int) -> int:
    return max(32, min(widest, next_power_of_2(ffn)))


def launch_swiglu_fwd(
    c: torch.Tensor,
    probs: torch.Tensor,
    interleave: int,
    ends: torch.Tensor | None = None,
    block_rows: int = 8,
    block_cols: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """``lowp::swiglu_fwd`` on a CUDA (or interpreted CPU) tensor; rows read through their stride. From a
    plan per specialization (:data:`_PLANS`)."""
    key = ("fwd", c.shape, c.stride(), c.dtype, c.device, tensor_key(probs), interleave, tensor_key(ends))
    key += (block_rows, block_cols, num_warps)
    args = (c, probs, interleave, ends, block_rows, block_cols, num_warps)
    return _PLANS.get(key, _swiglu_fwd_plan, *args)(c, probs, ends)


# The launchers' plans, one per specialization (shapes, strides, dtypes, devices, options): the checks of
# the layouts, the grids and the constexprs depend on nothing else. Split-size values, where checked on
# the host (meta.split_sizes), are checked on every call.
_PLANS = PlanCache()


def _swiglu_fwd_plan(c, probs, interleave, ends, block_rows, block_cols, num_warps):
    shape = swiglu_fwd_output(c, probs, interleave, ends).shape  # the checks
    tokens, ffn = shape
    if tokens == 0:
        return lambda c, probs, ends: c.new_empty(shape)
    copy = c.stride(1) != 1  # rows_with_unit_stride
    c_stride = c.shape[1] if copy else c.stride(0)
    copy_probs = not probs.is_contiguous()
    block_cols = block_cols or _block_cols(ffn, 256)
    last_group = 0 if ends is None else ends.shape[0] - 1
    copy_ends = ends is not None and not ends.is_contiguous()  # the kernel reads ends[last] at unit stride
    launch = swiglu_fwd_kernel.bind(
        (ceil_div(tokens, block_rows), ceil_div(ffn, block_cols)),
        BLOCK_T=block_rows,
        BLOCK_F=block_cols,
        INTERLEAVE=interleave,
        EVEN=tokens % block_rows == 0 and ffn % block_cols == 0,
        MASK_ROWS=ends is not None,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )

    def call(c, probs, ends):
        out = c.new_empty(shape)
        c = c.contiguous() if copy else c
        probs = probs.contiguous() if copy_probs else probs
        ends = out if ends is None else ends.contiguous() if copy_ends else ends
        launch(c, probs, out, ends, last_group, tokens, ffn, c_stride)
        return out

    return call


def dglu_config(tokens: int, ffn: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_F, num_warps) of the dGLU kernel. H200, T=16384 F=1536 bf16, CUDA-graph GPU time
    (% of copy): 8 rows x 256 cols on 8 warps 0.0738 ms (80%), on 4 warps 77%, 16 x 256 / 8 77%;
    splitting the ffn dim over programs (partial dprobs summed afterwards) 69-70%."""
    return 8, _block_cols(ffn, 256), 8


def launch_dglu(
    grad: torch.Tensor,
    c: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    interleave: int,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lowp::dglu`` on a CUDA (or interpreted CPU) tensor. ``config`` = (BLOCK_T, BLOCK_F, num_warps)
    overrides :func:`dglu_config` (benchmarks, tests). From a plan per specialization (:data:`_PLANS`)."""
    key = ("dglu", grad.shape, grad.stride(), grad.dtype, grad.device, c.shape, c.stride(), c.dtype)
    key += (tensor_key(probs), tensor_key(split_sizes), interleave, config)
    plan = _PLANS.get(key, _dglu_plan, grad, c, probs, split_sizes, interleave, config)
    check_split_size_values(split_sizes, c.shape[0], total="at_most")  # values: every call
    return plan(grad, c, probs, split_sizes)


def _dglu_plan(grad, c, probs, split_sizes, interleave, config):
    dglu_outputs(grad, c, probs, split_sizes, interleave)  # the checks
    tokens, ffn = grad.shape
    experts = split_sizes.shape[0]

    def outputs(c):
        dc = c.new_empty(c.shape)
        dprobs = c.new_empty((tokens,), dtype=torch.float32)
        return dc, dprobs, c.new_zeros((experts,), dtype=torch.float32)  # the amaxes' accumulators

    if tokens == 0:
        return lambda grad, c, probs, split_sizes: outputs(c)
    block_rows, block_cols, num_warps = config or dglu_config(tokens, ffn)
    copy_grad, copy_c = grad.stride(1) != 1, c.stride(1) != 1  # rows_with_unit_stride
    grad_stride = ffn if copy_grad else grad.stride(0)
    c_stride = c.shape[1] if copy_c else c.stride(0)
    copy_probs, copy_sizes = not probs.is_contiguous(), not split_sizes.is_contiguous()
    launch = dglu_kernel.bind(
        (ceil_div(tokens, block_rows),),
        BLOCK_T=block_rows,
        BLOCK_F=block_cols,
        EXPERTS_POW2=max(2, next_power_of_2(experts)),
        INTERLEAVE=interleave,
        EVEN=tokens % block_rows == 0 and ffn % block_cols == 0,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )

    def call(grad, c, probs, split_sizes):
        dc, dprobs, amax = outputs(c)
        launch(
            grad.contiguous() if copy_grad else grad,
            c.contiguous() if copy_c else c,
            probs.contiguous() if copy_probs else probs,
            split_sizes.contiguous() if copy_sizes else split_sizes,
            dc,
            dprobs,
            amax.view(torch.int32),
            tokens,
            ffn,
            experts,
            grad_stride,
            c_stride,
        )
        return dc, dprobs, amax

    return call
