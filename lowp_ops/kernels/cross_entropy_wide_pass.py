"""Cross entropy forward and backward in one read of the logits for rows of 2 to ``MAX_BLOCKS`` blocks of
8192 classes (Gluon, CUDA): ``overwrite_logits=True`` and the LM head's gradient-in-the-forward chunks.

One program per row (the forward's 4 warps) copies the whole row into shared memory with asynchronous
16-byte copies (``cp.async``), one commit group per 8192-element block, all issued before the first
is used: 64 KB of a row in flight per program and three programs per SM at ``MAX_BLOCKS`` (a block
held in registers keeps 16 KB in flight). It folds the row's statistics block by block as the copies
land, writes the loss and statistics, then forms the gradient from the shared-memory copy and writes
it over the row: 4 bytes of HBM traffic per bf16 element where the forward, the reduction and the
in-place backward move 6.

Bytes: the forward's (``cross_entropy.cross_entropy_fwd_kernel``). Its layout is the one Triton gives
the forward's 8192-element block at 4 warps (8 consecutive elements a thread), it folds the blocks in
the forward's order through the same helper (``softmax.fold_masked_block``: with every lane in the row,
an unmasked block's bits) and forms the loss and gradient through the Triton one-pass kernel's helpers
(``store_row_loss``, ``grad_of_logits``). GPU tests hold it to the two-pass bytes.

Why ``MAX_BLOCKS = 4``: on the H200 (2026-12-03, benchmarks/RESULTS.md, "One pass for rows of up to
32768 classes") the one pass took 0.274 ms against 0.392 ms for the two passes at 8192 x 32768, but rows
of 14-16 blocks (one program per SM, 224 KB of shared memory) ran at 46-54% of copy at its 4-byte floor,
slower than the two passes, with or without the next row's copies issued during a row's stores, 8
warps or two programs per SM re-reading half the row from L2; a row's blocks spread over several
programs that exchange their terms through global memory were slower still (RESULTS.md, "What we
tried": 1.18-1.55 ms against 0.77 ms at 4096 x 129280).
"""

from __future__ import annotations

import functools

import torch

from .bf16_pairs import to_dtype_rne
from .cross_entropy import FWD_BLOCK, fwd_config
from .cross_entropy_math import grad_of_logits, one_row_grad_terms, store_row_loss
from .launch import cached_launch
from .softmax import finish_log_sum, fold_masked_block, masked_safe_shift

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # a Triton without Gluon: the two passes serve these rows
    gluon = gl = async_copy = None

BLOCK = FWD_BLOCK
MAX_BLOCKS = 4
"""The widest row, in blocks: 64 KB of shared memory a program, three programs per SM on the H200."""


if gluon is not None:

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
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
        block: gl.constexpr = 8192
        dtype: gl.constexpr = logits_ptr.dtype.element_ty
        n_cols = n_vecs * 8
        row = gl.program_id(0).to(gl.int64)
        row_ptr = logits_ptr + row * n_cols
        in_block = gl.arange(0, block, layout=layout)
        held = gl.allocate_shared_memory(dtype, [N_BLOCKS, block], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for b in gl.static_range(N_BLOCKS):
            cols = b * block + in_block
            async_copy.async_copy_global_to_shared(held.index(b), row_ptr + cols, mask=cols < n_cols)
            async_copy.commit_group()

        target = gl.load(target_ptr + row).to(gl.int64)
        is_valid = target != ignore_index
        in_range = (target >= 0) & (target < n_cols)
        target_logit = gl.load(row_ptr + target, mask=is_valid & in_range, other=0.0).to(gl.float32)
        m = float("-inf")  # assigned, not passed as literals: literal arguments would be constexprs
        d = 0.0
        total = 0.0
        for b in range(N_BLOCKS):
            # One empty group a step: all but the newest N_BLOCKS groups done is block b done.
            async_copy.commit_group()
            async_copy.wait_group(N_BLOCKS)
            cols = b * block + in_block
            in_row = cols < n_cols
            x = gl.where(in_row, held.index(b).load(layout).to(gl.float32), float("-inf"))
            m, d, total = fold_masked_block(m, d, total, b * block, x, in_row, HAS_SMOOTHING)
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
        for b in range(gl.cdiv(n_cols, block)):
            cols = b * block + in_block
            x = held.index(b).load(layout).to(gl.float32)
            grad = grad_of_logits(
                x, cols, shift, log2_sum, target_col, row_scale, ignored, True, class_weight, alpha, 0.0,
                factor, smoothing_eps, target_weight, 0.0, 0.0, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS, False,
            )  # fmt: skip
            gl.store(row_ptr + cols, to_dtype_rne(grad, dtype), mask=cols < n_cols)

else:
    cross_entropy_fwd_bwd_wide_kernel = None


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
    """Whether :func:`cross_entropy_fwd_bwd_wide_kernel` serves the call: CUDA (sm_80 or later) logits of
    2-byte floats, contiguous, 16-byte-aligned rows (the data and ``n_cols``) of 2 to ``MAX_BLOCKS``
    blocks; no soft-capping; not class weights with label smoothing."""
    if cross_entropy_fwd_bwd_wide_kernel is None or not logits.is_cuda or logits.element_size() != 2:
        return False
    if not _has_cp_async(logits.device.index):
        return False
    n_cols = logits.shape[1]
    return (
        BLOCK < n_cols <= MAX_BLOCKS * BLOCK
        and n_cols % 8 == 0
        and logits.data_ptr() % 16 == 0
        and one_pass_folds_like_the_forward(logits, label_smoothing, weight, softcap)
    )


def launch_wide_pass(args: tuple, flags: dict) -> None:
    """:func:`cross_entropy_fwd_bwd_wide_kernel` over every row of ``args[0]`` (the logits), for which
    :func:`wide_pass_applies` holds; ``args`` and ``flags`` as the Triton one-pass kernel takes them."""
    logits = args[0]
    rows, n_cols = logits.shape
    args = (*args[:7], n_cols // 8, *args[8:])  # n_cols as whole 16-byte vectors
    cross_entropy_fwd_bwd_wide_kernel[(rows,)](
        *args, N_BLOCKS=-(-n_cols // BLOCK), **flags, num_warps=fwd_config(n_cols)[1]
    )
