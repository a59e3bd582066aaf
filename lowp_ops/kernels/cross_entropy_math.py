"""Element-wise ``@triton.jit`` helpers of the cross-entropy kernels: per-row losses, the class-weighted
forward terms, the fp32 gradient of a tile (``softmax_minus_eps``, ``cross_entropy_grad`` and their
class-weighted forms), loading the saved row statistics and rounding to the logits' dtype; and the loss
features' helpers (``softcap_logits``, ``row_stats_weighted_or_capped``, ``add_z_loss``,
``z_loss_factor``), which the kernels call only under their ``HAS_SOFTCAP`` / ``HAS_Z_LOSS``
constexprs, so the code compiled without the features is unchanged.

Shared by ``kernels.cross_entropy`` (Triton), ``kernels.cross_entropy_gluon`` (the same math in an
explicit layout) and ``kernels.vocab_parallel``: one definition, so their bytes agree by construction
(docs/cross_entropy.md).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .bf16_pairs import round_pairs_to_bf16, to_dtype_rne
from .launch import INTERPRETING_CONSTEXPR as INTERPRETING
from .softmax import online_softmax_update, rebase_shifted_sum


@triton.jit
def tanh_fp32(y):
    """fp32 ``tanh``: libdevice's on the GPU; in the interpreter (which has no libdevice ``tanh``)
    ``sign(y) (1 - e) / (1 + e)`` with ``e = exp(-2|y|)`` (±1 at ±inf, NaN at NaN), and below
    ``|y| = 0.1``, where ``1 - e`` cancels (all of it at ``|y| < 3e-8``), its Taylor series to ``y^9``
    (the first term left out is below 1e-12 of ``tanh(y)`` there)."""
    if INTERPRETING:
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        y2 = y * y
        odd = -17.0 / 315.0 + y2 * (62.0 / 2835.0)
        series = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * odd)))
        result = tl.where(tl.abs(y) < 0.1, series, tl.where(y < 0, -t, t))
    else:
        result = libdevice.tanh(y)
    return result


@triton.jit
def softcap_logits(x, softcap, softcap_rcp):
    """Final-logit soft-capping of fp32 ``x``: ``(c tanh(x · (1/c)), tanh(x · (1/c)))``; ``-inf`` stays
    ``-inf`` (a masked class stays masked), and the cap's derivative is ``1 - tanh²`` (0 there)."""
    t = tanh_fp32(x * softcap_rcp)
    return tl.where(x == float("-inf"), float("-inf"), softcap * t), t


