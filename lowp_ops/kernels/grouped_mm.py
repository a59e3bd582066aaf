"""CUDA grouped GEMM: ``torch._grouped_mm`` (CUTLASS on sm90/sm100, bf16 in and out, fp32 accumulation,
no host sync), with the operand layouts it accepts."""

from __future__ import annotations

import torch

from ..meta.grouped_mlp import GEMM_ALIGNMENT, grouped_mm_output


def _gemm_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last two dims are row- or column-major with 16-byte aligned leading stride and a
    16-byte aligned start (what the TMA descriptors need), else a contiguous copy."""
    rows_stride, cols_stride = t.stride(-2), t.stride(-1)
    row_major = cols_stride == 1 and rows_stride % GEMM_ALIGNMENT == 0 and rows_stride >= max(1, t.shape[-1])
    col_major = rows_stride == 1 and cols_stride % GEMM_ALIGNMENT == 0 and cols_stride >= max(1, t.shape[-2])
    if t.data_ptr() % 16 == 0 and (row_major or col_major):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def launch_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``lowp::grouped_mm`` on CUDA tensors (CPU tensors in the interpreter suite use the same call)."""
    out = grouped_mm_output(a, b, offs)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        # No tokens at all: torch._grouped_mm rejects every stride of a zero-width operand.
        return out.zero_()
    return torch._grouped_mm(_gemm_ready(a), _gemm_ready(b), offs)
