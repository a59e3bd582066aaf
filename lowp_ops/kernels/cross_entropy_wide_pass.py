"""Cross entropy forward and backward in one read of the logits for rows of more than one 8192-class
block (Gluon, CUDA): ``overwrite_logits=True`` and the LM head's gradient-in-the-forward chunks.

Rows of up to ``MAX_BLOCKS`` blocks (32768 classes): one program per row (the forward's 4 warps) copies
the whole row into shared memory with asynchronous 16-byte copies (``cp.async``), one commit group per
8192-element block, all issued before the first is used: 64 KB of a row in flight per program and three
programs per SM (a block held in registers keeps 16 KB in flight). It folds the row's statistics block
by block as the copies land, writes the loss and statistics, then forms the gradient from the
shared-memory copy and writes it over the row: 4 bytes of HBM traffic per bf16 element where the
forward, the reduction and the in-place backward move 6.

Wider rows: one program per 32768-class part (``softmax.STATS_PART``, the parts the forward folds on
their own and merges, ``softmax.row_stats_in_parts``), the same copy and fold per part; the row's
programs exchange their parts' statistics through global memory (a counter per row, tickets so that
waiting cannot deadlock) and each writes its part's gradient from its copy.

Bytes: the forward's (``cross_entropy.cross_entropy_fwd_kernel``). The layout is the one Triton gives
the forward's 8192-element block at 4 warps (8 consecutive elements a thread); blocks fold in the
forward's order through the same helper (``softmax.fold_masked_block``: with every lane in the row, an
unmasked block's bits), parts merge through ``softmax.merge_row_stats``, and the loss and gradient come
from the Triton one-pass kernel's helpers (``store_row_loss``, ``grad_of_logits``). GPU tests hold both
kernels to the two-pass bytes.

Speed on the H200 (benchmarks/RESULTS.md, "One pass for rows wider than 32768 classes"): one program a
row runs at 92-94% of copy at its 4-byte floor (8192 x 32768: 0.27 against 0.40 ms for the two passes);
the parts kernel at 73-78% (4096 x 129280: 0.65-0.68 against 0.79 ms), with or without its waiting
(which costs little: the row's programs start together); three 4-warp programs per SM hide too little
latency while each holds its part's 64 KB from its copy to its gradient's stores (Nsight Compute: DRAM at
53% of peak, 0.69 issued instructions per scheduler per cycle, no eligible warp in 31% of cycles).
"""

from __future__ import annotations

import functools

import torch

from .bf16_pairs import to_dtype_rne
from .cross_entropy import FWD_BLOCK, fwd_config
from .cross_entropy_math import grad_of_logits, one_row_grad_terms, store_row_loss
from .launch import cached_launch
from .softmax import STATS_PART, finish_log_sum, fold_masked_block, masked_safe_shift, merge_row_stats

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # a Triton without Gluon: the two passes serve these rows
    gluon = gl = async_copy = None

BLOCK = FWD_BLOCK
MAX_BLOCKS = STATS_PART.value // BLOCK
"""The widest row of one program, in blocks (the forward's part): 64 KB of shared memory a program,
three programs per SM on the H200."""


