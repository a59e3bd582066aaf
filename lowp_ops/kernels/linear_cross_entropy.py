"""LM head + cross entropy on CUDA (or interpreted CPU) tensors: the reference's chunk schedule run with
cuBLAS for the bf16 GEMMs, the Triton cross-entropy kernels, and for the MXFP8 gradient either the
Triton MXFP8 GEMM or (sm90, where it is faster) a dequantize to bf16 followed by cuBLAS.

bf16 GEMMs stay on cuBLAS (fp32 accumulation): ``addmm_`` accumulates ``dweight`` in place with one
rounding per chunk, as the reference specifies.

The reduced bf16-gradient loss with the automatic chunk and ``N <= H`` takes another schedule,
:func:`fwd_bwd_in_gradient_buffer`: the logits live inside ``dweight``'s own storage (``V x N`` fits in
``V x H``) until the wgrad GEMM overwrites them chunk by chunk, so no token chunking and no ``dweight``
accumulation are needed, and the peak is ``dweight + dhidden + 3072 x N`` elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import ceil_div
from ..meta import linear_cross_entropy as lce_meta
from ..meta.linear_cross_entropy import check_scale_by_args
from ..reference.linear_cross_entropy import Steps, backward_chunks, forward_chunks, fwd_bwd_chunks, scale_by_
from .bf16_pairs import to_dtype_rne
from .cross_entropy import launch_cross_entropy_bwd, launch_cross_entropy_bwd_mxfp8, launch_cross_entropy_fwd
from .cross_entropy_columns import column_cross_entropy_bwd_in_place, column_cross_entropy_fwd
from .cross_entropy_single_pass import launch_cross_entropy_rows_fwd_bwd_
from .launch import PlanCache, cached_launch
from .mxfp8 import launch_mxfp8_dequantize, launch_mxfp8_quantize
from .mxfp8_gemm import mxfp8_gemm_into

SCALE_BLOCK = 4096
LOGITS_OUTSIDE_ROWS = 3072
"""Vocabulary rows of ``logits^T`` kept in a buffer of their own by the in-gradient schedule; also the
rows of each wgrad GEMM (fewer, larger GEMMs: H200, N = H = 4096, V = 129280, 2048 rows: 20.70 ms per
step; 3072: 20.39). 3072 x N bf16 is 24 MiB at N = 4096."""


def _logits(hidden_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(hidden_c, weight.t())


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def dequantize_then_mm_into(
    out, a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, accumulate, scratch=None
) -> None:
    """``out = bf16(op(A) @ B [+ out])`` through bf16 copies of the MXFP8 operands and cuBLAS. The copies
    are exact (an FP8 value times a power of two fits bf16 unless it falls below 2^-133), products
    accumulate in fp32 and round once: the Triton MXFP8 GEMM's numerics, up to summation order.
    ``scratch``: a dead bf16 buffer of A's shape (the chunk's logits) to dequantize A into."""
    fits = scratch is not None and scratch.shape == a_data.shape and scratch.dtype == torch.bfloat16
    a = launch_mxfp8_dequantize(
        a_data, a_scale, a_fp8_dtype, a_use, "compact", torch.bfloat16, out=scratch if fits else None
    )
    a = a.t() if a_use == "columnwise" else a
    if b_scale is not None:
        b = launch_mxfp8_dequantize(b, b_scale, b_fp8_dtype, "columnwise", "compact", torch.bfloat16)
    _matmul_into(out, a, b, accumulate)


def _cublas_after_dequantize_is_faster(out: torch.Tensor, b: torch.Tensor, b_scale) -> bool:
    """On GPUs without block-scaled tensor cores (sm90), dequantize + cuBLAS beat every Triton MXFP8
    GEMM variant measured on the H200 (2048 x 129280 x 4096 chunk: dgrad 3.23 ms against 5.48,
    wgrad 3.27 against 8.90; cuBLAS bf16 alone 2.96 / 3.21); bf16 results only."""
    if not out.is_cuda or out.dtype != torch.bfloat16 or (b_scale is None and b.dtype != torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(out.device)[0] < 10


def _mxfp8_gemm_into(
    out, a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, accumulate, scratch=None
) -> None:
    args = (out, a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, accumulate)
    if _cublas_after_dequantize_is_faster(out, b, b_scale):
        dequantize_then_mm_into(*args, scratch=scratch)
    else:
        mxfp8_gemm_into(*args)


def _quantize_columnwise(x: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, col_data, col_scale = launch_mxfp8_quantize(x, fp8_dtype, False, True, "compact")
    return col_data, col_scale


def cross_entropy_bwd_in_place(logits, target, stats, grad_rows, label_smoothing, ignore_index, *vocab):
    """The bf16 cross-entropy backward written over the chunk's own logits (no second C x V buffer)."""
    return launch_cross_entropy_bwd(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, *vocab, out=logits.contiguous()
    )


