"""Cross entropy forward and backward in one read of the logits for rows wider than a program's shared
memory (Triton, CUDA): a row's 8192-class blocks are held in the registers of several programs at
once, which exchange the row's statistics through global memory. For ``overwrite_logits=True`` and the
LM head's gradient-in-the-forward chunks at vocabularies past ``cross_entropy_wide_pass.MAX_BLOCKS``
blocks (e.g. 129280 classes: 16 blocks).

A persistent grid takes work items from an atomic ticket, in row-major order: item ``(row, b)`` loads
block ``b`` of the row (the forward's 8192 elements at its 4 warps, so its layout and reductions),
publishes the block's maximum, waits for the maxima of the row's earlier blocks (their running maximum
is the forward's before this block: a maximum is exact in any order), forms the block's
``Σ exp(x - shift)`` (and label smoothing's ``Σ (x - shift)``) relative to that running shift exactly
as the forward does, publishes them, waits for every block of the row, and folds the published terms
in the forward's order (``softmax.online_softmax_update``: the same scalar operations) into the row's
(shift, log_sum). It then writes the gradient over the block it holds; the program holding the target
(block 0 for an ignored row) writes the row's loss and statistics. Bytes: the two passes' (GPU tests).

Each published value is one 64-bit word, the fp32 bits with a flag in the high half, so that seeing
the flag is seeing the value; a zeroed workspace per call resets them (CUDA-graph safe). A program
waits only for items of lower tickets (already taken by running programs) and for the rest of its
own row, whose items are taken next: progress needs as many programs resident at once as a row has
blocks (16 at 129280 classes; the grid keeps several per SM). The waits spin on the GPU; there is
no host synchronization, and the Triton interpreter (one program at a time) cannot run the kernel.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..formats import next_power_of_2
from .bf16_pairs import to_dtype_rne
from .cross_entropy import FWD_BLOCK, fwd_config
from .cross_entropy_math import (
    grad_of_logits,
    load_class_weight_terms,
    store_row_loss,
    target_terms,
    z_loss_factor_of,
)
from .cross_entropy_wide_pass import MAX_BLOCKS as WIDE_MAX_BLOCKS
from .cross_entropy_wide_pass import _has_cp_async
from .launch import cached_launch
from .softmax import LOG2E, finish_log_sum, masked_safe_shift, rebase_shifted_sum

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # a Triton without Gluon: the two passes serve these rows
    gluon = gl = async_copy = None

BLOCK = FWD_BLOCK
MIN_COLS = WIDE_MAX_BLOCKS * BLOCK + 1
"""The narrowest row served: narrower ones fit one program's shared memory (``cross_entropy_wide_pass``)."""
PROGRAMS_PER_SM = 8
"""Resident programs per SM the persistent grid asks for (more than fit just queue for tickets)."""


