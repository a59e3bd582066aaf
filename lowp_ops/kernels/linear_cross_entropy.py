"""LM head + cross entropy on CUDA (or interpreted CPU) tensors: the reference's chunk schedule run with
cuBLAS for the bf16 GEMMs, the Triton cross-entropy kernels and the Triton MXFP8 GEMM.

bf16 GEMMs stay on cuBLAS (fp32 accumulation): ``addmm_`` accumulates ``dweight`` in place with one
rounding per chunk, as the reference specifies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..meta.linear_cross_entropy import scale_by_output
from ..reference.linear_cross_entropy import Steps, backward_chunks, forward_chunks, fwd_bwd_chunks
from .cross_entropy import launch_cross_entropy_bwd, launch_cross_entropy_bwd_mxfp8, launch_cross_entropy_fwd
from .mxfp8 import launch_mxfp8_quantize
from .mxfp8_gemm import mxfp8_gemm_into

SCALE_BLOCK = 4096


def _logits(hidden_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(hidden_c, weight.t())


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _quantize_columnwise(x: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, col_data, col_scale = launch_mxfp8_quantize(x, fp8_dtype, False, True, "compact")
    return col_data, col_scale


KERNEL_STEPS = Steps(
    logits=_logits,
    ce_fwd=launch_cross_entropy_fwd,
    ce_bwd=launch_cross_entropy_bwd,
    ce_bwd_mxfp8=launch_cross_entropy_bwd_mxfp8,
    matmul_into=_matmul_into,
    mxfp8_gemm_into=mxfp8_gemm_into,
    quantize_columnwise=_quantize_columnwise,
)


def launch_linear_cross_entropy_fwd(*args):
    """``lowp::linear_cross_entropy_fwd``."""
    return forward_chunks(*args, steps=KERNEL_STEPS)


def launch_linear_cross_entropy_bwd(*args):
    """``lowp::linear_cross_entropy_bwd``."""
    return backward_chunks(*args, steps=KERNEL_STEPS)


def launch_linear_cross_entropy_fwd_bwd(*args):
    """``lowp::linear_cross_entropy_fwd_bwd``."""
    return fwd_bwd_chunks(*args, steps=KERNEL_STEPS)


@triton.jit
def scale_by_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    tl.store(out_ptr + offsets, (x * scale).to(out_ptr.dtype.element_ty), mask=in_bounds)


def launch_scale_by(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``lowp::scale_by``: one read and one write of ``x``, the scale read on the device."""
    out = scale_by_output(x, scale)
    x = x.contiguous()
    if x.numel():
        scale_by_kernel[(triton.cdiv(x.numel(), SCALE_BLOCK),)](
            x, scale, out, x.numel(), BLOCK=SCALE_BLOCK, num_warps=4
        )
    return out