KERNEL_STEPS = Steps(
    logits=_logits,
    ce_fwd=launch_cross_entropy_fwd,
    ce_bwd=cross_entropy_bwd_in_place,
    ce_bwd_mxfp8=launch_cross_entropy_bwd_mxfp8,
    ce_fwd_bwd=launch_cross_entropy_rows_fwd_bwd_,
    matmul_into=_matmul_into,
    mxfp8_gemm_into=_mxfp8_gemm_into,
    quantize_columnwise=_quantize_columnwise,
)


def launch_linear_cross_entropy_fwd(*args):
    """``lowp::linear_cross_entropy_fwd``."""
    return forward_chunks(*args, steps=KERNEL_STEPS)


def launch_linear_cross_entropy_bwd(*args):
    """``lowp::linear_cross_entropy_bwd``."""
    return backward_chunks(*args, steps=KERNEL_STEPS)


def _has_features(z_loss: float = 0.0, softcap: float = 0.0, ce_weight: torch.Tensor | None = None) -> bool:
    """Whether a loss feature or class weights are on (the trailing arguments of the LM-head ops)."""
    return z_loss != 0.0 or softcap != 0.0 or ce_weight is not None


def in_gradient_buffer_applies(hidden, vocab, grad_format, chunk_size, compute_dweight, features=()) -> bool:
    """Whether :func:`fwd_bwd_in_gradient_buffer` serves a ``linear_cross_entropy_fwd_bwd`` call: bf16
    (input-dtype) gradient, automatic chunk, ``dweight`` wanted, ``0 < N <= H`` so that the logits fit
    in ``dweight``'s storage, at least ``IN_GRADIENT_MIN_LOGITS`` logits (``N · vocab``; fewer take one
    chunk, faster), and no loss feature and no class weights (``features``: ``z_loss, softcap,
    ce_weight``; the column kernels, which read the logits along tokens, take none of them: the chunk
    schedule serves those calls with the row kernels, which do)."""
    n_tokens = hidden.shape[0]
    return (
        not _has_features(*features)
        and grad_format == "none"
        and chunk_size == 0
        and compute_dweight
        and 0 < n_tokens <= hidden.shape[1]
        and n_tokens * vocab >= lce_meta.IN_GRADIENT_MIN_LOGITS
    )


