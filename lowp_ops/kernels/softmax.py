"""Masked-safe online softmax (Triton): row statistics shared with the cross entropy, and the
softmax / log_softmax / logsumexp forward and backward kernels.

A row's statistics are its running maximum ``m`` and ``d = Σ exp(x - shift(m))``; every consumer forms
``x - shift`` first and subtracts ``log d`` from that (never ``x - lse`` with a rounded ``lse``), so the
digits survive at any magnitude. Each element costs one FSUB, one FMUL and one ``ex2``.

Masked-safe (docs/cross_entropy.md): the running sum is rescaled by ``exp(m_old - s)`` with the
shift ``s = 0`` while the maximum is infinite, so a row whose first blocks are all ``-inf`` keeps
``d = 0`` instead of turning NaN (``exp(-inf - -inf)``), and a row holding ``+inf`` has ``d = inf``
(``logsumexp = inf``, as PyTorch). Finite rows use ``s = m``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import next_power_of_2
from ..meta.softmax import logsumexp_output, softmax_bwd_output, softmax_fwd_output
from .bf16_pairs import to_dtype_rne
from .launch import PlanCache, cached_launch

MAX_BLOCK = 4096
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def masked_safe_shift(m):
    """The shift of a row whose (running) maximum is ``m``: ``m``, or 0 when ``m`` is infinite."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


@triton.jit
def online_softmax_update(m, d, block):
    """Fold an fp32 block (masked lanes = -inf) into the running max ``m`` and ``d = Σ exp(x - shift)``
    along axis 0. Returns ``(m, d, block - shift)``: the differences serve label smoothing's sum."""
    m_new = tl.maximum(m, tl.max(block, 0))
    shift = masked_safe_shift(m_new)
    shifted = block - shift
    d = d * tl.exp(m - shift) + tl.sum(tl.exp2(shifted * LOG2E), 0)
    return m_new, d, shifted


@triton.jit
def rebase_shifted_sum(total, count, m_old, m_new):
    """``Σ (x - shift(m_old))`` over ``count`` elements -> the same sum relative to ``shift(m_new)``. A
    sum over ``-inf`` elements only (``m_old = -inf``) stays as it is (0 or -inf)."""
    delta = masked_safe_shift(m_old) - masked_safe_shift(m_new)
    return tl.where(m_old == float("-inf"), total, total + count * delta)


@triton.jit
def finish_log_sum(d):
    """``log d``, NaN for a row holding ``+inf`` (its probabilities and loss are NaN, as PyTorch's; a
    finite shift bounds ``d`` by the row length, so ``log d = inf`` only there). All -inf: ``-inf``."""
    log_sum = tl.log(d)
    return tl.where(log_sum == float("inf"), float("nan"), log_sum)


@triton.jit
def row_stats_and_shifted_sum(row_ptr, n_cols, BLOCK: tl.constexpr, WITH_SUM: tl.constexpr):
    """(max m, ``d = Σ exp(x - shift(m))``, ``Σ (x - shift(m))``) in fp32 of one row of ``n_cols``
    contiguous elements, from one pass; the sum (label smoothing needs it) is 0 unless ``WITH_SUM``.
    Whole blocks load without masks; only the tail block is masked."""
    m = float("-inf")  # assigned, not passed as literals: literal arguments would be constexprs
    d = 0.0
    total = 0.0
    return fold_row_blocks(row_ptr, n_cols, m, d, total, 0, BLOCK, WITH_SUM)


@triton.jit
def fold_row_blocks(row_ptr, n_cols, m, d, total, seen, BLOCK: tl.constexpr, WITH_SUM: tl.constexpr):
    """:func:`row_stats_and_shifted_sum` of ``n_cols`` elements at ``row_ptr``, continued from the state
    ``(m, d, total)`` of ``seen`` earlier elements of the row."""
    n_whole = n_cols - n_cols % BLOCK
    for start in range(0, n_whole, BLOCK):
        block = tl.load(row_ptr + start + tl.arange(0, BLOCK)).to(tl.float32)
        m_old = m
        m, d, shifted = online_softmax_update(m, d, block)
        if WITH_SUM:
            total = rebase_shifted_sum(total, (seen + start) * 1.0, m_old, m) + tl.sum(shifted, 0)
    if n_whole < n_cols:
        cols = n_whole + tl.arange(0, BLOCK)
        block = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m, d, total = fold_masked_block(m, d, total, seen + n_whole, block, cols < n_cols, WITH_SUM)
    return m, d, total