if gluon is not None:

    @gluon.jit
    def _publish(slot_ptr, value):
        """Store fp32 ``value`` with its ready flag as one 64-bit word."""
        gl.store(slot_ptr, value.to(gl.uint32, bitcast=True).to(gl.int64) | 4294967296)

    @gluon.jit
    def _values(words):
        """The fp32 values of published words."""
        return (words & 4294967295).to(gl.uint32).to(gl.float32, bitcast=True)

    @gluon.jit
    def _wait_for(slot_ptr, lanes, count):
        """Spin until ``slot_ptr[0:count]`` are all published; their words (lanes past ``count``: a flag
        and no value)."""
        words = gl.load(slot_ptr + lanes, mask=lanes < count, other=4294967296, volatile=True)
        while gl.min((words >> 32).to(gl.int32), 0) == 0:
            words = gl.load(slot_ptr + lanes, mask=lanes < count, other=4294967296, volatile=True)
        return words

    @gluon.jit
    def _fold_step(m, d, total, _seen, block_max, block_sum, block_shifted_sum, seen):
        """``softmax.fold_row_blocks``' step for one block's published terms (``seen`` elements before it):
        the forward's scalar operations. Lanes of no block (-inf, 0, 0) leave a finite state as it is."""
        m_new = gl.maximum(m, block_max)
        shift = masked_safe_shift(m_new)
        d = d * gl.exp(m - shift) + block_sum
        total = rebase_shifted_sum(total, seen, m, m_new) + block_shifted_sum
        return m_new, d, total, seen

    @gluon.jit
    def _item_coords(item, n_blocks, n_cols, logits_ptr, work_ptr, NB: gl.constexpr):
        """(row, block, the row's logits, its published words) of work item ``item``."""
        row = (item // n_blocks).to(gl.int64)
        b = (item % n_blocks).to(gl.int32)
        return row, b, logits_ptr + row * n_cols, work_ptr + 16 + row * (3 * NB)

    @gluon.jit
    def _block_terms(item, held, n_cols, n_blocks, logits_ptr, work_ptr, NB: gl.constexpr,
                     HAS_SMOOTHING: gl.constexpr):  # fmt: skip
        """Copy item ``item``'s block into ``held`` and publish its maximum, then (once the row's earlier
        blocks published theirs) its sums relative to the forward's running shift before it."""
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
        words_layout: gl.constexpr = gl.BlockedLayout([NB], [32], [gl.num_warps()], [0])
        block: gl.constexpr = 8192
        _, b, row_ptr, maxes_ptr = _item_coords(item, n_blocks, n_cols, logits_ptr, work_ptr, NB)
        cols = b * block + gl.arange(0, block, layout=layout)
        in_row = cols < n_cols
        # Each thread reads back only what it copied: no barrier between the copy and its use.
        async_copy.async_copy_global_to_shared(held, row_ptr + cols, mask=in_row)
        async_copy.commit_group()
        async_copy.wait_group(0)
        x = gl.where(in_row, held.load(layout).to(gl.float32), float("-inf"))
        block_max = gl.max(x, 0)
        _publish(maxes_ptr + b, block_max)
        lanes = gl.arange(0, NB, layout=words_layout)
        earlier = _values(_wait_for(maxes_ptr, lanes, b))
        m_old = gl.max(gl.where(lanes < b, earlier, float("-inf")), 0)
        shifted = x - masked_safe_shift(gl.maximum(m_old, block_max))
        _publish(maxes_ptr + NB + b, gl.sum(gl.exp2(shifted * LOG2E), 0))
        if HAS_SMOOTHING:
            _publish(maxes_ptr + 2 * NB + b, gl.sum(gl.where(in_row, shifted, 0.0), 0))

    @gluon.jit
    def _finish_block(
        item, held, n_cols, n_blocks, logits_ptr, work_ptr, target_ptr, loss_ptr, shift_ptr, log_sum_ptr,
        grad_ptr, grad_stride, ignore_index, label_smoothing, smoothing_eps, target_weight, weight_ptr,
        smooth_total_ptr, z_loss, z_loss2, NB: gl.constexpr, HAS_GRAD_ROWS: gl.constexpr,
        HAS_SMOOTHING: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_Z_LOSS: gl.constexpr,
    ):  # fmt: skip
        """Once every block of item ``item``'s row is published: fold the row's statistics, write the
        loss and statistics (the program holding the target) and the gradient over the block in
        ``held``."""
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
        # Every thread holds all of a row's words: the fold below runs within one thread, in block order.
        words_layout: gl.constexpr = gl.BlockedLayout([NB], [32], [gl.num_warps()], [0])
        block: gl.constexpr = 8192
        row, b, row_ptr, maxes_ptr = _item_coords(item, n_blocks, n_cols, logits_ptr, work_ptr, NB)
        lanes = gl.arange(0, NB, layout=words_layout)
        in_blocks = lanes < n_blocks
        block_maxes = gl.where(in_blocks, _values(_wait_for(maxes_ptr, lanes, n_blocks)), float("-inf"))
        block_sums = gl.where(in_blocks, _values(_wait_for(maxes_ptr + NB, lanes, n_blocks)), 0.0)
        block_shifted_sums = gl.zeros([NB], gl.float32, words_layout)
        if HAS_SMOOTHING:
            block_shifted_sums = gl.where(
                in_blocks, _values(_wait_for(maxes_ptr + 2 * NB, lanes, n_blocks)), 0.0
            )
        m, d, total, _ = gl.reduce(
            (block_maxes, block_sums, block_shifted_sums, (lanes * block).to(gl.float32)), 0, _fold_step
        )
        shift = masked_safe_shift(m)
        log_sum = finish_log_sum(d)

        cols = b * block + gl.arange(0, block, layout=layout)
        in_row = cols < n_cols
        target = gl.load(target_ptr + row).to(gl.int64)
        has_target = (target != ignore_index) & (target >= 0) & (target < n_cols)
        if b == gl.where(has_target, target // block, 0).to(gl.int32):
            # From the block held: the program holding the target may have overwritten it already.
            x = gl.where(in_row, held.load(layout).to(gl.float32), float("-inf"))
            target_logit = gl.max(gl.where(cols == target, x, float("-inf")), 0)
            target_logit = gl.where(has_target, target_logit, 0.0)
            store_row_loss(
                row, target, target_logit, shift, log_sum, total, loss_ptr, shift_ptr, log_sum_ptr,
                weight_ptr, smooth_total_ptr, n_cols, ignore_index, label_smoothing, smoothing_eps,
                z_loss, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
            )  # fmt: skip

        grad_rows = 1.0
        if HAS_GRAD_ROWS:
            grad_rows = gl.load(grad_ptr + row * grad_stride)
        target_col, row_scale, ignored = target_terms(target, grad_rows, n_cols, ignore_index, 0, n_cols)
        class_weight = 0.0
        alpha = 0.0
        factor = 0.0
        if HAS_WEIGHT:
            class_weight, alpha = load_class_weight_terms(
                target_ptr, weight_ptr, smooth_total_ptr, row, row + 1, n_cols, ignore_index,
                target_weight,
            )  # fmt: skip
            if HAS_Z_LOSS:
                alpha = z_loss_factor_of(shift, log_sum, z_loss2, alpha)
        elif HAS_Z_LOSS:
            factor = z_loss_factor_of(shift, log_sum, z_loss2, 1.0)
        x = held.load(layout).to(gl.float32)
        grad = grad_of_logits(
            x, cols, shift, log_sum * 1.4426950408889634, target_col, row_scale, ignored, True,
            class_weight, alpha, 0.0, factor, smoothing_eps, target_weight, 0.0, 0.0, HAS_SMOOTHING,
            HAS_WEIGHT, HAS_Z_LOSS, False,
        )  # fmt: skip
        gl.store(row_ptr + cols, to_dtype_rne(grad, logits_ptr.dtype.element_ty), mask=in_row)

    @cached_launch
    @gluon.jit
    def cross_entropy_fwd_bwd_row_blocks_kernel(
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
        work_ptr,
        n_items,
        NB: gl.constexpr,
        HAS_GRAD_ROWS: gl.constexpr,
        HAS_SMOOTHING: gl.constexpr,
        HAS_WEIGHT: gl.constexpr,
        HAS_Z_LOSS: gl.constexpr,
    ):
        """Items ``(row, block)`` of contiguous ``(N, n_cols)`` logits, ``n_cols = 8 n_vecs``, until the
        ticket ``work_ptr[0]`` passes ``n_items``: loss, (shift, log_sum) and the gradient for the row
        factor ``grad_ptr[row * grad_stride]`` (1 without ``HAS_GRAD_ROWS``), written over the row.
        ``work_ptr``: zeroed int64, the ticket, then from word 16 ``3 NB`` words a row (module docstring).
        Two items in hand: the next one's copy and terms before the current one's wait for its row."""
        block: gl.constexpr = 8192
        n_cols = n_vecs * 8
        n_blocks = gl.cdiv(n_cols, block)
        held = gl.allocate_shared_memory(
            logits_ptr.dtype.element_ty, [2, block], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        item = gl.atomic_add(work_ptr, 1)
        if item < n_items:
            _block_terms(item, held.index(0), n_cols, n_blocks, logits_ptr, work_ptr, NB, HAS_SMOOTHING)
        buffer = 0
        while item < n_items:
            upcoming = gl.atomic_add(work_ptr, 1)
            if upcoming < n_items:
                _block_terms(
                    upcoming,
                    held.index(1 - buffer),
                    n_cols,
                    n_blocks,
                    logits_ptr,
                    work_ptr,
                    NB,
                    HAS_SMOOTHING,
                )
            _finish_block(
                item, held.index(buffer), n_cols, n_blocks, logits_ptr, work_ptr, target_ptr, loss_ptr,
                shift_ptr, log_sum_ptr, grad_ptr, grad_stride, ignore_index, label_smoothing, smoothing_eps,
                target_weight, weight_ptr, smooth_total_ptr, z_loss, z_loss2, NB, HAS_GRAD_ROWS,
                HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
            )  # fmt: skip
            item = upcoming
            buffer = 1 - buffer

else:
    cross_entropy_fwd_bwd_row_blocks_kernel = None


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def row_blocks_applies(
    logits: torch.Tensor, label_smoothing: float, weight, softcap: float, min_cols: int = MIN_COLS
) -> bool:
    """Whether :func:`cross_entropy_fwd_bwd_row_blocks_kernel` serves the call: CUDA logits (not under the
    interpreter), contiguous rows of at least ``min_cols`` classes, a multiple of 16, from a 16-byte
    aligned base (the forward's vector loads, so its layout); no soft-capping; not class weights with
    label smoothing."""
    if cross_entropy_fwd_bwd_row_blocks_kernel is None or not logits.is_cuda:
        return False
    if not _has_cp_async(logits.device.index):
        return False
    n_cols = logits.shape[1]
    return (
        n_cols >= min_cols
        and n_cols % 16 == 0
        and logits.data_ptr() % 16 == 0
        and logits.is_contiguous()
        and softcap == 0.0
        and not (weight is not None and label_smoothing > 0)
    )


def launch_row_blocks_pass(
    args: tuple, flags: dict, programs_per_sm: int = PROGRAMS_PER_SM, maxnreg: int | None = None
) -> None:
    """:func:`cross_entropy_fwd_bwd_row_blocks_kernel` over every row of ``args[0]`` (the logits), for
    which :func:`row_blocks_applies` holds; ``args`` and ``flags`` as the Triton one-pass kernel takes
    them. One zero-filled workspace allocation besides the launch. ``maxnreg``: a register cap for
    ptxas (more resident programs; probes only)."""
    logits = args[0]
    rows, n_cols = logits.shape
    n_blocks = triton.cdiv(n_cols, BLOCK)
    nb = next_power_of_2(n_blocks)
    work = torch.zeros(16 + rows * 3 * nb, dtype=torch.int64, device=logits.device)
    n_items = rows * n_blocks
    grid = (min(n_items, programs_per_sm * _sm_count(logits.device.index)),)
    args = (*args[:7], n_cols // 8, *args[8:])  # n_cols as whole 16-byte vectors
    cross_entropy_fwd_bwd_row_blocks_kernel[grid](
        *args,
        work,
        n_items,
        NB=nb,
        **flags,
        num_warps=fwd_config(n_cols)[1],
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
