"""Triton RMSNorm forward and backward (semantics and math: ``lowp_ops.reference.rms_norm``).

Forward: a program normalizes ``BLOCK_ROWS`` whole rows held in registers (one read of x, one write of
y, the fp32 ``rstd`` kept for the backward). Backward: a persistent grid (one program per SM, loads
pipelined across loop iterations: :func:`bwd_config`) walks the rows; each program keeps its partial
``Σ g n`` of the weight gradient in fp32 registers and writes it once, and a second launch sums the
partials in a fixed order (deterministic, no atomics).
fp32 math, one rounding to nearest even at each store.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..formats import ceil_div, next_power_of_2
from ..meta.rms_norm import rms_norm_bwd_outputs, rms_norm_fwd_outputs
from .bf16_pairs import to_dtype_rne
from .launch import INTERPRETING, PlanCache, cached_launch, tensor_key

ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def normalized(x, rstd, ROUND_NORMALIZED: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 ``(xhat, n)``: ``n`` is ``xhat`` rounded to ``DTYPE`` when ROUND_NORMALIZED."""
    xhat = x * rstd[:, None]
    if ROUND_NORMALIZED:  # noqa: SIM108 (a constexpr branch: the other one is never compiled)
        n = to_dtype_rne(xhat, DTYPE).to(tl.float32)
    else:
        n = xhat
    return xhat, n


@cached_launch
@triton.jit
def rms_norm_fwd_kernel(
    x_ptr,
    weight_ptr,
    y_ptr,
    rstd_ptr,
    rows,
    hidden,
    stride_x,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND_NORMALIZED: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_H)
    row_in = row < rows
    mask = row_in[:, None] & (col < hidden)[None, :]
    row_64 = row.to(tl.int64)[:, None]
    x = tl.load(x_ptr + row_64 * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, 1) / hidden + eps))
    _, n = normalized(x, rstd, ROUND_NORMALIZED, y_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + col, mask=col < hidden, other=0.0).to(tl.float32)
    y = to_dtype_rne(w[None, :] * n, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row_64 * hidden + col[None, :], y, mask=mask)
    tl.store(rstd_ptr + row, rstd, mask=row_in)


