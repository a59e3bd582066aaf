"""Cross entropy over transposed logits ``(V, N)`` (Triton): the LM head's in-gradient schedule keeps
``logits^T`` inside ``dweight``'s storage (:mod:`lowp_ops.kernels.linear_cross_entropy`), so its loss
reads tokens along the contiguous dimension.

Same math as :mod:`lowp_ops.kernels.cross_entropy`, with tokens as columns:

- statistics: each program folds a slice of the vocabulary for a block of tokens into partial row
  statistics (``online_softmax_update`` along axis 0): the slice's maximum ``m``, ``d = Σ exp(x -
  shift(m))`` and, for label smoothing, ``Σ (x - shift(m))``; a second kernel combines the slices' partials
  relative to the global shift (two passes over the small partials), which gives the loss and the row
  statistics;
- gradient: ``softmax_minus_eps`` and ``cross_entropy_grad``, the helpers of the row kernels, written
  over the logits in place in the logits' dtype.

The logits may come in pieces (row ranges of the vocabulary held in separate buffers); each call names
the piece's first vocabulary row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import ceil_div
from ..meta.cross_entropy import LOG_SUM, SHIFT, row_loss_and_stats_outputs
from .bf16_pairs import to_dtype_rne
from .cross_entropy import _bwd_scalars, stats_rows
from .cross_entropy_math import cross_entropy_grad, load_row_stats, row_loss, softmax_minus_eps
from .launch import cached_launch
from .softmax import finish_log_sum, masked_safe_shift, online_softmax_update, rebase_shifted_sum

STATS_BLOCK_V = 16
STATS_BLOCK_T = 256  # 8 bf16 per thread x 32 lanes: one warp spans the tokens, the vocabulary stays in-thread
STATS_PROGRAMS = 1024  # H200, 129280 x 4096: 81% of copy, as 2048 programs of 8 rows, with half the partials
GRAD_BLOCK_V = 16
GRAD_BLOCK_T = 256
GRAD_WARPS = 4
COMBINE_BLOCK_S = 16
COMBINE_BLOCK_T = 128


@triton.jit
def slice_partial_stats(
    logits_ptr,
    n_tokens,
    v0,
    v_end,
    tokens,
    token_ok,
    BLOCK_V: tl.constexpr,
    WITH_SUM: tl.constexpr,
    EVEN_T: tl.constexpr,
):
    """Partial (max m, ``Σ exp(x - shift(m))``, ``Σ (x - shift(m))``) over rows ``[v0, v_end)`` of a
    ``(rows, n_tokens)`` piece, per token."""
    whole_end = v0 + (v_end - v0) // BLOCK_V * BLOCK_V
    m = tl.full(tokens.shape, float("-inf"), tl.float32)
    d = tl.zeros(tokens.shape, tl.float32)
    total = tl.zeros(tokens.shape, tl.float32)
    for start in range(v0, whole_end, BLOCK_V):
        ptrs = logits_ptr + (start + tl.arange(0, BLOCK_V))[:, None].to(tl.int64) * n_tokens + tokens[None, :]
        if EVEN_T:
            block = tl.load(ptrs).to(tl.float32)
        else:
            block = tl.load(ptrs, mask=token_ok[None, :], other=float("-inf")).to(tl.float32)
        m_old = m
        m, d, shifted = online_softmax_update(m, d, block)
        if WITH_SUM:
            total = rebase_shifted_sum(total, (start - v0) * 1.0, m_old, m)
            total += tl.sum(tl.where(token_ok[None, :], shifted, 0.0), 0)
    if whole_end < v_end:
        rows = whole_end + tl.arange(0, BLOCK_V)
        mask = (rows[:, None] < v_end) & token_ok[None, :]
        ptrs = logits_ptr + rows[:, None].to(tl.int64) * n_tokens + tokens[None, :]
        block = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
        m_old = m
        m, d, shifted = online_softmax_update(m, d, block)
        if WITH_SUM:
            total = rebase_shifted_sum(total, (whole_end - v0) * 1.0, m_old, m)
            total += tl.sum(tl.where(mask, shifted, 0.0), 0)
    return m, d, total


@cached_launch
@triton.jit
def column_partial_stats_kernel(
    first_ptr,
    first_rows,
    first_slices,
    last_ptr,
    last_rows,
    n_tokens,
    rows_per_slice,
    partial_max_ptr,
    partial_d_ptr,
    partial_sum_ptr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    WITH_SUM: tl.constexpr,
    EVEN_T: tl.constexpr,
):
    """Partial statistics (:func:`slice_partial_stats`) of one slice of ``rows_per_slice`` vocabulary rows
    for ``BLOCK_T`` tokens, written at row ``s`` of the ``(slices, n_tokens)`` partials. Slices
    ``[0, first_slices)`` cover the ``first`` piece, the rest the ``last``: one launch, so a small piece
    does not run alone."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < n_tokens
    s = tl.program_id(1)
    if s < first_slices:
        v0 = s * rows_per_slice
        m, d, total = slice_partial_stats(
            first_ptr, n_tokens, v0, tl.minimum(v0 + rows_per_slice, first_rows), tokens, token_ok,
            BLOCK_V, WITH_SUM, EVEN_T,
        )  # fmt: skip
    else:
        v0 = (s - first_slices) * rows_per_slice
        m, d, total = slice_partial_stats(
            last_ptr, n_tokens, v0, tl.minimum(v0 + rows_per_slice, last_rows), tokens, token_ok,
            BLOCK_V, WITH_SUM, EVEN_T,
        )  # fmt: skip
    out = s.to(tl.int64) * n_tokens + tokens
    tl.store(partial_max_ptr + out, m, mask=token_ok)
    tl.store(partial_d_ptr + out, d, mask=token_ok)
    if WITH_SUM:
        tl.store(partial_sum_ptr + out, total, mask=token_ok)


