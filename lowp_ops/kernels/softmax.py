"""Masked-safe online softmax (Triton): row statistics shared with the cross entropy, and the
softmax / log_softmax / logsumexp forward and backward kernels.

Masked-safe (te_cross_entropy_mxfp8.md D.3): the running sum is rescaled by ``exp(m_old - s)`` with the
shift ``s = 0`` until a finite maximum has been seen, so a row whose first blocks are all ``-inf`` keeps
``d = 0`` instead of turning NaN (``exp(-inf - -inf)``). Finite rows are bit-unchanged (``s = m``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..meta.softmax import logsumexp_output, softmax_bwd_output, softmax_fwd_output

MAX_BLOCK = 4096
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def online_softmax_update(m, d, block):
    """Fold an fp32 block (masked lanes = -inf) into the running max ``m`` and sum ``d = Σ exp(x - m)``.
    Each element costs one FMA and one ``ex2``: ``exp(x - s) = 2^(x log2e - s log2e)``."""
    m_new = tl.maximum(m, tl.max(block, 0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    d = d * tl.exp(m - shift) + tl.sum(tl.exp2(block * LOG2E - shift * LOG2E), 0)
    return m_new, d


@triton.jit
def finish_logsumexp(m, d):
    """``lse = s + log d`` with the masked-safe shift; an all -inf row gives ``-inf`` (d = 0)."""
    return tl.where(m == float("-inf"), 0.0, m) + tl.log(d)


@triton.jit
def row_logsumexp_and_sum(row_ptr, n_cols, BLOCK: tl.constexpr, WITH_SUM: tl.constexpr):
    """(masked-safe log-sum-exp, sum of the values) in fp32 of one row of ``n_cols`` contiguous elements,
    from one pass; the sum (label smoothing needs it) is 0 unless ``WITH_SUM``. Whole blocks load
    without masks; only the tail block is masked."""
    m = float("-inf")
    d = 0.0
    total = 0.0
    n_whole = n_cols - n_cols % BLOCK
    for start in range(0, n_whole, BLOCK):
        block = tl.load(row_ptr + start + tl.arange(0, BLOCK)).to(tl.float32)
        m, d = online_softmax_update(m, d, block)
        if WITH_SUM:
            total += tl.sum(block, 0)
    if n_whole < n_cols:
        cols = n_whole + tl.arange(0, BLOCK)
        block = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m, d = online_softmax_update(m, d, block)
        if WITH_SUM:
            total += tl.sum(tl.where(cols < n_cols, block, 0.0), 0)
    return finish_logsumexp(m, d), total


@triton.jit
def row_logsumexp(row_ptr, n_cols, BLOCK: tl.constexpr):
    """Masked-safe log-sum-exp (fp32) of one row of ``n_cols`` contiguous elements."""
    return row_logsumexp_and_sum(row_ptr, n_cols, BLOCK, False)[0]


@triton.jit
def logsumexp_kernel(x_ptr, stride_row, lse_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(lse_ptr + row, row_logsumexp(x_ptr + row * stride_row, n_cols, BLOCK))


@triton.jit
def softmax_values(x, lse, LOG: tl.constexpr, MASKED_ROWS_ZERO: tl.constexpr):
    """softmax (``exp(x - lse)``) or log_softmax (``x - lse``) of fp32 values given the row's lse."""
    if LOG:  # noqa: SIM108  (a constexpr branch reads better than a ternary in a kernel)
        out = x - lse
    else:
        out = tl.exp(x - lse)
    if MASKED_ROWS_ZERO:
        # An all -inf row (lse = -inf) gives probabilities 0 (log-probabilities -inf) instead of NaN.
        out = tl.where(lse == float("-inf"), float("-inf") if LOG else 0.0, out)
    return out


@triton.jit
def softmax_fwd_kernel(
    x_ptr,
    stride_row,
    out_ptr,
    n_cols,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    LOG: tl.constexpr,
    MASKED_ROWS_ZERO: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_row
    out_row_ptr = out_ptr + row * n_cols
    if ONE_BLOCK:
        # The row fits in one block: one read, statistics and output from registers.
        cols = tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m, d = online_softmax_update(float("-inf"), 0.0, x)
        out = softmax_values(x, finish_logsumexp(m, d), LOG, MASKED_ROWS_ZERO)
        tl.store(out_row_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        lse = row_logsumexp(row_ptr, n_cols, BLOCK)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            out = softmax_values(x, lse, LOG, MASKED_ROWS_ZERO)
            tl.store(out_row_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def softmax_bwd_kernel(out_ptr, grad_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr, LOG: tl.constexpr):
    """softmax: ``dx = y * (dy - Σ dy*y)``; log_softmax: ``dx = dy - exp(y) * Σ dy``. A row whose output
    is all -inf (a masked row under ``masked_rows="zero"``) gets dx = 0."""
    row = tl.program_id(0).to(tl.int64)
    offset = row * n_cols
    total = 0.0
    y_max = float("-inf")
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(out_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            total += tl.sum(dy, 0)
            y_max = tl.maximum(y_max, tl.max(tl.where(mask, y, float("-inf")), 0))
        else:
            total += tl.sum(dy * y, 0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(out_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp(y) * total
            dx = tl.where(y_max == float("-inf"), 0.0, dx)
        else:
            dx = y * (dy - total)
        tl.store(dx_ptr + offset + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def row_block(n_cols: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1)))


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def rows_with_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is unit-stride (rows are read through their stride), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """fp32 masked-safe log-sum-exp of each row of a 2-D ``x``."""
    lse = logsumexp_output(x)
    rows, n_cols = x.shape
    if rows == 0:
        return lse
    x = rows_with_unit_stride(x)
    block = row_block(n_cols)
    logsumexp_kernel[(rows,)](x, x.stride(0), lse, n_cols, BLOCK=block, num_warps=_num_warps(block))
    return lse


def launch_softmax_fwd(x: torch.Tensor, log: bool, masked_rows: str) -> torch.Tensor:
    out = softmax_fwd_output(x, log, masked_rows)
    rows, n_cols = x.shape
    if rows == 0 or n_cols == 0:
        return out
    x = rows_with_unit_stride(x)
    block = row_block(n_cols)
    softmax_fwd_kernel[(rows,)](
        x,
        x.stride(0),
        out,
        n_cols,
        BLOCK=block,
        ONE_BLOCK=n_cols <= block,
        LOG=log,
        MASKED_ROWS_ZERO=masked_rows == "zero",
        num_warps=_num_warps(block),
    )
    return out


def launch_softmax_bwd(out: torch.Tensor, grad: torch.Tensor, log: bool) -> torch.Tensor:
    dx = softmax_bwd_output(out, grad, log)
    rows, n_cols = out.shape
    if rows == 0 or n_cols == 0:
        return dx
    block = row_block(n_cols)
    softmax_bwd_kernel[(rows,)](
        out.contiguous(), grad.contiguous(), dx, n_cols, BLOCK=block, LOG=log, num_warps=_num_warps(block)
    )
    return dx