@cached_launch
@triton.jit
def rms_norm_bwd_kernel(
    grad_ptr,
    x_ptr,
    weight_ptr,
    rstd_ptr,
    dx_ptr,
    partial_ptr,
    rows,
    hidden,
    stride_grad,
    stride_x,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND_NORMALIZED: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """dx of every row this program visits, and its partial weight gradient ``partial[program]``."""
    program = tl.program_id(0)
    col = tl.arange(0, BLOCK_H)
    col_in = col < hidden
    w = tl.load(weight_ptr + col, mask=col_in, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in tl.range(program * BLOCK_ROWS, rows, tl.num_programs(0) * BLOCK_ROWS, num_stages=NUM_STAGES):
        row = start + tl.arange(0, BLOCK_ROWS)
        row_in = row < rows
        mask = row_in[:, None] & col_in[None, :]
        row_64 = row.to(tl.int64)[:, None]
        g = tl.load(grad_ptr + row_64 * stride_grad + col[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row_64 * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row_in, other=0.0)
        xhat, n = normalized(x, rstd, ROUND_NORMALIZED, dx_ptr.dtype.element_ty)
        dw += tl.sum(g * n, 0)
        dn = g * w[None, :]
        mean_dot = tl.sum(dn * xhat, 1) / hidden
        dx = rstd[:, None] * (dn - xhat * mean_dot[:, None])
        dx = to_dtype_rne(dx, dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + row_64 * hidden + col[None, :], dx, mask=mask)
    tl.store(partial_ptr + program * hidden + col, dw, mask=col_in)


@cached_launch
@triton.jit
def sum_partials_kernel(partial_ptr, out_ptr, programs, hidden, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[c] = Σ_p partial[p, c]`` in fp32, programs summed in a fixed order, rounded once."""
    col = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < programs)[:, None] & (col < hidden)[None, :]
        total += tl.sum(tl.load(partial_ptr + p[:, None] * hidden + col[None, :], mask=mask, other=0.0), 0)
    tl.store(out_ptr + col, to_dtype_rne(total, out_ptr.dtype.element_ty), mask=col < hidden)


def row_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_H, num_warps): whole rows, about ELEMENTS_PER_PROGRAM elements a program."""
    block_h = next_power_of_2(hidden)
    block_rows = max(1, ELEMENTS_PER_PROGRAM // block_h)
    num_warps = min(16, max(4, block_rows * block_h // 512))
    return block_rows, block_h, num_warps


BWD_ELEMENTS_PER_ITERATION = 8192


def bwd_config(hidden: int) -> tuple[int, int, int, int]:
    """(BLOCK_ROWS, num_warps, programs per SM, NUM_STAGES) of the backward: ~8192 elements per loop
    iteration on 8 warps, one program per SM, the next iterations' loads pipelined three deep (rows wider
    than 8192 elements: 16 warps, no pipelining, whose buffers would not fit in shared memory).
    H200, bf16, CUDA-graph GPU time of this kernel and the partial sums, 2026-12-01 (``python
    benchmarks/bench_rms_norm.py --sweep``): 16384 x 4096 0.1067 ms, 88.5% of copy (two programs per SM
    without pipelining: 83.6%); 4096 x 2048 0.0239 ms, 49.3% (too few rows to fill the GPU for long)."""
    block_h = next_power_of_2(hidden)
    block_rows = max(1, BWD_ELEMENTS_PER_ITERATION // block_h)
    pipelined = block_rows * block_h <= BWD_ELEMENTS_PER_ITERATION
    return block_rows, 8 if pipelined else 16, 1, 3 if pipelined else 1


@functools.cache
def _multiprocessors(device_index: int) -> int:
    """The GPU's SM count; 2 under the interpreter (CPU tensors: a small persistent grid)."""
    if INTERPRETING:
        return 2
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::rms_norm_fwd`` on a CUDA (or interpreted CPU) tensor; rows read through their stride. From
    a plan per specialization (:data:`_PLANS`)."""
    key = ("fwd", x.shape, x.stride(), x.dtype, x.device, tensor_key(weight), eps, round_normalized)
    return _PLANS.get(key, _fwd_plan, x, weight, eps, round_normalized)(x, weight)


def launch_rms_norm_bwd(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    round_normalized: bool,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::rms_norm_bwd`` on a CUDA (or interpreted CPU) tensor. ``config`` overrides
    :func:`bwd_config` (benchmarks, tests). From a plan per specialization (:data:`_PLANS`)."""
    key = ("bwd", grad.shape, grad.stride(), grad.dtype, grad.device, x.shape, x.stride(), x.dtype)
    key += (tensor_key(weight), tensor_key(rstd), round_normalized, config)
    return _PLANS.get(key, _bwd_plan, grad, x, weight, rstd, round_normalized, config)(grad, x, weight, rstd)


# The launchers' plans, one per specialization (shapes, strides, dtypes, devices, options): the checks,
# grids and constexprs depend on nothing else, so a call only allocates and launches.
_PLANS = PlanCache()


def _fwd_plan(x, weight, eps, round_normalized):
    rms_norm_fwd_outputs(x, weight, eps, round_normalized)  # the checks
    rows, hidden = x.shape
    shape = x.shape

    def outputs(x):
        return x.new_empty(shape), x.new_empty((rows,), dtype=torch.float32)

    if rows == 0:
        return lambda x, weight: outputs(x)
    copy = x.stride(1) != 1  # rows_with_unit_stride
    x_stride = hidden if copy else x.stride(0)
    copy_weight = not weight.is_contiguous()
    block_rows, block_h, num_warps = row_config(hidden)
    launch = rms_norm_fwd_kernel.bind(
        (ceil_div(rows, block_rows),),
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        ROUND_NORMALIZED=round_normalized,
        num_warps=num_warps,
    )

    def call(x, weight):
        y, rstd = outputs(x)
        x = x.contiguous() if copy else x
        launch(x, weight.contiguous() if copy_weight else weight, y, rstd, rows, hidden, x_stride, eps)
        return y, rstd

    return call


def _bwd_plan(grad, x, weight, rstd, round_normalized, config):
    rms_norm_bwd_outputs(grad, x, weight, rstd, round_normalized)  # the checks
    rows, hidden = x.shape
    shape, weight_shape = x.shape, weight.shape

    def outputs(x, weight):
        return x.new_empty(shape), weight.new_empty(weight_shape)

    if rows == 0:

        def no_rows(grad, x, weight, rstd):
            dx, dweight = outputs(x, weight)
            return dx, dweight.zero_()

        return no_rows
    copy_grad, copy_x = grad.stride(1) != 1, x.stride(1) != 1  # rows_with_unit_stride
    grad_stride = hidden if copy_grad else grad.stride(0)
    x_stride = hidden if copy_x else x.stride(0)
    copy_weight, copy_rstd = not weight.is_contiguous(), not rstd.is_contiguous()
    block_rows, num_warps, programs_per_sm, num_stages = config or bwd_config(hidden)
    block_h = next_power_of_2(hidden)
    programs = min(ceil_div(rows, block_rows), programs_per_sm * _multiprocessors(x.device.index or 0))
    launch = rms_norm_bwd_kernel.bind(
        (programs,),
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        ROUND_NORMALIZED=round_normalized,
        NUM_STAGES=num_stages,
        num_warps=num_warps,
    )
    block_cols = min(256, block_h)
    sum_launch = sum_partials_kernel.bind(
        (ceil_div(hidden, block_cols),), BLOCK_P=32, BLOCK_H=block_cols, num_warps=4
    )

    def call(grad, x, weight, rstd):
        dx, dweight = outputs(x, weight)
        partial = x.new_empty((programs, hidden), dtype=torch.float32)
        launch(
            grad.contiguous() if copy_grad else grad,
            x.contiguous() if copy_x else x,
            weight.contiguous() if copy_weight else weight,
            rstd.contiguous() if copy_rstd else rstd,
            dx,
            partial,
            rows,
            hidden,
            grad_stride,
            x_stride,
        )
        sum_launch(partial, dweight, programs, hidden)
        return dx, dweight

    return call