@triton.jit
def slice_rows(slices, first_slices, first_rows, last_rows, rows_per_slice):
    """Vocabulary rows in each of ``slices`` (as ``column_partial_stats_kernel`` cuts the pieces)."""
    in_first = slices < first_slices
    start = tl.where(in_first, slices, slices - first_slices) * rows_per_slice
    piece_rows = tl.where(in_first, first_rows, last_rows)
    return tl.minimum(rows_per_slice, piece_rows - start)


@cached_launch
@triton.jit
def column_combine_kernel(
    partial_max_ptr,
    partial_d_ptr,
    partial_sum_ptr,
    n_slices,
    first_slices,
    rows_per_slice,
    first_ptr,
    first_rows,
    last_ptr,
    last_rows,
    n_tokens,
    n_vocab,
    target_ptr,
    loss_ptr,
    shift_ptr,
    log_sum_ptr,
    ignore_index,
    label_smoothing,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
):
    """The slices' partials combined relative to the global shift (first pass: the maximum; second:
    ``Σ d_s exp(m_s - shift)`` and the rebased sums), then the loss of ``cross_entropy_fwd_kernel``. The
    target logit is read from the piece that holds its row: ``first`` (rows ``[0, first_rows)``) or
    ``last`` (the rest)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < n_tokens
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for start in range(0, n_slices, BLOCK_S):
        slices = start + tl.arange(0, BLOCK_S)
        mask = (slices[:, None] < n_slices) & token_ok[None, :]
        offsets = slices[:, None].to(tl.int64) * n_tokens + tokens[None, :]
        m = tl.maximum(m, tl.max(tl.load(partial_max_ptr + offsets, mask=mask, other=float("-inf")), 0))
    shift = masked_safe_shift(m)
    d = tl.zeros([BLOCK_T], tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for start in range(0, n_slices, BLOCK_S):
        slices = start + tl.arange(0, BLOCK_S)
        mask = (slices[:, None] < n_slices) & token_ok[None, :]
        offsets = slices[:, None].to(tl.int64) * n_tokens + tokens[None, :]
        slice_max = tl.load(partial_max_ptr + offsets, mask=mask, other=float("-inf"))
        slice_d = tl.load(partial_d_ptr + offsets, mask=mask, other=0.0)
        d += tl.sum(slice_d * tl.exp(slice_max - shift[None, :]), 0)
        if HAS_SMOOTHING:
            counts = slice_rows(slices, first_slices, first_rows, last_rows, rows_per_slice).to(tl.float32)
            slice_sum = tl.load(partial_sum_ptr + offsets, mask=mask, other=0.0)
            rebased = rebase_shifted_sum(slice_sum, counts[:, None], slice_max, m[None, :])
            total += tl.sum(rebased, 0)
    log_sum = finish_log_sum(d)

    target = tl.load(target_ptr + tokens, mask=token_ok, other=ignore_index).to(tl.int64)
    is_valid = target != ignore_index
    in_range = (target >= 0) & (target < n_vocab)
    in_first = target < first_rows
    first_logit = tl.load(
        first_ptr + target * n_tokens + tokens, mask=token_ok & in_range & in_first, other=0.0
    )
    last_logit = tl.load(
        last_ptr + (target - first_rows) * n_tokens + tokens,
        mask=token_ok & in_range & (~in_first),
        other=0.0,
    )
    target_logit = tl.where(in_first, first_logit.to(tl.float32), last_logit.to(tl.float32))
    loss = row_loss(
        shift, log_sum, target_logit, total, n_vocab, label_smoothing, in_range, is_valid, HAS_SMOOTHING
    )
    tl.store(loss_ptr + tokens, loss, mask=token_ok)
    tl.store(shift_ptr + tokens, shift, mask=token_ok)
    tl.store(log_sum_ptr + tokens, log_sum, mask=token_ok)


@cached_launch
@triton.jit
def column_grad_in_place_kernel(
    logits_ptr,
    n_rows,
    n_tokens,
    vocab_start,
    n_vocab,
    target_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    ignore_index,
    smoothing_eps,
    target_weight,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
):
    """dlogits of a ``(n_rows, n_tokens)`` piece holding vocabulary rows ``[vocab_start, +n_rows)``,
    written over the logits: each program reads its tile before writing it."""
    rows = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    shift, log2_sum, target, row_scale, ignored = load_row_stats(
        target_ptr,
        shift_ptr,
        log_sum_ptr,
        grad_ptr,
        grad_stride,
        tokens,
        n_tokens,
        n_rows,
        ignore_index,
        vocab_start,
        n_vocab,
    )
    mask = (rows[:, None] < n_rows) & (tokens[None, :] < n_tokens)
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * n_tokens + tokens[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    p = softmax_minus_eps(x.to(tl.float32), shift[None, :], log2_sum[None, :], smoothing_eps, HAS_SMOOTHING)
    row0 = tl.program_id(0) * BLOCK_V
    special = ignored | ((target >= row0) & (target < row0 + BLOCK_V))
    if tl.max(special.to(tl.int32), 0) > 0:
        grad = cross_entropy_grad(
            p, rows[:, None], target[None, :], row_scale[None, :], ignored[None, :], target_weight
        )
    else:
        grad = p * row_scale[None, :]
    tl.store(ptrs, to_dtype_rne(grad, logits_ptr.dtype.element_ty), mask=mask)


def rows_per_slice(n_vocab: int, token_blocks: int) -> int:
    """Vocabulary rows per statistics program: about ``STATS_PROGRAMS`` programs in all, so each fp32
    partial array (maximum and sum of exponentials; label smoothing adds the shifted sums) takes at most
    about ``4 · STATS_PROGRAMS · STATS_BLOCK_T`` bytes (1 MiB) whatever the shape."""
    want = max(1, STATS_PROGRAMS // max(token_blocks, 1))
    return ceil_div(ceil_div(n_vocab, want), STATS_BLOCK_V) * STATS_BLOCK_V


def column_cross_entropy_fwd(
    pieces: list[torch.Tensor], target: torch.Tensor, label_smoothing: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 (loss (N,), row_stats (2, N)) of the logits ``cat(pieces)^T``: ``pieces`` are
    contiguous ``(V_i, N)`` row ranges of the vocabulary, at most two non-empty ones, in order."""
    pieces = [p for p in pieces if p.shape[0] > 0]
    if len(pieces) > 2:
        raise ValueError(f"column_cross_entropy_fwd takes at most two non-empty pieces, got {len(pieces)}")
    n_tokens = target.shape[0]
    n_vocab = sum(p.shape[0] for p in pieces)
    loss, stats = row_loss_and_stats_outputs(target, n_tokens)
    if n_tokens == 0:
        return loss, stats
    token_blocks = ceil_div(n_tokens, STATS_BLOCK_T)
    slice_rows = rows_per_slice(n_vocab, token_blocks)
    counts = [ceil_div(p.shape[0], slice_rows) for p in pieces]
    n_slices = sum(counts)
    partials = torch.empty(
        (3 if label_smoothing > 0 else 2, n_slices, n_tokens), dtype=torch.float32, device=target.device
    )
    partial_max, partial_d, partial_sum = partials[0], partials[1], partials[-1]
    head, tail = pieces[0], pieces[-1]  # one piece: both; its slices all fall in the first range
    column_partial_stats_kernel[(token_blocks, n_slices)](
        head,
        head.shape[0],
        counts[0],
        tail,
        tail.shape[0],
        n_tokens,
        slice_rows,
        partial_max,
        partial_d,
        partial_sum,
        BLOCK_V=STATS_BLOCK_V,
        BLOCK_T=STATS_BLOCK_T,
        WITH_SUM=label_smoothing > 0,
        EVEN_T=n_tokens % STATS_BLOCK_T == 0,
        num_warps=1,
    )
    column_combine_kernel[(ceil_div(n_tokens, COMBINE_BLOCK_T),)](
        partial_max,
        partial_d,
        partial_sum,
        n_slices,
        counts[0],
        slice_rows,
        head,
        head.shape[0],
        tail,
        tail.shape[0],
        n_tokens,
        n_vocab,
        target,
        loss,
        stats[SHIFT],
        stats[LOG_SUM],
        ignore_index,
        label_smoothing,
        BLOCK_S=COMBINE_BLOCK_S,
        BLOCK_T=COMBINE_BLOCK_T,
        HAS_SMOOTHING=label_smoothing > 0,
        num_warps=4,
    )
    return loss, stats


