"""Cross entropy over 32-row x column-chunk slices: the row statistics from per-chunk partials, and the
single-pass forward-and-backward that writes the gradient from the same read of the logits.

A program owns a 32-row block's columns ``[chunk * chunk_cols, (chunk + 1) * chunk_cols)`` and reads
them once in 32 x ``SUB`` tiles, keeping per row an online (max ``m``, ``Σ exp(x - shift(m))``, and with
label smoothing ``Σ (x - shift(m))``). It stores these partials, then counts itself in with an atomic
add; the row block's last program to arrive merges the block's partials (in chunk order, one reduction
whose order does not depend on which program came last) into the row statistics ``(shift, log_sum)``
and the per-row loss. That is the forward (``COOPERATIVE=False``).

``COOPERATIVE=True`` goes on: the merging program releases a per-row-block flag, the block's other
programs wait for it, and every program then forms the gradient of its own chunk with the backward's
tile code (``cross_entropy_math.tile_grad``) and writes it in the logits' dtype (possibly over the
logits themselves) or as MXFP8 (``quantize_grad_tile``). The chunk was read a few microseconds before
and is re-read from L2 (the loads of the first read ask L2 to keep it), so the logits cross HBM once.
Both modes run the same partial and merge code, so the gradient bytes equal the two-pass path's (the
forward here, then ``cross_entropy_bwd`` / ``cross_entropy_bwd_mxfp8``) by construction.

Waiting inside a kernel needs every program of a row block to be resident at once. Programs take their
row block and chunk from a ticket (an atomic counter) in the order they start, so the row blocks start
in order and a block's programs all start once the blocks before it have finished; a block has at most
as many chunks as the GPU has SMs, and every SM holds at least one program: the programs that wait can
always be joined by the rest of their block. The interpreter runs programs one after another, so there
(and on CPU) the single pass is the forward then the backward kernel, the same bytes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..formats import round_to_fp32
from .cross_entropy_math import (
    add_z_loss,
    quantize_grad_tile,
    row_loss,
    softcap_logits,
    store_grad_tile,
    tile_grad,
)
from .launch import INTERPRETING, cached_launch, rows_with_unit_stride
from .softmax import finish_log_sum, masked_safe_shift, rebase_shifted_sum

LOG2E = tl.constexpr(1.4426950408889634)
# Tile width of both passes and the narrowest chunk (a chunk is a whole number of tiles).
SUB_COLS = 128
MIN_CHUNK_COLS = 1024
# Output of the kernel: row statistics and losses only, the gradient in the logits' dtype, or MXFP8.
STATS, GRAD, MXFP8 = 0, 1, 2
GRAD_OUTPUT = tl.constexpr(GRAD)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def chunk_plan(n_cols: int, device: torch.device, chunk_cols: int | None = None) -> tuple[int, int]:
    """(chunk_cols, n_chunks) of a row: chunks of at least ``MIN_CHUNK_COLS`` columns (a multiple of
    ``SUB_COLS``), and no more chunks than the device has SMs (what the single pass's wait needs)."""
    most = (
        _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
        if (device.type == "cuda")
        else 128
    )
    if chunk_cols is None:
        chunk_cols = max(MIN_CHUNK_COLS, triton.cdiv(n_cols, most))
    chunk_cols = triton.cdiv(chunk_cols, SUB_COLS) * SUB_COLS
    n_chunks = max(1, triton.cdiv(n_cols, chunk_cols))
    if device.type == "cuda" and n_chunks > most:
        raise ValueError(f"chunk_cols={chunk_cols} gives {n_chunks} chunks, more than the {most} SMs")
    return chunk_cols, n_chunks


@triton.jit
def load_rows_tile(
    logits_ptr, stride_row, rows_idx, cols, rows, n_cols, EVEN: tl.constexpr, KEEP: tl.constexpr
):
    """fp32 logits tile [32, SUB]; lanes outside the logits read ``-inf``. ``KEEP``: ask L2 to keep the
    lines for a second read."""
    ptrs = logits_ptr + rows_idx[:, None].to(tl.int64) * stride_row + cols[None, :]
    mask = (rows_idx[:, None] < rows) & (cols[None, :] < n_cols)
    if EVEN and KEEP:
        x = tl.load(ptrs, eviction_policy="evict_last")
    elif EVEN:
        x = tl.load(ptrs)
    elif KEEP:
        x = tl.load(ptrs, mask=mask, other=float("-inf"), eviction_policy="evict_last")
    else:
        x = tl.load(ptrs, mask=mask, other=float("-inf"))
    return x.to(tl.float32)


@triton.jit
def chunk_partials(
    logits_ptr,
    stride_row,
    rows_idx,
    rows,
    n_cols,
    col_start,
    col_end,
    softcap,
    softcap_rcp,
    SUB: tl.constexpr,
    EVEN: tl.constexpr,
    WITH_SUM: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    KEEP: tl.constexpr,
):
    """Per row of a 32-row block over columns ``[col_start, col_end)``: (max m, ``Σ exp(x - shift(m))``,
    ``Σ (x - shift(m))`` (0 unless ``WITH_SUM``)) in fp32, online over 32 x SUB tiles (capped logits
    with ``HAS_SOFTCAP``)."""
    m = tl.full([32], float("-inf"), tl.float32)
    d = tl.zeros([32], tl.float32)
    total = tl.zeros([32], tl.float32)
    for start in range(col_start, col_end, SUB):
        cols = start + tl.arange(0, SUB)
        x = load_rows_tile(logits_ptr, stride_row, rows_idx, cols, rows, n_cols, EVEN, KEEP)
        if HAS_SOFTCAP:
            x, _ = softcap_logits(x, softcap, softcap_rcp)
        m_new = tl.maximum(m, tl.max(x, 1))
        shift = masked_safe_shift(m_new)
        shifted = x - shift[:, None]
        d = d * tl.exp(m - shift) + tl.sum(tl.exp2(shifted * LOG2E), 1)
        if WITH_SUM:
            total = rebase_shifted_sum(total, (start - col_start) * 1.0, m, m_new)
            if EVEN:
                total += tl.sum(shifted, 1)
            else:
                total += tl.sum(tl.where(cols[None, :] < n_cols, shifted, 0.0), 1)
        m = m_new
    return m, d, total


@triton.jit
def merge_partials(
    partial_ptr, plane, row_block, n_chunks, chunk_cols, n_cols, CHUNKS: tl.constexpr, WITH_SUM: tl.constexpr
):
    """A row block's row statistics from its chunks' partials: (shift, log_sum, ``Σ (x - shift)``) per
    row, each an fp32 [32]. One reduction over the chunk axis, the same whichever program runs it."""
    chunk = tl.arange(0, CHUNKS)[:, None]
    offsets = (row_block * n_chunks + chunk).to(tl.int64) * 32 + tl.arange(0, 32)[None, :]
    present = chunk < n_chunks
    m_c = tl.load(partial_ptr + offsets, mask=present, other=float("-inf"), cache_modifier=".cg")
    d_c = tl.load(partial_ptr + plane + offsets, mask=present, other=0.0, cache_modifier=".cg")
    m = tl.max(m_c, 0)
    shift = masked_safe_shift(m)
    d = tl.sum(d_c * tl.exp(m_c - shift[None, :]), 0)
    total = tl.zeros([32], tl.float32)
    if WITH_SUM:
        s_c = tl.load(partial_ptr + 2 * plane + offsets, mask=present, other=0.0, cache_modifier=".cg")
        width = tl.minimum(chunk_cols, n_cols - chunk * chunk_cols).to(tl.float32)
        total = tl.sum(tl.where(present, rebase_shifted_sum(s_c, width, m_c, m[None, :]), 0.0), 0)
    return shift, finish_log_sum(d), total


@triton.jit
def store_row_losses(
    logits_ptr,
    stride_row,
    target_ptr,
    loss_ptr,
    shift_ptr,
    log_sum_ptr,
    rows_idx,
    rows,
    n_cols,
    shift,
    log_sum,
    shifted_sum,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    softcap_rcp,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Store a row block's statistics and per-row losses (``row_loss``, plus the z-loss)."""
    row_ok = rows_idx < rows
    target = tl.load(target_ptr + rows_idx, mask=row_ok, other=ignore_index).to(tl.int64)
    is_valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    target_ptrs = logits_ptr + rows_idx.to(tl.int64) * stride_row + target
    target_logit = tl.load(target_ptrs, mask=row_ok & is_valid & in_range, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        target_logit, _ = softcap_logits(target_logit, softcap, softcap_rcp)
    loss = row_loss(
        shift, log_sum, target_logit, shifted_sum, n_cols, label_smoothing, in_range, is_valid, HAS_SMOOTHING
    )
    if HAS_Z_LOSS:
        loss = add_z_loss(loss, shift, log_sum, z_loss, is_valid)
    tl.store(loss_ptr + rows_idx, loss, mask=row_ok)
    tl.store(shift_ptr + rows_idx, shift, mask=row_ok)
    tl.store(log_sum_ptr + rows_idx, log_sum, mask=row_ok)


@triton.jit
def wait_for_flag(flag_ptr, BACKOFF: tl.constexpr):
    """Spin until ``*flag_ptr`` is nonzero (acquire: what was released before it is visible);
    ``BACKOFF``: sleep that many nanoseconds between polls."""
    flag = tl.atomic_add(flag_ptr, 0, sem="acquire")
    while flag == 0:
        if BACKOFF > 0:
            flag = tl.inline_asm_elementwise(
                "nanosleep.u32 $2; mov.u32 $0, $1;", "=r,r,r", [flag, flag * 0 + BACKOFF], dtype=tl.int32,
                is_pure=False, pack=1,
            )  # fmt: skip
        flag = tl.atomic_add(flag_ptr, 0, sem="acquire")


@cached_launch
@triton.jit
def cross_entropy_chunks_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    loss_ptr,
    shift_ptr,
    log_sum_ptr,
    partial_ptr,
    counter_ptr,
    rows,
    n_cols,
    chunk_cols,
    n_chunks,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    softcap_rcp,
    grad_ptr,
    grad_stride,
    dlogits_ptr,
    smoothing_eps,
    target_weight,
    row_data_ptr,
    row_scale_ptr,
    row_scale_cols,
    col_data_ptr,
    col_scale_ptr,
    col_scale_rows,
    col_scale_cols,
    SUB: tl.constexpr,
    CHUNKS: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    OUTPUT: tl.constexpr,
    COOPERATIVE: tl.constexpr,
    KEEP: tl.constexpr,
    BACKOFF: tl.constexpr = 0,
    TICKET: tl.constexpr = True,
    SKIP_WAIT: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 448.0,
    MAX_RCP: tl.constexpr = 1.0,
    OUT_DTYPE: tl.constexpr = None,
    ROWWISE: tl.constexpr = False,
    COLWISE: tl.constexpr = False,
    SWIZZLED: tl.constexpr = False,
):
    """One (32-row block, column chunk) program; see the module docstring. ``counter_ptr``: int32 zeros,
    ``[arrivals per row block, ready flag per row block, ticket]``; ``partial_ptr``: fp32, three planes
    of ``row_blocks * n_chunks * 32``."""
    n_row_blocks = tl.cdiv(rows, 32)
    if COOPERATIVE and TICKET:  # noqa: SIM108 (a constexpr branch)
        # Tickets in start order: a row block's programs start once the blocks before it have started.
        ticket = tl.atomic_add(counter_ptr + 2 * n_row_blocks, 1)
    else:
        ticket = tl.program_id(0)
    row_block = ticket // n_chunks
    chunk = ticket % n_chunks
    rows_idx = row_block * 32 + tl.arange(0, 32)
    col_start = chunk * chunk_cols
    col_end = tl.minimum(col_start + chunk_cols, n_cols)
    m, d, total = chunk_partials(
        logits_ptr, stride_row, rows_idx, rows, n_cols, col_start, col_end, softcap, softcap_rcp, SUB, EVEN,
        HAS_SMOOTHING, HAS_SOFTCAP, KEEP,
    )  # fmt: skip
    plane = n_row_blocks * n_chunks * 32
    partial = partial_ptr + (row_block * n_chunks + chunk).to(tl.int64) * 32 + tl.arange(0, 32)
    tl.store(partial, m)
    tl.store(partial + plane, d)
    if HAS_SMOOTHING:
        tl.store(partial + 2 * plane, total)
    tl.debug_barrier()  # every thread's partials are written before the arrival releases them
    arrived = tl.atomic_add(counter_ptr + row_block, 1, sem="acq_rel")
    if arrived == n_chunks - 1:
        shift, log_sum, shifted_sum = merge_partials(
            partial_ptr, plane, row_block, n_chunks, chunk_cols, n_cols, CHUNKS, HAS_SMOOTHING
        )
        store_row_losses(
            logits_ptr, stride_row, target_ptr, loss_ptr, shift_ptr, log_sum_ptr, rows_idx, rows, n_cols,
            shift, log_sum, shifted_sum, ignore_index, label_smoothing, z_loss, softcap, softcap_rcp,
            HAS_SMOOTHING, HAS_Z_LOSS, HAS_SOFTCAP,
        )  # fmt: skip
        if COOPERATIVE:
            tl.debug_barrier()
            tl.atomic_xchg(counter_ptr + n_row_blocks + row_block, 1, sem="release")
    if COOPERATIVE:
        if not SKIP_WAIT:
            wait_for_flag(counter_ptr + n_row_blocks + row_block, BACKOFF)
        tl.debug_barrier()
        z_loss2 = 2.0 * z_loss
        for start in range(col_start, col_end, SUB):
            col_tile = start // SUB
            _, cols, grad = tile_grad(
                row_block, col_tile, logits_ptr, stride_row, target_ptr, shift_ptr, log_sum_ptr, grad_ptr,
                grad_stride, rows, n_cols, ignore_index, 0, n_cols, smoothing_eps, target_weight, loss_ptr,
                loss_ptr, z_loss2, softcap, softcap_rcp, SUB, HAS_SMOOTHING, EVEN, False, HAS_Z_LOSS,
                HAS_SOFTCAP,
            )  # fmt: skip
            if OUTPUT == GRAD_OUTPUT:
                store_grad_tile(grad, dlogits_ptr, rows_idx, cols, rows, n_cols, EVEN)
            else:
                quantize_grad_tile(
                    grad, logits_ptr.dtype.element_ty, rows_idx, cols, rows, n_cols, start, row_block,
                    row_data_ptr, row_scale_ptr, row_scale_cols, col_data_ptr, col_scale_ptr, col_scale_rows,
                    col_scale_cols, SUB, FP8_MAX, MAX_RCP, OUT_DTYPE, ROWWISE, COLWISE, SWIZZLED, EVEN,
                )  # fmt: skip


def launch(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: torch.Tensor,
    stats: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
    softcap: float,
    output: int,
    grad_rows: torch.Tensor | None = None,
    dlogits: torch.Tensor | None = None,
    mxfp8: tuple = (),
    *,
    chunk_cols: int | None = None,
    num_warps: int = 4,
    **experiment,
) -> None:
    """Launch ``cross_entropy_chunks_kernel`` into the given outputs (cooperative unless ``output`` is
    ``STATS``): ``grad_rows`` (N,) fp32 dloss per row, ``dlogits`` the gradient's buffer (``GRAD``; may be
    the logits), ``mxfp8`` the payload's four tensors (data viewed as fp8) and the MXFP8 constexprs."""
    rows, n_cols = logits.shape
    chunk_cols, n_chunks = chunk_plan(n_cols, logits.device, chunk_cols)
    row_blocks = triton.cdiv(rows, 32)
    partials = logits.new_empty((3 * row_blocks * n_chunks * 32,), dtype=torch.float32)
    counters = torch.zeros((2 * row_blocks + 1,), dtype=torch.int32, device=logits.device)
    eps = round_to_fp32(label_smoothing / n_cols) if n_cols else 0.0
    grad_rows = loss if grad_rows is None else grad_rows
    dlogits = logits if dlogits is None else dlogits
    row_data, row_scale, col_data, col_scale, fp8 = mxfp8 or (loss, loss, loss, loss, {})
    cross_entropy_chunks_kernel[(row_blocks * n_chunks,)](
        logits,
        logits.stride(0),
        target,
        loss,
        stats[0],
        stats[1],
        partials,
        counters,
        rows,
        n_cols,
        chunk_cols,
        n_chunks,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
        round_to_fp32(1.0 / softcap) if softcap > 0 else 0.0,
        grad_rows,
        grad_rows.stride(0),
        dlogits,
        eps,
        1.0 - label_smoothing,
        row_data,
        row_scale,
        row_scale.shape[1] if row_scale.dim() == 2 else 0,
        col_data,
        col_scale,
        col_scale.shape[0] if col_scale.dim() == 2 else 0,
        col_scale.shape[1] if col_scale.dim() == 2 else 0,
        SUB=experiment.pop("SUB", SUB_COLS),
        KEEP=output != STATS and experiment.pop("KEEP", True),
        CHUNKS=triton.next_power_of_2(n_chunks),
        EVEN=rows % 32 == 0 and n_cols % SUB_COLS == 0,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss > 0,
        HAS_SOFTCAP=softcap > 0,
        OUTPUT=output,
        COOPERATIVE=output != STATS,
        num_warps=num_warps,
        **fp8,
        **experiment,
    )


def launch_cross_entropy_fwd_chunks(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    *,
    chunk_cols: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::cross_entropy_fwd`` without class weights: (loss (N,) fp32, row statistics (2, N) fp32)."""
    rows = logits.shape[0]
    loss = logits.new_empty((rows,), dtype=torch.float32)
    stats = logits.new_empty((2, rows), dtype=torch.float32)
    if rows == 0:
        return loss, stats
    launch(
        rows_with_unit_stride(logits), target.contiguous(), loss, stats, label_smoothing, ignore_index,
        z_loss, softcap, STATS, chunk_cols=chunk_cols, num_warps=num_warps,
    )  # fmt: skip
    return loss, stats


def single_pass_runs(logits: torch.Tensor) -> bool:
    """Whether the cooperative kernel runs (CUDA, not the interpreter); else forward then backward."""
    return logits.is_cuda and not INTERPRETING