STATS_PART = tl.constexpr(32768)
"""The cross entropy forward folds a row in parts of this many classes (:func:`row_stats_in_parts`)."""


@triton.jit
def merge_row_stats(m, d, total, seen, m_part, d_part, total_part, count, WITH_SUM: tl.constexpr):
    """Merge the state ``(m, d, total)`` of a row's first ``seen`` elements with the state of the next
    ``count`` elements folded on their own (from ``m = -inf``, ``d = total = 0``). Each product meets a
    sum only inside an explicit FMA, so every kernel that merges rounds alike."""
    m_new = tl.maximum(m, m_part)
    shift = masked_safe_shift(m_new)
    d = tl.fma(d, tl.exp(m - shift), d_part * tl.exp(m_part - shift))
    if WITH_SUM:
        total = _rebase_fma(total, seen, m, m_new) + _rebase_fma(total_part, count, m_part, m_new)
    return m_new, d, total


@triton.jit
def _rebase_fma(total, count, m_old, m_new):
    """:func:`rebase_shifted_sum` with its product inside an FMA."""
    delta = masked_safe_shift(m_old) - masked_safe_shift(m_new)
    return tl.where(m_old == float("-inf"), total, tl.fma(count * 1.0, delta, total))


@triton.jit
def row_stats_in_parts(row_ptr, n_cols, BLOCK: tl.constexpr, WITH_SUM: tl.constexpr):
    """:func:`row_stats_and_shifted_sum`'s terms with the row folded in parts of ``STATS_PART`` classes,
    each on its own, the parts merged in order (:func:`merge_row_stats`): a kernel that holds one part
    per program (``cross_entropy_wide_pass``) repeats these bits. Rows of at most ``STATS_PART``: the
    bits of :func:`row_stats_and_shifted_sum`."""
    if n_cols <= STATS_PART:
        m, d, total = row_stats_and_shifted_sum(row_ptr, n_cols, BLOCK, WITH_SUM)
    else:
        # Whole parts fold a constant count; the last part's, n_cols less a multiple of STATS_PART, keeps
        # what the compiler knows of n_cols' divisibility (vector-wide masked loads of its tail).
        m, d, total = row_stats_and_shifted_sum(row_ptr, STATS_PART, BLOCK, WITH_SUM)
        last = (n_cols - 1) // STATS_PART * STATS_PART
        for start in range(STATS_PART, last, STATS_PART):
            m_p, d_p, total_p = row_stats_and_shifted_sum(row_ptr + start, STATS_PART, BLOCK, WITH_SUM)
            m, d, total = merge_row_stats(m, d, total, start, m_p, d_p, total_p, STATS_PART, WITH_SUM)
        count = n_cols - last
        m_p, d_p, total_p = row_stats_and_shifted_sum(row_ptr + last, count, BLOCK, WITH_SUM)
        m, d, total = merge_row_stats(m, d, total, last, m_p, d_p, total_p, count, WITH_SUM)
    return m, d, total


@triton.jit
def fold_masked_block(m, d, total, seen, block, in_row, WITH_SUM: tl.constexpr):
    """Fold an fp32 block whose lanes outside ``in_row`` hold ``-inf`` into the state ``(m, d, total)`` of
    ``seen`` earlier elements (:func:`row_stats_and_shifted_sum`'s terms). With every lane in the row
    its bits equal an unmasked block's fold."""
    m_old = m
    m, d, shifted = online_softmax_update(m, d, block)
    if WITH_SUM:
        total = rebase_shifted_sum(total, seen * 1.0, m_old, m)
        total += tl.sum(tl.where(in_row, shifted, 0.0), 0)
    return m, d, total