def column_cross_entropy_bwd_in_place(
    pieces: list[torch.Tensor],
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
) -> None:
    """Overwrite each piece of ``cat(pieces)^T`` with its dlogits (the logits' dtype), for the row
    statistics ``stats`` (2, N) and the per-token loss gradient ``grad_rows`` (fp32 ``(N,)``, any
    stride: an expanded scalar is fine)."""
    n_tokens = target.shape[0]
    n_vocab = sum(p.shape[0] for p in pieces)
    eps, target_weight = _bwd_scalars(label_smoothing, n_vocab)
    shift, log_sum = stats_rows(stats)
    vocab_start = 0
    for piece in pieces:
        if piece.shape[0] > 0 and n_tokens > 0:
            grid = (ceil_div(piece.shape[0], GRAD_BLOCK_V), ceil_div(n_tokens, GRAD_BLOCK_T))
            column_grad_in_place_kernel[grid](
                piece,
                piece.shape[0],
                n_tokens,
                vocab_start,
                n_vocab,
                target,
                shift,
                log_sum,
                grad_rows,
                grad_rows.stride(0),
                ignore_index,
                eps,
                target_weight,
                BLOCK_V=GRAD_BLOCK_V,
                BLOCK_T=GRAD_BLOCK_T,
                HAS_SMOOTHING=label_smoothing > 0,
                num_warps=GRAD_WARPS,
            )
        vocab_start += piece.shape[0]