@triton.jit
def row_stats_weighted_or_capped(
    row_ptr,
    weight_ptr,
    n_cols,
    softcap,
    softcap_rcp,
    BLOCK: tl.constexpr,
    WITH_SUM: tl.constexpr,
    WEIGHTED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """(max m, ``d = Σ exp(x - shift(m))``, ``Σ w_c (x_c - shift(m))``) in fp32 of one row, ``x`` the
    capped logits with ``HAS_SOFTCAP``; ``w_c = 1`` unless ``WEIGHTED`` (fp32 weights at ``weight_ptr``).
    The sum, rebased by the weight seen so far as the shift moves, is 0 unless ``WITH_SUM``. Rows with
    neither feature use ``softmax.row_stats_and_shifted_sum``."""
    m = float("-inf")
    d = 0.0
    total = 0.0
    weight_seen = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < n_cols
        block = tl.load(row_ptr + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        if HAS_SOFTCAP:
            block, _ = softcap_logits(block, softcap, softcap_rcp)
        m_old = m
        m, d, shifted = online_softmax_update(m, d, block)
        if WITH_SUM:
            if WEIGHTED:  # noqa: SIM108 (a constexpr branch: the other one is never compiled)
                w = tl.load(weight_ptr + cols, mask=in_row, other=0.0)
            else:
                w = in_row.to(tl.float32)
            total = rebase_shifted_sum(total, weight_seen, m_old, m)
            # Masked lanes hold 0 * -inf: excluded (a real -inf logit of weight 0 gives NaN, as torch).
            total += tl.sum(tl.where(in_row, w * shifted, 0.0), 0)
            weight_seen += tl.sum(w, 0)
    return m, d, total


@triton.jit
def add_z_loss(loss, shift, log_sum, z_loss, is_valid):
    """``loss + z · lse · lse`` (``lse = shift + log_sum``) on valid rows; the loss (0) elsewhere. One
    explicit FMA, ``fma(z lse, lse, loss)``, as :func:`row_loss`."""
    lse = shift + log_sum
    return tl.where(is_valid, tl.fma(z_loss * lse, lse, loss), loss)


@triton.jit
def z_loss_factor(shift_ptr, log_sum_ptr, rows_idx, row_ok, z_loss2, base):
    """``base + 2 z lse`` per row (one FMA): the z-loss's share ``2 z lse p_i`` of the gradient joins the
    softmax term's multiplier (1, or the class-weighted ``α``). ``z_loss2`` is ``2 z``."""
    shift = tl.load(shift_ptr + rows_idx, mask=row_ok, other=0.0)
    return z_loss_factor_of(shift, tl.load(log_sum_ptr + rows_idx, mask=row_ok, other=0.0), z_loss2, base)


@triton.jit
def z_loss_factor_of(shift, log_sum, z_loss2, base):
    """:func:`z_loss_factor` of row statistics already in registers."""
    lse = shift + log_sum
    return tl.fma(z_loss2, lse, base)


@triton.jit
def row_loss(
    shift,
    log_sum,
    target_logit,
    shifted_sum,
    n_vocab,
    label_smoothing,
    in_range,
    is_valid,
    HAS_SMOOTHING: tl.constexpr,
):
    """fp32 loss of a row from its statistics (shift, log_sum), target logit and (label smoothing)
    ``Σ (x - shift)`` over the ``n_vocab`` classes: ``(shift - x_y) + log_sum``, or ``(1 - ls)`` times that
    plus ``ls (log_sum - shifted_sum / n_vocab)``. NaN for an out-of-range target (no host sync can check
    it), 0 for an ignored row. Every forward calls this.

    No product meets a sum outside an explicit FMA and the division rounds to nearest, so every kernel
    forms the same bits: left to the compiler, a forward and the one pass contracted the smoothing sum
    differently (H200, 2026-12-02: 15 of 400 random LM-head cases one ulp apart)."""
    loss = (shift - tl.where(in_range, target_logit, float("nan"))) + log_sum
    if HAS_SMOOTHING:
        uniform = log_sum - tl.math.div_rn(shifted_sum, tl.cast(n_vocab, tl.float32))
        loss = tl.fma(1.0 - label_smoothing, loss, label_smoothing * uniform)
    return tl.where(is_valid, loss, 0.0)


@triton.jit
def weighted_row_loss(
    shift,
    log_sum,
    target_logit,
    target_class_weight,
    weighted_shifted_sum,
    smooth_total_ptr,
    smoothing_eps,
    label_smoothing,
    in_range,
    is_valid,
    HAS_SMOOTHING: tl.constexpr,
):
    """fp32 class-weighted loss of a row: ``(1 - ls) w_y ((shift - x_y) + log_sum)`` plus, with label
    smoothing, ``s_w log_sum - eps Σ_c w_c (x_c - shift)`` (``s_w = eps Σ_c w_c`` at ``smooth_total_ptr``).
    NaN for an out-of-range target, 0 for an ignored row. Explicit FMAs, as :func:`row_loss`."""
    nll = (shift - tl.where(in_range, target_logit, float("nan"))) + log_sum
    if HAS_SMOOTHING:
        smooth = tl.fma(tl.load(smooth_total_ptr), log_sum, -(smoothing_eps * weighted_shifted_sum))
        loss = tl.fma((1.0 - label_smoothing) * target_class_weight, nll, smooth)
    else:
        loss = (1.0 - label_smoothing) * target_class_weight * nll
    return tl.where(is_valid, loss, 0.0)


@triton.jit
def store_row_loss(
    row, target, target_logit, shift, log_sum, shifted_sum, loss_ptr, shift_ptr, log_sum_ptr, weight_ptr,
    smooth_total_ptr, n_cols, ignore_index, label_smoothing, smoothing_eps, z_loss,
    HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):  # fmt: skip
    """Store row ``row``'s loss (:func:`loss_of_rows`) and its statistics (shift, log_sum), given its int64
    ``target`` and fp32 target logit (0 where the row is ignored or the target out of range). Every
    one-row forward ends with this."""
    loss = loss_of_rows(
        target, target_logit, shift, log_sum, shifted_sum, weight_ptr, smooth_total_ptr, n_cols, n_cols,
        ignore_index, label_smoothing, smoothing_eps, z_loss, True, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
    )  # fmt: skip
    tl.store(loss_ptr + row, loss)
    tl.store(shift_ptr + row, shift)
    tl.store(log_sum_ptr + row, log_sum)


@triton.jit
def loss_of_rows(
    target, target_logit, shift, log_sum, shifted_sum, weight_ptr, smooth_total_ptr, vocab_total, n_vocab,
    ignore_index, label_smoothing, smoothing_eps, z_loss, row_ok, HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):  # fmt: skip
    """fp32 loss of rows (scalars or vectors) from their int64 targets among ``vocab_total`` classes,
    target logits and statistics: :func:`row_loss` (``n_vocab``: the class count as the smoothing term
    divides by it) or, with class weights, :func:`weighted_row_loss`; plus the z-loss. ``row_ok``: rows
    that exist (their class weight is loaded)."""
    is_valid = target != ignore_index
    in_range = (target >= 0) & (target < vocab_total)
    if HAS_WEIGHT:
        target_class_weight = tl.load(weight_ptr + target, mask=row_ok & is_valid & in_range, other=0.0)
        loss = weighted_row_loss(
            shift, log_sum, target_logit, target_class_weight, shifted_sum, smooth_total_ptr, smoothing_eps,
            label_smoothing, in_range, is_valid, HAS_SMOOTHING,
        )  # fmt: skip
    else:
        loss = row_loss(
            shift, log_sum, target_logit, shifted_sum, n_vocab, label_smoothing, in_range, is_valid,
            HAS_SMOOTHING,
        )  # fmt: skip
    if HAS_Z_LOSS:
        loss = add_z_loss(loss, shift, log_sum, z_loss, is_valid)
    return loss


@triton.jit
def softmax_minus_eps(x, shift, log2_sum, smoothing_eps, HAS_SMOOTHING: tl.constexpr):
    """``exp((x - shift) - log_sum) - eps`` in fp32, ``log_sum`` given as ``log_sum * log2(e)``: one FSUB,
    one FMA and ex2 per element. ``x - shift`` first keeps the digits at any magnitude. The FMA is
    explicit: a kernel that also forms ``(x - shift) * log2(e)`` for the row's sum (the single pass)
    would otherwise share that rounded product."""
    p = tl.exp2(tl.fma(x - shift, 1.4426950408889634, -log2_sum))
    if HAS_SMOOTHING:
        p = p - smoothing_eps
    return p


@triton.jit
def cross_entropy_grad(p, cols, target, row_scale, ignored, target_weight):
    """fp32 dlogits from ``p = softmax_minus_eps(x)``: ``(p - (1 - ls)[col == y]) * row_scale``, exactly 0
    on ignored rows. Row values come broadcast to p's shape (the target as an int32 column, -1 where out
    of range). Every backward kernel calls this one op sequence (``grad_of_logits``, the Gluon
    kernel), which is what makes the MXFP8 kernels' bytes equal quantize(bf16 kernel's output)."""
    p = tl.where(cols == target, p - target_weight, p)
    return tl.where(ignored, 0.0, p * row_scale)


@triton.jit
def load_class_weight_terms(
    target_ptr, weight_ptr, smooth_total_ptr, rows_idx, rows, vocab_total, ignore_index, target_weight
):
    """Class weights, rows ``rows_idx``: (``w_y``, ``α = (1 - ls) w_y + s_w``) in fp32, one FMA, so that
    every kernel forms the same bits (0 and ``s_w`` where the target is out of range: its row scale is
    NaN anyway). ``target_weight`` is ``1 - ls``."""
    row_ok = rows_idx < rows
    target = tl.load(target_ptr + rows_idx, mask=row_ok, other=ignore_index).to(tl.int64)
    in_range = (target >= 0) & (target < vocab_total)
    class_weight = tl.load(weight_ptr + target, mask=row_ok & in_range, other=0.0)
    smooth_total = tl.load(smooth_total_ptr + rows_idx * 0)  # one value, in the rows' layout
    return class_weight, tl.fma(target_weight, class_weight, smooth_total)


@triton.jit
def class_weighted_probs(p, alpha, column_eps, HAS_SMOOTHING: tl.constexpr):
    """``p α - eps w_i`` from ``p = softmax_minus_eps(x)`` (no eps there), ``column_eps = eps * w_i``:
    one explicit FMA (no contraction left to the compiler, which could differ between kernels)."""
    if HAS_SMOOTHING:
        return tl.fma(p, alpha, -column_eps)
    return p * alpha


@triton.jit
def weighted_cross_entropy_grad(q, cols, target, row_scale, ignored, target_weight, class_weight):
    """:func:`cross_entropy_grad` with class weights: ``(q - (1 - ls) w_y [col == y]) * row_scale``, the
    target term one FMA; ``q = class_weighted_probs(...)``, row values broadcast to q's shape."""
    q = tl.where(cols == target, tl.fma(-target_weight, class_weight, q), q)
    return tl.where(ignored, 0.0, q * row_scale)


@triton.jit
def z_loss_cross_entropy_grad(p, z_factor, cols, target, row_scale, ignored, target_weight):
    """:func:`cross_entropy_grad` with z-loss and no label smoothing, from ``p = softmax(x)`` and the
    row's ``z_factor = 1 + 2 z lse``: ``(p z_factor - (1 - ls)[col == y]) * row_scale``, the target term
    one FMA. Spelled out because the plain product and subtraction were contracted into an FMA by the
    kernels that know ``any_special`` when they compile (the one pass, the ragged ends) and not by the
    tile kernels (H200: 5 target elements of 8192 x 1024 fp32 logits one ulp apart)."""
    q = tl.where(cols == target, tl.fma(p, z_factor, -target_weight), p * z_factor)
    return tl.where(ignored, 0.0, q * row_scale)


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (RNE, as the bf16 kernel's store) and widened back to fp32.

    bf16 on the GPU: ``round_pairs_to_bf16`` (H200, fused MXFP8 backward at 4096 x 129280: 78.5% ->
    81.4% of copy against Triton's per-element conversion, same bytes)."""
    bf16_on_gpu = DTYPE == tl.bfloat16 and not INTERPRETING  # noqa: SIM300 (DTYPE is a constexpr)
    return round_pairs_to_bf16(x) if bf16_on_gpu else to_dtype_rne(x, DTYPE).to(tl.float32)


@triton.jit
def load_shift_and_log2_sum(shift_ptr, log_sum_ptr, rows_idx, row_ok):
    """Rows ``rows_idx`` of the row statistics: (shift, log_sum * log2(e))."""
    shift = tl.load(shift_ptr + rows_idx, mask=row_ok, other=0.0)
    log_sum = tl.load(log_sum_ptr + rows_idx, mask=row_ok, other=0.0)
    return shift, log_sum * 1.4426950408889634


@triton.jit
def load_row_stats(
    target_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    rows_idx,
    rows,
    n_cols,
    ignore_index,
    vocab_start,
    vocab_total,
):
    """Rows ``rows_idx`` of a tile: (shift, log_sum * log2(e), int32 target column in this shard (-1 when
    the target is out of range or in another rank's shard), row_scale, ignored). The logits hold the
    vocabulary ids ``[vocab_start, vocab_start + n_cols)`` of ``vocab_total`` (single rank: 0 and
    n_cols). ``row_scale`` is dloss of the row, NaN where the target is outside ``[0, vocab_total)``
    (documented: no host sync can check it)."""
    row_ok = rows_idx < rows
    shift, log2_sum = load_shift_and_log2_sum(shift_ptr, log_sum_ptr, rows_idx, row_ok)
    target = tl.load(target_ptr + rows_idx, mask=row_ok, other=ignore_index).to(tl.int64)
    grad_rows = tl.load(grad_ptr + rows_idx.to(tl.int64) * grad_stride, mask=row_ok, other=0.0)
    target_col, row_scale, ignored = target_terms(
        target, grad_rows, n_cols, ignore_index, vocab_start, vocab_total
    )
    return shift, log2_sum, target_col, row_scale, ignored


@triton.jit
def target_terms(target, grad_rows, n_cols, ignore_index, vocab_start, vocab_total):
    """(int32 target column in this shard or -1, row scale (NaN for a target outside ``[0,
    vocab_total)``), ignored) of int64 ``target`` and fp32 ``grad_rows``: :func:`load_row_stats`' terms."""
    in_range = (target >= 0) & (target < vocab_total)
    row_scale = tl.where(in_range, grad_rows, float("nan"))
    local_target = target - vocab_start
    in_shard = in_range & (local_target >= 0) & (local_target < n_cols)
    target_col = tl.where(in_shard, local_target, -1).to(tl.int32)
    return target_col, row_scale, target == ignore_index


@triton.jit
def one_row_grad_terms(
    row, target, shift, log_sum, target_ptr, grad_ptr, grad_stride, weight_ptr, smooth_total_ptr, n_cols,
    ignore_index, target_weight, z_loss2,
    HAS_GRAD_ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):  # fmt: skip
    """The one-row kernels' row terms of :func:`grad_of_logits` for row ``row`` (int64 ``target``, fp32
    statistics): (target column, row scale, ignored, class weight, α, z-loss factor), the row factor
    ``grad_ptr[row * grad_stride]`` (1 without ``HAS_GRAD_ROWS``)."""
    grad_rows = 1.0
    if HAS_GRAD_ROWS:
        grad_rows = tl.load(grad_ptr + row * grad_stride)
    target_col, row_scale, ignored = target_terms(target, grad_rows, n_cols, ignore_index, 0, n_cols)
    class_weight = 0.0
    alpha = 0.0
    factor = 0.0
    if HAS_WEIGHT:
        class_weight, alpha = load_class_weight_terms(
            target_ptr, weight_ptr, smooth_total_ptr, row, row + 1, n_cols, ignore_index, target_weight
        )
        if HAS_Z_LOSS:
            alpha = z_loss_factor_of(shift, log_sum, z_loss2, alpha)
    elif HAS_Z_LOSS:
        factor = z_loss_factor_of(shift, log_sum, z_loss2, 1.0)
    return target_col, row_scale, ignored, class_weight, alpha, factor


@triton.jit
def load_logits_tile(logits_ptr, stride_row, rows_idx, cols, rows, n_cols, EVEN: tl.constexpr):
    """Logits tile [32, BLOCK_COLS] in the logits' dtype; out-of-bounds lanes read 0 (their gradient is
    never stored)."""
    ptrs = logits_ptr + rows_idx[:, None].to(tl.int64) * stride_row + cols[None, :]
    if EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(rows_idx[:, None] < rows) & (cols[None, :] < n_cols), other=0.0)
    return x


@triton.jit
def grad_of_logits(
    x,
    cols,
    shift,
    log2_sum,
    target,
    row_scale,
    ignored,
    any_special,
    class_weight,
    alpha,
    column_eps,
    z_factor,
    smoothing_eps,
    target_weight,
    softcap,
    softcap_rcp,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """fp32 dlogits of fp32 logits ``x`` with every row value (``load_row_stats``' terms; with class
    weights ``w_y``, ``α`` and ``eps w_i``; with z-loss its factor ``1 + 2 z lse``) broadcast to x's shape.
    ``any_special``: some element's row is ignored or holds its target among ``cols``; without one the
    per-element selects of ``cross_entropy_grad`` are skipped, which computes the same values (H200,
    bf16 backward at 4096 x 129280: 88% -> 98% of copy).

    Loss features: ``HAS_SOFTCAP`` computes on the capped logits and multiplies the gradient by the cap's
    derivative ``1 - tanh²`` last; ``HAS_Z_LOSS`` scales the softmax term by ``1 + 2 z lse`` (with class
    weights, the caller folds it into ``α``). The 32-row tile kernels and the row-segment kernel of
    unaligned rows call this one op sequence: their bytes agree by construction."""
    if HAS_SOFTCAP:
        x, tanh = softcap_logits(x, softcap, softcap_rcp)
    if HAS_WEIGHT:
        p = softmax_minus_eps(x, shift, log2_sum, 0.0, False)
        q = class_weighted_probs(p, alpha, column_eps, HAS_SMOOTHING)
        if any_special:
            grad = weighted_cross_entropy_grad(
                q, cols, target, row_scale, ignored, target_weight, class_weight
            )
        else:
            grad = q * row_scale
    else:
        if HAS_Z_LOSS and not HAS_SMOOTHING:
            p = softmax_minus_eps(x, shift, log2_sum, 0.0, False)
            if any_special:
                grad = z_loss_cross_entropy_grad(p, z_factor, cols, target, row_scale, ignored, target_weight)
            else:
                grad = (p * z_factor) * row_scale
        else:
            if HAS_Z_LOSS:
                p = softmax_minus_eps(x, shift, log2_sum, 0.0, False)
                p = class_weighted_probs(p, z_factor, smoothing_eps, HAS_SMOOTHING)
            else:
                p = softmax_minus_eps(x, shift, log2_sum, smoothing_eps, HAS_SMOOTHING)
            if any_special:
                grad = cross_entropy_grad(p, cols, target, row_scale, ignored, target_weight)
            else:
                grad = p * row_scale
    if HAS_SOFTCAP:
        grad = grad * tl.fma(-tanh, tanh, 1.0)
    return grad


@triton.jit
def row_terms(
    target_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    weight_ptr,
    smooth_total_ptr,
    row,
    rows,
    n_cols,
    ignore_index,
    vocab_start,
    vocab_total,
    target_weight,
    z_loss2,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """The gradient's terms of rows ``row`` (a scalar or a vector of rows): (shift, log_sum * log2(e),
    target column, row scale, ignored, ``w_y``, ``α`` (with z-loss folded in), z-loss factor ``1 + 2 z
    lse``); the last three are 0.0 where their feature is off."""
    shift, log2_sum, target, row_scale, ignored = load_row_stats(
        target_ptr, shift_ptr, log_sum_ptr, grad_ptr, grad_stride, row, rows, n_cols, ignore_index,
        vocab_start, vocab_total,
    )  # fmt: skip
    class_weight = 0.0
    alpha = 0.0
    factor = 0.0
    if HAS_WEIGHT:
        class_weight, alpha = load_class_weight_terms(
            target_ptr, weight_ptr, smooth_total_ptr, row, rows, vocab_total, ignore_index, target_weight
        )
        if HAS_Z_LOSS:
            alpha = z_loss_factor(shift_ptr, log_sum_ptr, row, row < rows, z_loss2, alpha)
    elif HAS_Z_LOSS:
        factor = z_loss_factor(shift_ptr, log_sum_ptr, row, row < rows, z_loss2, 1.0)
    return shift, log2_sum, target, row_scale, ignored, class_weight, alpha, factor


@triton.jit
def program_tile_grad(
    row_block,
    col_tile,
    logits_ptr,
    stride_row,
    target_ptr,
    shift_ptr,
    log_sum_ptr,
    grad_ptr,
    grad_stride,
    rows,
    n_cols,
    ignore_index,
    vocab_start,
    vocab_total,
    smoothing_eps,
    target_weight,
    weight_ptr,
    smooth_total_ptr,
    z_loss2,
    softcap,
    softcap_rcp,
    BLOCK_COLS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """The 32 x BLOCK_COLS tile (``row_block``, ``col_tile``): (rows_idx, cols, fp32 gradient), the
    gradient from :func:`grad_of_logits` (``z_loss2 = 2 z``)."""
    rows_idx = row_block * 32 + tl.arange(0, 32)
    tile_col0 = col_tile * BLOCK_COLS
    cols = tile_col0 + tl.arange(0, BLOCK_COLS)
    x = load_logits_tile(logits_ptr, stride_row, rows_idx, cols, rows, n_cols, EVEN).to(tl.float32)
    shift, log2_sum, target, row_scale, ignored, class_weight, alpha, factor = row_terms(
        target_ptr, shift_ptr, log_sum_ptr, grad_ptr, grad_stride, weight_ptr, smooth_total_ptr, rows_idx,
        rows, n_cols, ignore_index, vocab_start, vocab_total, target_weight, z_loss2, HAS_WEIGHT, HAS_Z_LOSS,
    )  # fmt: skip
    special = ignored | ((target >= tile_col0) & (target < tile_col0 + BLOCK_COLS))
    column_eps = 0.0
    if HAS_WEIGHT:
        column_weight = tl.load(weight_ptr + vocab_start + cols, mask=cols < n_cols, other=0.0)
        column_eps = (smoothing_eps * column_weight)[None, :]
        class_weight = class_weight[:, None]
        alpha = alpha[:, None]
    elif HAS_Z_LOSS:
        factor = factor[:, None]
    grad = grad_of_logits(
        x, cols[None, :], shift[:, None], log2_sum[:, None], target[:, None], row_scale[:, None],
        ignored[:, None], tl.max(special.to(tl.int32), 0) > 0, class_weight, alpha, column_eps, factor,
        smoothing_eps, target_weight, softcap, softcap_rcp, HAS_SMOOTHING, HAS_WEIGHT, HAS_Z_LOSS,
        HAS_SOFTCAP,
    )  # fmt: skip
    return rows_idx, cols, grad
