"""Single-pass cross entropy (Triton): the forward that also writes the logits' gradient over the logits
(``overwrite_logits=True``), reading each logit from HBM once instead of twice.

One program per (row, ``BLOCK``-column chunk), the chunk kept in registers throughout. It computes the
chunk's own statistics (``softmax.block_stats``), publishes them, counts itself in on the row's counter
and waits until the row's ``N_CHUNKS`` programs all have; then it merges the row's published statistics
in chunk order (``softmax.merge_stats``: the fold of ``cross_entropy_fwd_kernel`` over the same blocks)
and forms its chunk's gradient from registers with ``grad_of_logits`` (the backward kernels' op
sequence). Loss, row statistics and gradient bytes therefore equal the two-pass path's (forward, then
``cross_entropy_bwd_``), which the tests check.

Waiting cannot deadlock: each program takes a ticket (an atomic counter) when it starts and works on the
ticket's (row, chunk), so the programs a waiter waits for hold tickets already (they run) or take the
next ones; only the newest row can lack programs, and its ``N_CHUNKS`` fit on the GPU at once. The
Triton interpreter runs programs one after another, where a wait never ends: there (and when
``fused=False``) the two halves run as two launches, statistics then gradient, the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import ceil_div
from ..meta.cross_entropy import LOG_SUM, SHIFT, cross_entropy_fwd_grad_outputs
from .bf16_pairs import to_dtype_rne
from .cross_entropy import (
    _bwd_scalars,
    fwd_config,
    launch_cross_entropy_bwd_,
    launch_cross_entropy_fwd,
    peel_align,
)
from .cross_entropy_math import add_z_loss, grad_of_logits, row_loss
from .launch import INTERPRETING, cached_launch
from .softmax import block_stats, finish_log_sum, masked_safe_shift, merge_stats

MAX_CHUNKS = 64
"""Chunks per row at most (vocabularies up to 64 x 8192 = 524288 columns): all of a row's programs must
fit on the GPU together, and the merge is unrolled over them."""

STAT_PLANES = 3  # a chunk's maximum, sum of exponentials, sum of shifted logits


@cached_launch
@triton.jit
def cross_entropy_fwd_grad_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    loss_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    chunk_stats_ptr,
    target_logit_ptr,
    counters_ptr,
    rows,
    n_cols,
    ignore_index,
    label_smoothing,
    smoothing_eps,
    target_weight,
    z_loss,
    z_loss2,
    BLOCK: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    EVEN: tl.constexpr,
    STATS: tl.constexpr,
    GRAD: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """``STATS``: publish the chunk's statistics (and the target logit, by the chunk holding it); ``GRAD``:
    merge the row's, write the loss and statistics (chunk 0) and the chunk's gradient over the logits.
    Both: one pass, waiting on the row's counter between the halves."""
    FUSED: tl.constexpr = STATS and GRAD and N_CHUNKS > 1
    if FUSED:  # noqa: SIM108 (a constexpr branch: the other one is never compiled)
        ticket = tl.atomic_add(counters_ptr + rows, 1)
    else:
        ticket = tl.program_id(0)
    row = (ticket // N_CHUNKS).to(tl.int64)
    chunk = ticket % N_CHUNKS
    row_ptr = logits_ptr + row * stride_row
    first_col = chunk * BLOCK
    cols = first_col + tl.arange(0, BLOCK)
    in_row = cols < n_cols
    if EVEN:
        x = tl.load(row_ptr + cols).to(tl.float32)
    else:
        x = tl.load(row_ptr + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    target = tl.load(target_ptr + row).to(tl.int64)
    stat_at = row * N_CHUNKS + chunk
    plane = rows * N_CHUNKS
    if STATS:
        m_b, d_b, total_b = block_stats(x, in_row, HAS_SMOOTHING, not EVEN)
        tl.store(chunk_stats_ptr + stat_at, m_b)
        tl.store(chunk_stats_ptr + plane + stat_at, d_b)
        if HAS_SMOOTHING:
            tl.store(chunk_stats_ptr + 2 * plane + stat_at, total_b)
        holds_target = (target >= first_col) & (target < first_col + BLOCK) & (target < n_cols)
        target_logit = tl.sum(tl.where(cols == target, x, 0.0), 0)
        tl.store(target_logit_ptr + row, target_logit, mask=holds_target)
    if FUSED:
        tl.debug_barrier()  # every thread's stores above happen before the release below
        tl.atomic_add(counters_ptr + row, 1, sem="release")
        arrived = tl.atomic_add(counters_ptr + row, 0, sem="acquire")
        while arrived < N_CHUNKS:
            arrived = tl.atomic_add(counters_ptr + row, 0, sem="acquire")
        tl.debug_barrier()
    if GRAD:
        m = float("-inf")  # assigned, not passed as literals: literal arguments would be constexprs
        d = 0.0
        total = 0.0
        for c in tl.static_range(N_CHUNKS):
            at = row * N_CHUNKS + c
            m_c = tl.load(chunk_stats_ptr + at, cache_modifier=".cg")
            d_c = tl.load(chunk_stats_ptr + plane + at, cache_modifier=".cg")
            total_c = 0.0
            if HAS_SMOOTHING:
                total_c = tl.load(chunk_stats_ptr + 2 * plane + at, cache_modifier=".cg")
            count_c = tl.minimum(n_cols - c * BLOCK, BLOCK) * 1.0
            m, d, total = merge_stats(
                m, d, total, (c * BLOCK) * 1.0, m_c, d_c, total_c, count_c, HAS_SMOOTHING
            )
        shift = masked_safe_shift(m)
        log_sum = finish_log_sum(d)
        is_valid = target != ignore_index
        in_range = (target >= 0) & (target < n_cols)
        if chunk == 0:
            target_logit = tl.load(
                target_logit_ptr + row, mask=is_valid & in_range, other=0.0, cache_modifier=".cg"
            )
            loss = row_loss(
                shift,
                log_sum,
                target_logit,
                total,
                n_cols,
                label_smoothing,
                in_range,
                is_valid,
                HAS_SMOOTHING,
            )
            if HAS_Z_LOSS:
                loss = add_z_loss(loss, shift, log_sum, z_loss, is_valid)
            tl.store(loss_ptr + row, loss)
            tl.store(shift_ptr + row, shift)
            tl.store(log_sum_ptr + row, log_sum)
        # The backward kernels' row terms (``load_row_stats``, ``z_loss_factor``), from registers.
        grad_row = tl.load(grad_ptr + row * grad_stride)
        row_scale = tl.where(in_range, grad_row, float("nan"))
        target_col = tl.where(in_range, target, -1).to(tl.int32)
        ignored = target == ignore_index
        factor = 0.0
        if HAS_Z_LOSS:
            factor = tl.fma(z_loss2, shift + log_sum, 1.0)
        any_special = ignored | ((target >= first_col) & (target < first_col + BLOCK))
        grad = grad_of_logits(
            x, cols, shift, log_sum * 1.4426950408889634, target_col, row_scale, ignored, any_special, 0.0,
            0.0, 0.0, factor, smoothing_eps, target_weight, 0.0, 0.0, HAS_SMOOTHING, False, HAS_Z_LOSS, False,
        )  # fmt: skip
        tl.store(row_ptr + cols, to_dtype_rne(grad, logits_ptr.dtype.element_ty), mask=in_row)


def single_pass_chunks(logits: torch.Tensor) -> int:
    """Chunks per row of the single pass over these logits, or 0 where it does not apply: logits not
    contiguous or rows not 16-byte aligned (the two-pass path peels them), more than ``MAX_CHUNKS``."""
    rows, n_cols = logits.shape
    if not logits.is_contiguous() or peel_align(logits) or rows == 0 or n_cols == 0:
        return 0
    chunks = ceil_div(n_cols, fwd_config(n_cols)[0])
    return chunks if chunks <= MAX_CHUNKS else 0


def launch_cross_entropy_fwd_grad_single_pass(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float = 0.0,
    *,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss rows (N,) fp32, row statistics (2, N) fp32)`` of contiguous ``(N, V)`` logits whose rows
    :func:`single_pass_chunks` accepts, the gradient for ``grad_rows`` (fp32, (N,) any stride) written over
    them. ``fused``: one launch that waits between the halves (default on the GPU) or two launches
    (default in the interpreter, where waiting cannot end)."""
    loss, stats = cross_entropy_fwd_grad_outputs(logits, target, grad_rows, label_smoothing, ignore_index)
    rows, n_cols = logits.shape
    chunks = single_pass_chunks(logits)
    block, num_warps = fwd_config(n_cols)
    # One chunk a row needs no wait: one launch anywhere.
    fused = chunks == 1 or ((not INTERPRETING) if fused is None else fused)
    chunk_stats = loss.new_empty((STAT_PLANES, rows, chunks))
    target_logits = loss.new_empty((rows,))
    # Row counters and, last, the ticket counter: zeroed per call (no state survives between calls).
    waits = fused and chunks > 1
    counters = torch.zeros((rows + 1,), dtype=torch.int32, device=logits.device) if waits else target_logits
    eps, target_weight = _bwd_scalars(label_smoothing, n_cols)
    args = (
        logits, n_cols, target.contiguous(), loss, stats[SHIFT], stats[LOG_SUM], grad_rows,
        grad_rows.stride(0), chunk_stats, target_logits, counters, rows, n_cols, ignore_index,
        label_smoothing, eps, target_weight, z_loss, 2.0 * z_loss,
    )  # fmt: skip
    meta = {
        "BLOCK": block,
        "N_CHUNKS": chunks,
        "EVEN": n_cols % block == 0,
        "HAS_SMOOTHING": label_smoothing > 0,
        "HAS_Z_LOSS": z_loss > 0,
        "num_warps": num_warps,
    }
    grid = (rows * chunks,)
    if fused:
        cross_entropy_fwd_grad_kernel[grid](*args, STATS=True, GRAD=True, **meta)
    else:
        cross_entropy_fwd_grad_kernel[grid](*args, STATS=True, GRAD=False, **meta)
        cross_entropy_fwd_grad_kernel[grid](*args, STATS=False, GRAD=True, **meta)
    return loss, stats


def launch_cross_entropy_fwd_grad_(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::cross_entropy_fwd_grad_``: the single pass where it applies (no class weights, no
    soft-capping, rows :func:`single_pass_chunks` accepts), else the forward then ``cross_entropy_bwd_``
    (two reads of the logits); the same bytes either way."""
    if weight is None and softcap == 0 and single_pass_chunks(logits):
        return launch_cross_entropy_fwd_grad_single_pass(
            logits, target, grad_rows, label_smoothing, ignore_index, z_loss
        )
    cross_entropy_fwd_grad_outputs(
        logits, target, grad_rows, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    loss, stats = launch_cross_entropy_fwd(
        logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    launch_cross_entropy_bwd_(
        logits, target, stats, grad_rows, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    return loss, stats