@triton.jit
def row_stats_peeled(
    x_ptr, row_start, n_cols, BLOCK: tl.constexpr, WITH_SUM: tl.constexpr, ALIGN: tl.constexpr,
    IN_PARTS: tl.constexpr = False,
):  # fmt: skip
    """:func:`row_stats_and_shifted_sum` of the row at element ``row_start`` of ``x_ptr`` (16-byte
    aligned), ``ALIGN`` elements per 16 bytes: first the row's body, from its first 16-byte boundary to
    its last whole ``ALIGN``-element vector, in vector-wide loads; then the up to ``2 (ALIGN - 1)``
    elements at its two ends in one masked block. For rows whose stride Triton cannot prove a multiple
    of 16 bytes (H200, 8192 x 50257 bf16: 76% of copy unpeeled). ``IN_PARTS``: the body in
    :func:`row_stats_in_parts`' parts, for rows that start on 16-byte boundaries (``n_cols`` a multiple
    of ``ALIGN``, not of 16 elements), which the one pass in parts also serves."""
    head = tl.minimum((ALIGN - row_start % ALIGN) % ALIGN, n_cols).to(tl.int32)
    body_len = n_cols - head
    body_end = tl.multiple_of(body_len - body_len % ALIGN, ALIGN)
    body = x_ptr + tl.multiple_of(row_start + head, ALIGN)
    if IN_PARTS:
        m, d, total = row_stats_in_parts(body, body_end, BLOCK, WITH_SUM)
    else:
        m = float("-inf")
        d = 0.0
        total = 0.0
        m, d, total = fold_row_blocks(body, body_end, m, d, total, 0, BLOCK, WITH_SUM)
    lane = tl.arange(0, 2 * ALIGN)
    ragged = tl.where(lane < ALIGN, lane, head + body_end + lane - ALIGN)
    ragged_ok = tl.where(lane < ALIGN, lane < head, ragged < n_cols)
    block = tl.load(x_ptr + row_start + ragged, mask=ragged_ok, other=float("-inf")).to(tl.float32)
    return fold_masked_block(m, d, total, body_end, block, ragged_ok, WITH_SUM)