def fwd_bwd_in_gradient_buffer(
    hidden, weight, target, row_weight, label_smoothing, ignore_index, compute_dhidden
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lowp::linear_cross_entropy_fwd_bwd`` (bf16 gradient) with the logits inside ``dweight``.

    ``logits^T (V, N)`` is computed by cuBLAS in two pieces: the last ``R = min(V, 3072)`` vocabulary rows
    in a buffer of their own, the first ``V - R`` at the end of ``dweight``'s storage, contiguous with row
    stride ``N``. The cross entropy reads them along tokens (:mod:`.cross_entropy_columns`) and writes
    dlogits over them; ``dhidden = dlogits @ W`` reads both pieces (two GEMMs, one rounding each); then
    ``dweight`` rows ``[a, b)`` are computed from dlogits rows ``[a, b)``, ``b`` as large as leaves the
    written range ``[0, b·H)`` short of logits row ``a`` (at element ``V·H - (V-R)·N + a·N``): ``b - a
    >= R`` whenever ``N <= H`` (``= R`` at ``N = H``; with ``N = H / 2`` three GEMMs for 28928 rows where
    pieces of ``R`` took ten), so no GEMM overwrites logits it or a later GEMM still reads. ``dweight``
    is rounded once. Peak memory beyond the gradients: ``R·N`` elements, plus at most 2 MiB of partial
    row statistics (3 MiB with label smoothing) during the forward (before ``dhidden`` exists)."""
    n_tokens, n_hidden = hidden.shape
    n_vocab = weight.shape[0]
    outside = min(n_vocab, LOGITS_OUTSIDE_ROWS)
    inside = n_vocab - outside
    dweight = weight.new_empty((n_vocab, n_hidden))
    offset = n_vocab * n_hidden - inside * n_tokens
    logits_inside = dweight.view(-1)[offset:].view(inside, n_tokens)
    logits_outside = hidden.new_empty((outside, n_tokens))
    torch.mm(weight[:inside], hidden.t(), out=logits_inside)
    torch.mm(weight[inside:], hidden.t(), out=logits_outside)
    pieces = [logits_inside, logits_outside]
    target = target.contiguous()
    loss_rows, stats = column_cross_entropy_fwd(pieces, target, label_smoothing, ignore_index)
    column_cross_entropy_bwd_in_place(pieces, target, stats, row_weight, label_smoothing, ignore_index)
    dhidden = hidden.new_empty((0,))
    if compute_dhidden:
        dhidden = torch.mm(logits_outside.t(), weight[inside:])
        if inside > 0:
            dhidden.addmm_(logits_inside.t(), weight[:inside])
    start = 0
    while start < inside:
        # Rows [start, end) of dweight cover elements [start·H, end·H), where only logits rows below
        # `start` (read already) may lie: end·H <= offset + start·N. With N < H the pieces grow.
        end = min(inside, (offset + start * n_tokens) // n_hidden)
        torch.mm(logits_inside[start:end], hidden, out=dweight[start:end])
        start = end
    torch.mm(logits_outside, hidden, out=dweight[inside:])
    return (loss_rows * row_weight).sum(), dhidden, dweight, stats


def launch_linear_cross_entropy_fwd_bwd(*args):
    """``lowp::linear_cross_entropy_fwd_bwd``: :func:`fwd_bwd_in_gradient_buffer` where it applies,
    else the chunk schedule."""
    hidden, weight, target, row_weight, label_smoothing, ignore_index, grad_format, _, chunk_size = args[:9]
    compute_dhidden, compute_dweight = args[9:11]
    if in_gradient_buffer_applies(
        hidden, weight.shape[0], grad_format, chunk_size, compute_dweight, args[11:]
    ):
        return fwd_bwd_in_gradient_buffer(
            hidden, weight, target, row_weight, label_smoothing, ignore_index, compute_dhidden
        )
    return fwd_bwd_chunks(*args, steps=KERNEL_STEPS)


@cached_launch
@triton.jit
def scale_by_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    scale = tl.load(scale_ptr).to(tl.float32)
    # scale == 1 (a loss differentiated directly) moves no bytes: every access is masked off.
    in_bounds = offsets < tl.where(scale != 1.0, n, 0)
    x = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    tl.store(x_ptr + offsets, to_dtype_rne(x * scale, x_ptr.dtype.element_ty), mask=in_bounds)


def launch_scale_by_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``lowp::scale_by_``: ``x *= scale`` in place, the scale read on the device; one read and one write
    of ``x``, none when the scale is 1."""
    if not x.is_contiguous():
        scale_by_(x, scale)  # the reference: strided gradients never come from this library's ops
        return
    check_scale_by_args(x, scale)
    if x.numel() == 0:
        return
    _SCALE_LAUNCHES.get(x.numel(), _scale_by_launch, x.numel())(x, scale, x.numel())


# scale_by_kernel bound to its grid, per element count.
_SCALE_LAUNCHES = PlanCache()


def _scale_by_launch(numel: int):
    return scale_by_kernel.bind((ceil_div(numel, SCALE_BLOCK),), BLOCK=SCALE_BLOCK, num_warps=4)