if gluon is not None:

    @gluon.jit
    def _copy_span(held, span_ptr, length, BLOCKS: gl.constexpr):
        """Issue the asynchronous 16-byte copies (``cp.async``) of the ``length`` elements at ``span_ptr``
        into ``held``: ``BLOCKS`` blocks of 8192, one commit group each (lanes past ``length`` copy
        nothing), all issued before the first is used."""
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
        in_block = gl.arange(0, 8192, layout=layout)
        for b in gl.static_range(BLOCKS):
            cols = b * 8192 + in_block
            async_copy.async_copy_global_to_shared(held.index(b), span_ptr + cols, mask=cols < length)
            async_copy.commit_group()

    @gluon.jit
    def _fold_span(held, length, n_blocks, BLOCKS: gl.constexpr, WITH_SUM: gl.constexpr):
        """``(m, d, total)`` of the span :func:`_copy_span` copies, its ``n_blocks`` blocks folded as their
        copies land, in the forward's order and layout (``softmax.fold_masked_block``)."""
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
        in_block = gl.arange(0, 8192, layout=layout)
        m = float("-inf")  # assigned, not passed as literals: literal arguments would be constexprs
        d = 0.0
        total = 0.0
        for b in range(n_blocks):
            # One empty group a step: all but the newest BLOCKS groups done is block b done.
            async_copy.commit_group()
            async_copy.wait_group(BLOCKS)
            cols = b * 8192 + in_block
            in_span = cols < length
            x = gl.where(in_span, held.index(b).load(layout).to(gl.float32), float("-inf"))
            m, d, total = fold_masked_block(m, d, total, b * 8192, x, in_span, WITH_SUM)
        return m, d, total

    @gluon.jit
    def _finish_span(
        held, span_ptr, start, length, row, target, target_logit, m, d, total, target_ptr, loss_ptr,
        shift_ptr, log_sum_ptr, grad_ptr, grad_stride, n_cols, ignore_index, label_smoothing,
        smoothing_eps, target_weight, weight_ptr, smooth_total_ptr, z_loss, z_loss2,
        HAS_GRAD_ROWS: gl.constexpr, HAS_SMOOTHING: gl.constexpr, HAS_WEIGHT: gl.constexpr,
        HAS_Z_LOSS: gl.constexpr,
    ):  # fmt: skip
        """Store row ``row``'s loss and statistics from its folded ``(m, d, total)``, then write the
        gradient of the span ``held`` holds (columns ``start`` to ``start + length`` of the row, at
        ``span_ptr``) over it, from the Triton one-pass kernel's helpers."""
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
        in_block = gl.arange(0, 8192, layout=layout)
        shift = masked_safe_shift(m)
        log_sum = finish_log_sum(d)
        store_row_loss(
            row, target, target_logit, shift, log_sum, total, loss_ptr, shift_ptr, log_sum_ptr, weight_ptr,
            smooth_total_ptr, n_cols, ignore_index, label_smoothing, smoothing_eps, z_loss, HAS_SMOOTHING,
            HAS_WEIGHT, HAS_Z_LOSS,
        )  # fmt: skip
        target_col, row_scale, ignored, class_weight, alpha, factor = one_row_grad_terms(
            row, target, shift, log_sum, target_ptr, grad_ptr, grad_stride, weight_ptr, smooth_total_ptr,
            n_cols, ignore_index, target_weight, z_loss2, HAS_GRAD_ROWS, HAS_WEIGHT, HAS_Z_LOSS,
        )  # fmt: skip
        log2_sum = log_sum * 1.4426950408889634
        # A trip count known only at run time: unrolled, the loop took 240 registers where it takes 87.
        for b in range(gl.cdiv(length, 8192)):
            cols = b * 8192 + in_block
            x = held.index(b).load(layout).to(gl.float32)
            grad = grad_of_logits(
                x, start + cols, shift, log2_sum, target_col, row_scale, ignored, True, class_weight, alpha,
                0.0, factor, smoothing_eps, target_weight, 0.0, 0.0, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
                False,
            )  # fmt: skip
            gl.store(span_ptr + cols, to_dtype_rne(grad, span_ptr.dtype.element_ty), mask=cols < length)

    @cached_launch
    @gluon.jit
    def cross_entropy_fwd_bwd_wide_kernel(
        logits_ptr,
        target_ptr,
        loss_ptr,
        shift_ptr,
        log_sum_ptr,
        grad_ptr,
        grad_stride,
        n_vecs,
        ignore_index,
        label_smoothing,
        smoothing_eps,
        target_weight,
        weight_ptr,
        smooth_total_ptr,
        z_loss,
        z_loss2,
        N_BLOCKS: gl.constexpr,
        HAS_GRAD_ROWS: gl.constexpr,
        HAS_SMOOTHING: gl.constexpr,
        HAS_WEIGHT: gl.constexpr,
        HAS_Z_LOSS: gl.constexpr,
    ):
        """Row ``program_id`` of contiguous ``(N, n_cols)`` logits, ``n_cols = 8 n_vecs`` (so that every
        16-byte copy is whole) in ``N_BLOCKS`` blocks of 8192: loss, (shift, log_sum) and the gradient for
        the row factor ``grad_ptr[row * grad_stride]`` (1 without ``HAS_GRAD_ROWS``), written over the row."""
        n_cols = n_vecs * 8
        row = gl.program_id(0).to(gl.int64)
        row_ptr = logits_ptr + row * n_cols
        held = gl.allocate_shared_memory(
            logits_ptr.dtype.element_ty, [N_BLOCKS, 8192], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        _copy_span(held, row_ptr, n_cols, N_BLOCKS)
        target = gl.load(target_ptr + row).to(gl.int64)
        is_valid = target != ignore_index
        in_range = (target >= 0) & (target < n_cols)
        target_logit = gl.load(row_ptr + target, mask=is_valid & in_range, other=0.0).to(gl.float32)
        m, d, total = _fold_span(held, n_cols, N_BLOCKS, N_BLOCKS, HAS_SMOOTHING)
        _finish_span(
            held, row_ptr, 0, n_cols, row, target, target_logit, m, d, total, target_ptr, loss_ptr, shift_ptr,
            log_sum_ptr, grad_ptr, grad_stride, n_cols, ignore_index, label_smoothing, smoothing_eps,
            target_weight, weight_ptr, smooth_total_ptr, z_loss, z_loss2, HAS_GRAD_ROWS, HAS_SMOOTHING,
            HAS_WEIGHT, HAS_Z_LOSS,
        )  # fmt: skip

    @cached_launch
    @gluon.jit
    def cross_entropy_fwd_bwd_parts_kernel(
        logits_ptr,
        target_ptr,
        loss_ptr,
        shift_ptr,
        log_sum_ptr,
        grad_ptr,
        grad_stride,
        n_vecs,
        ignore_index,
        label_smoothing,
        smoothing_eps,
        target_weight,
        weight_ptr,
        smooth_total_ptr,
        z_loss,
        z_loss2,
        sync_ptr,
        published_ptr,
        N_PARTS: gl.constexpr,
        HAS_GRAD_ROWS: gl.constexpr,
        HAS_SMOOTHING: gl.constexpr,
        HAS_WEIGHT: gl.constexpr,
        HAS_Z_LOSS: gl.constexpr,
    ):
        """One ``STATS_PART``-class part of a row of ``n_cols = 8 n_vecs > STATS_PART`` classes, the row's
        ``N_PARTS`` parts in as many programs: :func:`cross_entropy_fwd_bwd_wide_kernel`'s outputs. A
        program copies its part into shared memory, folds the part's statistics (the forward's
        ``row_stats_in_parts`` term), publishes them, counts itself in on the row's counter, waits until
        the row's parts are all in, merges them in order, and writes its part's gradient from the copy.

        ``sync_ptr``: int32 zeros, a ticket counter then one counter per row. Parts are taken in ticket
        order, so a program only waits for parts of a row that programs already running have taken or
        that the next programs to start take: no deadlock whatever order the hardware starts programs
        in. ``published_ptr``: fp32 ``(rows, 3 N_PARTS + 1)``, each part's ``(m, d, total)`` and the
        target logit (written by the program whose part holds it, before any program of the row writes)."""
        part_blocks: gl.constexpr = STATS_PART // 8192
        n_cols = n_vecs * 8
        ticket = gl.atomic_add(sync_ptr, 1)
        row = (ticket // N_PARTS).to(gl.int64)
        part = ticket % N_PARTS
        part_start = part * STATS_PART
        part_ptr = logits_ptr + row * n_cols + part_start
        part_len = gl.minimum(n_cols - part_start, STATS_PART)
        held = gl.allocate_shared_memory(
            logits_ptr.dtype.element_ty, [part_blocks, 8192], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        _copy_span(held, part_ptr, part_len, part_blocks)
        target = gl.load(target_ptr + row).to(gl.int64)
        holds_target = (target != ignore_index) & (target >= part_start) & (target < part_start + part_len)
        target_logit = gl.load(part_ptr + (target - part_start), mask=holds_target, other=0.0).to(gl.float32)
        m, d, total = _fold_span(held, part_len, gl.cdiv(part_len, 8192), part_blocks, HAS_SMOOTHING)

        # Plain stores, then one release: the barrier before the counter's atomic orders every thread's.
        row_published = published_ptr + row * (3 * N_PARTS + 1)
        mine = row_published + 3 * part
        gl.store(mine, m)
        gl.store(mine + 1, d)
        gl.store(mine + 2, total)
        gl.store(row_published + 3 * N_PARTS, target_logit, mask=holds_target)
        gl.atomic_add(sync_ptr + 1 + row, 1, sem="release")  # no result used: a `red`, nothing to wait for
        arrived = gl.atomic_add(sync_ptr + 1 + row, 0, sem="acquire")  # an acquiring load of the counter
        while arrived < N_PARTS:
            arrived = gl.atomic_add(sync_ptr + 1 + row, 0, sem="acquire")

        # Read at L2 (.cg), after the acquire; unrolled, so that the loads issue together.
        m = gl.load(row_published, cache_modifier=".cg")
        d = gl.load(row_published + 1, cache_modifier=".cg")
        total = gl.load(row_published + 2, cache_modifier=".cg")
        for p in gl.static_range(1, N_PARTS):
            m_part = gl.load(row_published + 3 * p, cache_modifier=".cg")
            d_part = gl.load(row_published + 3 * p + 1, cache_modifier=".cg")
            total_part = gl.load(row_published + 3 * p + 2, cache_modifier=".cg")
            count = gl.minimum(n_cols - p * STATS_PART, STATS_PART)
            seen = p * STATS_PART
            m, d, total = merge_row_stats(m, d, total, seen, m_part, d_part, total_part, count, HAS_SMOOTHING)
        valid = (target != ignore_index) & (target >= 0) & (target < n_cols)
        target_logit = gl.where(valid, gl.load(row_published + 3 * N_PARTS, cache_modifier=".cg"), 0.0)
        # Every part's program stores the row's same loss and statistics.
        _finish_span(
            held, part_ptr, part_start, part_len, row, target, target_logit, m, d, total, target_ptr,
            loss_ptr, shift_ptr, log_sum_ptr, grad_ptr, grad_stride, n_cols, ignore_index, label_smoothing,
            smoothing_eps, target_weight, weight_ptr, smooth_total_ptr, z_loss, z_loss2, HAS_GRAD_ROWS,
            HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
        )  # fmt: skip

else:
    cross_entropy_fwd_bwd_wide_kernel = cross_entropy_fwd_bwd_parts_kernel = None


@functools.cache
def _has_cp_async(device_index: int) -> bool:
    """``cp.async`` (the kernel's copies) exists from sm_80 on."""
    return torch.cuda.get_device_capability(device_index)[0] >= 8


def one_pass_folds_like_the_forward(
    logits: torch.Tensor, label_smoothing: float, weight, softcap: float
) -> bool:
    """What both one-pass kernels need to repeat the forward's reduction order: contiguous logits, no
    soft-capping, not class weights with label smoothing (those forwards fold the row in other helpers)."""
    return logits.is_contiguous() and softcap == 0.0 and not (weight is not None and label_smoothing > 0)


def wide_pass_applies(logits: torch.Tensor, label_smoothing: float, weight, softcap: float) -> bool:
    """Whether the Gluon one pass serves the call (:func:`cross_entropy_fwd_bwd_wide_kernel` up to
    ``MAX_BLOCKS`` blocks, :func:`cross_entropy_fwd_bwd_parts_kernel` past them): CUDA (sm_80 or later)
    logits of 2-byte floats, contiguous, 16-byte-aligned rows (the data and ``n_cols``) of more than one
    block; no soft-capping; not class weights with label smoothing."""
    if cross_entropy_fwd_bwd_wide_kernel is None or not logits.is_cuda or logits.element_size() != 2:
        return False
    if not _has_cp_async(logits.device.index):
        return False
    n_cols = logits.shape[1]
    return (
        n_cols > BLOCK
        and n_cols % 8 == 0
        and logits.data_ptr() % 16 == 0
        and one_pass_folds_like_the_forward(logits, label_smoothing, weight, softcap)
    )


def launch_wide_pass(args: tuple, flags: dict) -> None:
    """The one pass over every row of ``args[0]`` (the logits), for which :func:`wide_pass_applies`
    holds; ``args`` and ``flags`` as the Triton one-pass kernel takes them. Rows of more than
    ``STATS_PART`` classes take one program per part and two workspaces: int32 counters (zeroed) and
    the parts' published statistics."""
    logits = args[0]
    rows, n_cols = logits.shape
    args = (*args[:7], n_cols // 8, *args[8:])  # n_cols as whole 16-byte vectors
    num_warps = fwd_config(n_cols)[1]
    if n_cols <= MAX_BLOCKS * BLOCK:
        n_blocks = -(-n_cols // BLOCK)
        cross_entropy_fwd_bwd_wide_kernel[(rows,)](*args, N_BLOCKS=n_blocks, **flags, num_warps=num_warps)
        return
    n_parts = -(-n_cols // STATS_PART.value)
    sync = torch.zeros(rows + 1, dtype=torch.int32, device=logits.device)
    published = torch.empty(rows * (3 * n_parts + 1), dtype=torch.float32, device=logits.device)
    cross_entropy_fwd_bwd_parts_kernel[(rows * n_parts,)](
        *args, sync, published, N_PARTS=n_parts, **flags, num_warps=num_warps
    )