@cached_launch
@triton.jit
def logsumexp_kernel(x_ptr, stride_row, lse_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m, d, _ = row_stats_and_shifted_sum(x_ptr + row * stride_row, n_cols, BLOCK, False)
    tl.store(lse_ptr + row, masked_safe_shift(m) + tl.log(d))


@triton.jit
def softmax_values(shifted, log_sum, LOG: tl.constexpr, MASKED_ROWS_ZERO: tl.constexpr):
    """softmax (``exp(shifted - log_sum)``) or log_softmax (``shifted - log_sum``) of fp32 ``x - shift``
    given the row's ``log_sum`` (:func:`finish_log_sum`)."""
    if LOG:  # noqa: SIM108  (a constexpr branch reads better than a ternary in a kernel)
        out = shifted - log_sum
    else:
        out = tl.exp2(shifted * LOG2E - log_sum * LOG2E)
    if MASKED_ROWS_ZERO:
        # An all -inf row (log_sum = -inf) gives probabilities 0 (log-probabilities -inf) instead of NaN.
        out = tl.where(log_sum == float("-inf"), float("-inf") if LOG else 0.0, out)
    return out


@cached_launch(fp_fusion=None)  # compiled graphs launch it (inline_kernels)
@triton.jit
def softmax_fwd_kernel(
    x_ptr,
    stride_row,
    out_ptr,
    n_cols,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    LOG: tl.constexpr,
    MASKED_ROWS_ZERO: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_row
    out_row_ptr = out_ptr + row * n_cols
    if ONE_BLOCK:
        # The row fits in one block: one read, statistics and output from registers.
        cols = tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        _, d, shifted = online_softmax_update(float("-inf"), 0.0, x)
        out = softmax_values(shifted, finish_log_sum(d), LOG, MASKED_ROWS_ZERO)
        tl.store(out_row_ptr + cols, to_dtype_rne(out, out_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        m, d, _ = row_stats_and_shifted_sum(row_ptr, n_cols, BLOCK, False)
        shift = masked_safe_shift(m)
        log_sum = finish_log_sum(d)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            out = softmax_values(x - shift, log_sum, LOG, MASKED_ROWS_ZERO)
            tl.store(out_row_ptr + cols, to_dtype_rne(out, out_ptr.dtype.element_ty), mask=cols < n_cols)


@cached_launch(fp_fusion=None)  # compiled graphs launch it (inline_kernels)
@triton.jit
def softmax_bwd_kernel(out_ptr, grad_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr, LOG: tl.constexpr):
    """softmax: ``dx = y * (dy - Σ dy*y)``; log_softmax: ``dx = dy - exp(y) * Σ dy``. A row whose output
    is all -inf (a masked row under ``masked_rows="zero"``) gets dx = 0; a NaN row (an all -inf row
    under ``"nan"``) gets NaN, as the reference and PyTorch."""
    row = tl.program_id(0).to(tl.int64)
    offset = row * n_cols
    total = 0.0
    not_minus_inf = 0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(out_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            total += tl.sum(dy, 0)
            # NaN != -inf: a NaN row is not a masked one (a maximum could drop the NaN).
            not_minus_inf += tl.sum((mask & (y != float("-inf"))).to(tl.int32), 0)
        else:
            total += tl.sum(dy * y, 0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(out_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp(y) * total
            dx = tl.where(not_minus_inf == 0, 0.0, dx)
        else:
            dx = y * (dy - total)
        tl.store(dx_ptr + offset + cols, to_dtype_rne(dx, dx_ptr.dtype.element_ty), mask=mask)


def row_block(n_cols: int) -> int:
    return min(MAX_BLOCK, next_power_of_2(max(n_cols, 1)))


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def launch_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """fp32 masked-safe log-sum-exp of each row of a 2-D ``x``."""
    key = ("logsumexp", x.shape, x.stride(), x.dtype, x.device)
    return _PLANS.get(key, _logsumexp_plan, x)(x)


def launch_softmax_fwd(x: torch.Tensor, log: bool, masked_rows: str) -> torch.Tensor:
    key = ("fwd", x.shape, x.stride(), x.dtype, x.device, log, masked_rows)
    return _PLANS.get(key, _fwd_plan, x, log, masked_rows)(x)


def launch_softmax_bwd(out: torch.Tensor, grad: torch.Tensor, log: bool) -> torch.Tensor:
    key = ("bwd", out.shape, out.stride(), out.dtype, out.device, grad.shape, grad.stride(), grad.dtype, log)
    return _PLANS.get(key, _bwd_plan, out, grad, log)(out, grad)


# The launchers' plans, one per specialization (shapes, strides, dtypes, devices, flags): the checks,
# grids and constexprs depend on nothing else, so a call only allocates and launches. Plans hold no
# tensor: compiled graphs trace these launchers (``inline_kernels``) and later eager calls reuse them.
_PLANS = PlanCache()


def _logsumexp_plan(x: torch.Tensor):
    logsumexp_output(x)  # the checks
    rows, n_cols = x.shape
    if rows == 0:
        return lambda x: logsumexp_output(x)
    copy = x.stride(1) != 1  # rows_with_unit_stride
    x_stride = n_cols if copy else x.stride(0)
    block = row_block(n_cols)
    launch = logsumexp_kernel.bind((rows,), BLOCK=block, num_warps=_num_warps(block))

    def call(x):
        lse = x.new_empty((rows,), dtype=torch.float32)
        launch(x.contiguous() if copy else x, x_stride, lse, n_cols)
        return lse

    return call


def _fwd_plan(x: torch.Tensor, log: bool, masked_rows: str):
    softmax_fwd_output(x, log, masked_rows)  # the checks
    rows, n_cols = x.shape
    shape = x.shape
    if rows == 0 or n_cols == 0:
        return lambda x: x.new_empty(shape)
    copy = x.stride(1) != 1  # rows_with_unit_stride
    x_stride = n_cols if copy else x.stride(0)
    block = row_block(n_cols)
    launch = softmax_fwd_kernel.bind(
        (rows,),
        BLOCK=block,
        ONE_BLOCK=n_cols <= block,
        LOG=log,
        MASKED_ROWS_ZERO=masked_rows == "zero",
        num_warps=_num_warps(block),
    )

    def call(x):
        out = x.new_empty(shape)
        launch(x.contiguous() if copy else x, x_stride, out, n_cols)
        return out

    return call


def _bwd_plan(out: torch.Tensor, grad: torch.Tensor, log: bool):
    softmax_bwd_output(out, grad, log)  # the checks
    rows, n_cols = out.shape
    shape = out.shape
    if rows == 0 or n_cols == 0:
        return lambda out, grad: out.new_empty(shape)
    copy_out, copy_grad = not out.is_contiguous(), not grad.is_contiguous()
    block = row_block(n_cols)
    launch = softmax_bwd_kernel.bind((rows,), BLOCK=block, LOG=log, num_warps=_num_warps(block))

    def call(out, grad):
        dx = out.new_empty(shape)
        launch(out.contiguous() if copy_out else out, grad.contiguous() if copy_grad else grad, dx, n_cols)
        return dx

    return call
