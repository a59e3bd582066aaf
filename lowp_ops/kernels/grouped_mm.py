"""CUDA grouped GEMM: ``torch._grouped_mm`` (CUTLASS on sm90/sm100, bf16 in and out, fp32 accumulation,
no host sync), fed only what it accepts, so that no input can trip its device-side assertions:

- group ends made valid on the device first (``meta.split_sizes``: non-decreasing, within [0, T]; one
  small kernel), so no group has a negative size;
- operand layouts with no condition on the group sizes: for (T, K) x (E, K, N) a row-major ``a``; for
  (M, T) x (T, N) a column-major ``a`` and a row-major ``b`` (the other layouts need every group to be a
  multiple of 8 rows, and non-empty in some torch versions). Another layout is copied once;
- rows of a (T, K) x (E, K, N) product past the last end (``torch._grouped_mm`` leaves them unwritten)
  zeroed by a kernel whose programs return at once when there are none; none are when the caller
  passes ends whose last is the row count (``last_end_is_rows``, the extended row of ``group_ends``),
  and then nothing is launched.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats import ceil_div, next_power_of_2
from ..meta.grouped_mm import GEMM_ALIGNMENT, grouped_mm_shape
from .launch import cached_launch
from .split_sizes import launch_valid_group_ends


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last two dims are row-major with a 16-byte aligned leading stride and start (what the
    TMA descriptors need), else a contiguous copy."""
    rows_stride = t.stride(-2)
    aligned = t.data_ptr() % 16 == 0 and rows_stride % GEMM_ALIGNMENT == 0
    if t.stride(-1) == 1 and aligned and rows_stride >= max(1, t.shape[-1]):
        return t
    return t.contiguous()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """2-D ``t`` as a column-major matrix (the transpose of a row-major one), copied when it is not."""
    return _row_major(t.t()).t()


def _gemm_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last two dims are row- or column-major with 16-byte aligned leading stride and a
    16-byte aligned start, else a contiguous copy."""
    rows_stride, cols_stride = t.stride(-2), t.stride(-1)
    col_major = rows_stride == 1 and cols_stride % GEMM_ALIGNMENT == 0 and cols_stride >= max(1, t.shape[-2])
    if t.data_ptr() % 16 == 0 and col_major:
        return t
    return _row_major(t)


@cached_launch
@triton.jit
def zero_rows_past_kernel(
    out_ptr, ends_ptr, last_group, rows, cols, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
):
    """Zero the rows of ``out`` at or past ``ends[last_group]``; programs of rows below it do nothing."""
    row0 = tl.program_id(0) * BLOCK_ROWS
    end = tl.load(ends_ptr + last_group)
    if row0 + BLOCK_ROWS > end:
        row_idx = row0 + tl.arange(0, BLOCK_ROWS)
        rows_ok = (row_idx >= end) & (row_idx < rows)
        row_ptrs = out_ptr + row_idx[:, None].to(tl.int64) * stride_row
        zeros = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=out_ptr.dtype.element_ty)
        for col0 in range(0, cols, BLOCK_COLS):
            col_idx = col0 + tl.arange(0, BLOCK_COLS)
            tl.store(row_ptrs + col_idx[None, :], zeros, mask=rows_ok[:, None] & (col_idx < cols)[None, :])


def zero_rows_past(out: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``out`` (T, N) with the rows at or past ``ends[-1]`` (device int32) set to 0, in place."""
    rows, cols = out.shape
    block_rows = 16
    block_cols = max(16, min(256, next_power_of_2(cols)))
    grid = (ceil_div(rows, block_rows),)
    zero_rows_past_kernel[grid](
        out, ends, ends.shape[0] - 1, rows, cols, out.stride(0), BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols
    )
    return out


def launch_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    ends_valid: bool = False,
    last_end_is_rows: bool = False,
) -> torch.Tensor:
    """``lowp::grouped_mm`` on CUDA tensors (CPU tensors in the interpreter suite use the same call).
    ``ends_valid``: int32 ``offs`` from ``lowp::group_ends`` are used as they are (no validating launch);
    other ``offs`` are always made valid first. ``last_end_is_rows``: the caller promises that the last
    end is the row count (the extended row of ``group_ends``), so no zeroing launch runs; rows past a
    smaller last end would be left unwritten."""
    shape = grouped_mm_shape(a, b, offs)  # torch._grouped_mm allocates the output itself
    rows_grouped = b.dim() == 3
    if math.prod(shape) == 0 or a.shape[1] == 0 or offs.shape[0] == 0:
        # No contraction, or no group: torch._grouped_mm rejects a zero-width operand or zero groups.
        return a.new_zeros(shape)
    if ends_valid and offs.dtype == torch.int32:
        ends = offs if offs.is_contiguous() else offs.contiguous()  # zero_rows_past reads them at unit stride
    else:
        ends = launch_valid_group_ends(offs, a.shape[0] if rows_grouped else a.shape[1])
    if rows_grouped:
        gemm = torch._grouped_mm(_row_major(a), _gemm_ready(b), ends)
        return gemm if last_end_is_rows else zero_rows_past(gemm, ends)
    return torch._grouped_mm(_column_major(a), _row_major(b), ends)
