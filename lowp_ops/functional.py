"""Public loss and softmax functions (thin wrappers over ``torch.ops.lowp``), named like
``torch.nn.functional`` so that users swap one import."""

from __future__ import annotations

import math

import torch
from torch.nn._reduction import legacy_get_string

from . import library
from .formats import FP8_DTYPES, MXFP8Tensor
from .meta.checks import check_bool, check_int, check_real, require, require_tensor
from .meta.cross_entropy import (
    LOG_SUM,
    SHIFT,
    check_class_weight,
    check_grad_loss,
    check_logits_target,
    check_reduction,
    public_label_smoothing,
    public_softcap,
    public_z_loss,
)
from .meta.mxfp8 import check_scale_layout, normalize_fp8_dtype
from .meta.softmax import check_masked_rows
from .meta.split_sizes import check_split_sizes
from .reference.cross_entropy import loss_grad_rows

__all__ = [
    "cross_entropy",
    "cross_entropy_with_mxfp8_grad",
    "dglu",
    "log_softmax",
    "logsumexp",
    "rms_norm",
    "softmax",
    "swiglu",
]

_SOFT_TARGET_ERROR = (
    "target holds class probabilities (a floating tensor); lowp_ops.cross_entropy takes class indices "
    "(int64/int32) only: use torch.nn.functional.cross_entropy for probability targets"
)


def _check_loss_args(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> None:
    """Types and values of the scalar arguments, and the target's kind and device, before any kernel."""
    require_tensor(logits, "input")
    require_tensor(target, "target")
    if target.is_floating_point():
        raise ValueError(_SOFT_TARGET_ERROR)
    require(
        target.device == logits.device,
        lambda: f"target must be on the logits' device {logits.device}, got {target.device}",
    )
    check_int(ignore_index, "ignore_index")
    check_reduction(reduction)


def _class_rows(
    logits: torch.Tensor, target: torch.Tensor, classes_last: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, C)`` logits and ``(N,)`` targets from torch's layouts (classes in dim 1: ``(C,)`` with a 0-d
    target, ``(N, C)``, ``(N, C, d1, ...)`` with ``(N, d1, ...)``), or from ``(..., C)`` / ``(...)`` when
    ``classes_last``. A 2-D input is the same in both; other layouts are moved to classes-last (a copy)."""
    if not classes_last and logits.dim() != 2:
        require(logits.dim() >= 1, lambda: "input must have at least one dimension (the classes)")
        if logits.dim() == 1:
            logits = logits.unsqueeze(0)
            require(
                target.dim() == 0, lambda: f"target must be 0-d for a (C,) input, got {tuple(target.shape)}"
            )
            target = target.reshape(1)
        else:
            expected = (logits.shape[0], *logits.shape[2:])
            require(
                tuple(target.shape) == expected,
                lambda: (
                    f"target must have shape {expected} for input {tuple(logits.shape)} (classes in "
                    "dim 1, as torch; pass classes_last=True for (..., C) logits), got "
                    f"{tuple(target.shape)}"
                ),
            )
            logits = logits.movedim(1, -1)
    check_logits_target(logits, target)
    n_cols = logits.shape[-1]
    require(n_cols >= 1, lambda: "logits must have a non-empty class dimension")
    if logits.dim() == 2:  # already rows: no view to build
        return logits, target
    return logits.reshape(-1, n_cols), target.reshape(-1)


def reduce_row_losses(
    loss_rows: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    ignore_index: int,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``F.cross_entropy``'s reductions of per-row fp32 losses (N,) for ``target`` (any shape, N
    elements): ``"none"`` in ``target``'s shape, the sum, or the mean over non-ignored rows (NaN when
    every row is ignored, as PyTorch; with class ``weight`` it divides by the rows' target weights); one
    ``lowp::cross_entropy_reduce``, the count on the device."""
    return _reduce(loss_rows, target, reduction, ignore_index, weight)[0]


def _reduce(
    loss_rows: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    ignore_index: int,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(reduced loss, dloss/dloss_row as a 0-d tensor; None for ``"none"``)."""
    if reduction == "none":
        return loss_rows.view(target.shape), None
    return library.cross_entropy_reduce(
        loss_rows, target.reshape(-1), ignore_index, reduction == "mean", weight
    )


def check_return_flags(return_z_loss, return_lse) -> None:
    """``return_z_loss`` and ``return_lse`` are bools (TypeError naming the argument otherwise)."""
    check_bool(return_z_loss, "return_z_loss")
    check_bool(return_lse, "return_lse")


def loss_extras(
    stats: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    ignore_index: int,
    weight: torch.Tensor | None,
    z_loss: float,
    return_z_loss: bool,
    return_lse: bool,
) -> tuple[torch.Tensor, ...]:
    """The requested detached extras of a loss from its ``(2, N)`` row statistics, in this order: the
    z-loss ``z · lse²`` of the non-ignored rows reduced as the loss (same denominator for the mean; the
    target's shape for ``none``), then the fp32 per-row ``lse = shift + log_sum`` in the target's shape.
    N elements of arithmetic: no pass over the logits."""
    from .reference.cross_entropy import z_loss_rows

    stats = stats.detach()
    extras = []
    if return_z_loss:
        target_rows = target.reshape(-1)
        rows = torch.where(
            target_rows != ignore_index, z_loss_rows(stats[SHIFT], stats[LOG_SUM], z_loss), 0.0
        )
        extras.append(reduce_row_losses(rows, target, reduction, ignore_index, weight).detach())
    if return_lse:
        extras.append((stats[SHIFT] + stats[LOG_SUM]).view(target.shape))
    return tuple(extras)


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0,
    *,
    classes_last: bool = False,
    process_group=None,
    z_loss: float = 0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_lse: bool = False,
    overwrite_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``torch.nn.functional.cross_entropy``: same signature, argument order and layouts, for class-index
    targets; float32 loss.

    Layouts as torch: ``(C,)`` with a 0-d target, ``(N, C)`` with ``(N,)``, ``(N, C, d1, ...)`` with
    ``(N, d1, ...)`` (classes in dim 1; moved last with a copy). ``classes_last=True`` declares
    ``(..., C)`` logits with ``(...)`` targets, the LLM layout ``(B, T, V)``: no copy. Shapes are never
    used to guess the layout. ``size_average`` / ``reduce`` are torch's deprecated spellings of
    ``reduction``. Logits bf16/fp16/fp32, any strides; targets int64/int32 on the logits' device.
    Probability (floating) targets raise ValueError.

    Returns a float32 loss (0-d for ``mean``/``sum``, the target's shape for ``none``). The forward keeps
    only per-row statistics; the backward recomputes the gradient from the saved logits (never
    modified) in their dtype. Masked-safe: ``-inf`` logits anywhere (also whole leading blocks) are exact;
    an all ``-inf`` row gives NaN like PyTorch. Ignored rows give loss 0 and gradient 0 (also all ``-inf``
    ones). A target outside ``[0, C)`` other than ``ignore_index`` gives a NaN loss and NaN gradient row
    (checked on device, no host sync). The mean over no valid row is NaN, as torch.

    ``process_group``: vocabulary-parallel loss (:mod:`lowp_ops.distributed`). Each rank passes the logits
    of its equal-width vocabulary shard (rank order) and the same global targets; every rank returns the
    same loss (one all-gather of per-row statistics in the forward, none in the backward), and its
    gradient is its shard of the single-rank gradient.

    Loss features for LLM recipes (docs/cross_entropy.md#z-loss-and-soft-capping), computed inside the
    same kernels:

    - ``z_loss``: coefficient ``z >= 0`` of PaLM's z-loss; every non-ignored row's loss gains ``z · lse²``
      (not multiplied by a class weight), ``lse`` the row's log-sum-exp, gradient ``2 z lse softmax``.
    - ``softcap``: None, or ``c > 0``: the logits become ``c · tanh(x · fp32(1/c))`` before the softmax
      (Gemma 2/3's final-logit soft-capping), the gradient goes through it (``1 - tanh²``); a ``-inf``
      logit stays ``-inf`` (a masked class stays masked), ``+inf`` becomes ``c``.
    - ``return_z_loss``: also return the z-loss alone (detached, for logging), reduced as the loss (the
      same mean denominator, the sum, or per row for ``none``); it is already part of the loss.
    - ``return_lse``: also return the fp32 per-row log-sum-exp of the (capped) logits in the target's
      shape (detached; for an ignored row its value is computed all the same).

    ``overwrite_logits=True`` saves the ``N x V`` gradient buffer (as TE's and Liger's losses do): when a
    gradient is needed, the forward writes the logits' gradient for ``grad_loss = 1`` over the logits
    (contiguous, 2-D or ``classes_last``, the output of an op such as the LM head's matmul, not a leaf
    that requires grad) right after computing the loss, and the backward returns that buffer, multiplied
    in place by ``grad_loss`` only in rows where it is not 1 (decided on the device: no host sync,
    CUDA-graph safe; a compiled backward multiplies out of place, docs/cross_entropy.md). The logits hold
    the gradient afterwards: their version counter moves, so autograd refuses a backward through any op
    that saved them. Its bytes equal the
    default path's gradient when ``grad_loss`` is 1 (and when it is a power of two, barring overflow and
    subnormals; otherwise the product is rounded once more). Not with ``process_group``, nor with fp16
    logits (raises: a loss scale applied after the fp16 rounding cannot bring back what rounded to
    subnormals). Without a gradient to compute the logits stay untouched.

    Returns the loss, or with ``return_z_loss`` / ``return_lse`` the tuple ``(loss, z_loss, lse)`` holding
    only the requested extras, in that order.
    """
    if size_average is not None or reduce is not None:
        reduction = legacy_get_string(size_average, reduce)
    _check_loss_args(input, target, ignore_index, reduction)
    smoothing = public_label_smoothing(label_smoothing)
    z_loss, softcap = public_z_loss(z_loss), public_softcap(softcap)
    check_return_flags(return_z_loss, return_lse)
    check_bool(classes_last, "classes_last")
    logits_rows, target_rows = _class_rows(input, target, classes_last)
    overwrite = overwrite_logits is not False and _overwrites(
        overwrite_logits, input, classes_last, process_group
    )
    if process_group is None:
        check_class_weight(weight, logits_rows.shape[1], logits_rows)
        loss, stats = library.cross_entropy_loss(
            logits_rows, target_rows, smoothing, ignore_index, reduction, weight, z_loss,
            softcap, overwrite,
        )  # fmt: skip
        if reduction == "none" and target.dim() != 1:  # mean / sum are 0-d, rows are (N,)
            loss = loss.view(target.shape)
    else:
        from .distributed import check_process_group, vocab_parallel_cross_entropy_rows, vocab_shard

        check_process_group(process_group)
        check_class_weight(weight, vocab_shard(logits_rows.shape[1], process_group)[1], logits_rows)
        loss_rows, stats = vocab_parallel_cross_entropy_rows(
            logits_rows, target_rows, smoothing, ignore_index, process_group, weight,
            z_loss, softcap, with_stats=True,
        )  # fmt: skip
        loss = reduce_row_losses(loss_rows, target, reduction, ignore_index, weight)
    if not (return_z_loss or return_lse):
        return loss
    extras = loss_extras(stats, target, reduction, ignore_index, weight, z_loss, return_z_loss, return_lse)
    return (loss, *extras)


def _overwrites(overwrite_logits, input: torch.Tensor, classes_last: bool, process_group) -> bool:
    """Whether the forward writes the gradient over the logits (``overwrite_logits`` given, not False): the
    arguments checked, and a gradient is needed. The rows :func:`_class_rows` makes alias a contiguous
    input when its classes are last (or it has no dims past the classes); decided from the layout, not by
    comparing data pointers, which Dynamo cannot trace."""
    check_bool(overwrite_logits, "overwrite_logits")
    require(process_group is None, lambda: "overwrite_logits=True does not combine with process_group")
    require(
        input.is_contiguous() and (classes_last or input.dim() <= 2 or math.prod(input.shape[2:]) == 1),
        lambda: (
            "overwrite_logits=True needs contiguous logits with classes in the last dim ((N, C), or "
            f"classes_last=True), got shape {tuple(input.shape)} strides {input.stride()}"
        ),
    )
    require(
        not (input.is_leaf and input.requires_grad),
        lambda: "overwrite_logits=True needs logits computed in the graph (not a leaf that requires grad)",
    )
    # The gradient for grad_loss = 1, rounded to fp16 before a loss scale multiplies it, loses it to
    # subnormals (or overflows for a sum): the default path folds grad_loss in first.
    require(
        input.dtype != torch.float16,
        lambda: (
            "overwrite_logits=True takes bf16 or fp32 logits: in fp16 the gradient written for grad_loss = 1 "
            "and multiplied by a loss scale afterwards (torch.amp.GradScaler) rounds to subnormals; use the "
            "default path (overwrite_logits=False) for fp16 logits"
        ),
    )
    return input.requires_grad and torch.is_grad_enabled()


def _loss_and_grad_rows(
    loss_rows: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduced loss and dloss per row (N,) fp32 for the gradient ``grad_loss`` of that loss (ones
    when None): one reduction kernel, plus one multiply when ``grad_loss`` is given."""
    loss, grad_scale = _reduce(loss_rows, target, reduction, ignore_index, weight)
    check_grad_loss(grad_loss, loss.shape, loss.device)
    if grad_loss is not None and grad_scale is None:
        grad_loss = grad_loss.reshape(-1)  # the target's shape
    return loss, loss_grad_rows(grad_loss, grad_scale, loss_rows.shape[0], loss_rows)


def cross_entropy_with_mxfp8_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0,
    ignore_index: int = -100,
    reduction: str = "mean",
    fp8_dtype: str | torch.dtype = "e4m3",
    rowwise: bool = True,
    columnwise: bool = True,
    scale_layout: str = "compact",
    weight: torch.Tensor | None = None,
    process_group=None,
    z_loss: float = 0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_lse: bool = False,
) -> tuple[torch.Tensor, MXFP8Tensor] | tuple[torch.Tensor, MXFP8Tensor, torch.Tensor]:
    """The loss and the gradient of ``grad_loss · loss`` w.r.t. the logits, written directly as MXFP8.

    For frameworks that consume the quantized gradient. ``logits`` are ``(..., V)`` with ``(...)``
    targets: classes last, always (the MXFP8 blocks run along the vocabulary). ``grad_loss`` defaults to
    ones (a scalar for ``mean``/``sum``, ``target.shape`` for ``none``). ``fp8_dtype``: ``"e4m3"`` /
    ``"e5m2"`` or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``. ``weight``: class weights (V,) as
    :func:`cross_entropy`'s (the whole vocabulary's with ``process_group``). The returned loss is detached.
    Contract, byte for byte on one device: the payload equals ``mxfp8_quantize(g)`` where ``g`` is the
    logits' gradient :func:`cross_entropy` 's backward returns for the same inputs (both copies and both
    scale tensors). Any N and V.

    ``process_group``: vocabulary-parallel (see :func:`cross_entropy`); the payload is this rank's shard,
    byte-identical to the shard's columns of the single-rank payload given the same lse when the shard
    width is a multiple of 32 (compact scales: compare the valid regions; each shard pads its own).

    ``z_loss``, ``softcap``, ``return_z_loss``, ``return_lse``: as :func:`cross_entropy` (the contract
    above holds with them); extras come after the payload: ``(loss, grad, z_loss, lse)``, only those
    requested.
    """
    _check_loss_args(logits, target, ignore_index, reduction)
    smoothing = public_label_smoothing(label_smoothing)
    z_loss, softcap = public_z_loss(z_loss), public_softcap(softcap)
    check_return_flags(return_z_loss, return_lse)
    logits_rows, target_rows = _class_rows(logits, target, classes_last=True)
    fp8_dtype = normalize_fp8_dtype(fp8_dtype)
    check_scale_layout(scale_layout)
    check_bool(rowwise, "rowwise")
    check_bool(columnwise, "columnwise")
    require(rowwise or columnwise, lambda: "at least one of rowwise and columnwise must be True")
    args = (
        logits_rows, target_rows, target, grad_loss, smoothing, ignore_index, reduction,
        fp8_dtype, rowwise, columnwise, scale_layout, weight, process_group, z_loss, softcap,
    )  # fmt: skip
    # The loss is returned detached: no graph is recorded (grad mode is only switched where one could be).
    if torch.is_grad_enabled() and _any_requires_grad(logits, grad_loss, weight):
        with torch.no_grad():
            loss, lse, row_data, row_scale, col_data, col_scale = _mxfp8_loss_outputs(*args)
    else:
        loss, lse, row_data, row_scale, col_data, col_scale = _mxfp8_loss_outputs(*args)
    data_dtype = FP8_DTYPES[fp8_dtype]
    as_logits = logits.dim() != 2  # the op's payload is (N, V)
    grad = MXFP8Tensor.of_op_outputs(
        _fp8_view(row_data, data_dtype, logits.shape, as_logits) if rowwise else None,
        row_scale if rowwise else None,
        _fp8_view(col_data, data_dtype, logits.shape, as_logits) if columnwise else None,
        col_scale if columnwise else None,
        fp8_dtype,
        scale_layout,
        logits.shape,
    )
    if not (return_z_loss or return_lse):
        return loss, grad
    extras = loss_extras(lse, target, reduction, ignore_index, weight, z_loss, return_z_loss, return_lse)
    return (loss, grad, *extras)


def _any_requires_grad(*values) -> bool:
    """Whether one of ``values`` is a tensor that requires grad (other values: checked later)."""
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _mxfp8_loss_outputs(
    logits_rows, target_rows, target, grad_loss, smoothing, ignore_index, reduction, fp8_dtype, rowwise,
    columnwise, scale_layout, weight, process_group, z_loss, softcap,
):  # fmt: skip
    """:func:`cross_entropy_with_mxfp8_grad`'s ops on ``(N, V)`` logits and ``(N,)`` targets (of the
    caller's ``target``): ``(loss, lse, row_data, row_scale, col_data, col_scale)``, the loss in
    ``target``'s shape for ``none``, the data uint8."""
    if process_group is None:
        check_class_weight(weight, logits_rows.shape[1], logits_rows)
        check_grad_loss(grad_loss, target.shape if reduction == "none" else (), logits_rows.device)
        if grad_loss is not None and reduction == "none":
            grad_loss = grad_loss.reshape(-1)
        loss, lse, *payload = library.cross_entropy_mxfp8_grad(
            logits_rows, target_rows, grad_loss, smoothing, ignore_index, reduction, fp8_dtype, rowwise,
            columnwise, scale_layout, weight, z_loss, softcap,
        )  # fmt: skip
        if reduction == "none" and target.dim() != 1:
            loss = loss.view(target.shape)
        return loss, lse, *payload
    from .distributed import check_process_group, vocab_parallel_cross_entropy_stats, vocab_shard

    check_process_group(process_group)
    shard = vocab_shard(logits_rows.shape[1], process_group)
    check_class_weight(weight, shard[1], logits_rows)
    loss_rows, lse = vocab_parallel_cross_entropy_stats(
        logits_rows, target_rows, smoothing, ignore_index, process_group, weight, z_loss, softcap
    )
    loss, grad_rows = _loss_and_grad_rows(loss_rows, target, grad_loss, reduction, ignore_index, weight)
    payload = library.cross_entropy_bwd_mxfp8(
        logits_rows, target_rows, lse, grad_rows, smoothing, ignore_index, fp8_dtype, rowwise, columnwise,
        scale_layout, *shard, weight, z_loss, softcap,
    )  # fmt: skip
    return loss, lse, *payload


def _fp8_view(data: torch.Tensor, dtype: torch.dtype, shape: torch.Size, reshape: bool) -> torch.Tensor:
    """uint8 MXFP8 data as ``dtype``, in ``shape`` when ``reshape`` (one view fewer for 2-D logits)."""
    return data.view(dtype).view(shape) if reshape else data.view(dtype)


def _check_softmax_input(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    require(isinstance(x, torch.Tensor), lambda: f"input must be a Tensor, got {type(x).__name__}")
    if dtype is not None:
        require(isinstance(dtype, torch.dtype), lambda: f"dtype must be a torch.dtype, got {dtype!r}")
        x = x.to(dtype)
    require(x.dim() >= 1, lambda: "input must have at least one dimension, got a 0-d tensor")
    return x


def _dim_index(dim, ndim: int) -> int:
    """``dim`` (an int in ``[-ndim, ndim)``, as torch takes it) as an index in ``[0, ndim)``; IndexError
    naming ``dim`` otherwise (a float or a bool is a TypeError)."""
    check_int(dim, "dim")
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim out of range (expected to be in [{-ndim}, {ndim - 1}], but got {dim})")
    return dim % ndim


def _as_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """``x`` as (rows, x.shape[dim]) and, when ``dim`` is not last, the moved shape to undo it."""
    if dim == x.dim() - 1:
        return (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])), None
    moved = x.movedim(dim, -1)
    return moved.reshape(-1, moved.shape[-1]), moved.shape


def _softmax(x: torch.Tensor, dim: int, log: bool, masked_rows: str, dtype) -> torch.Tensor:
    check_masked_rows(masked_rows)
    x = _check_softmax_input(x, dtype)
    dim = _dim_index(dim, x.dim())
    if x.numel() == 0:  # nothing to compute: torch's own empty result (and gradient)
        return torch.log_softmax(x, dim) if log else torch.softmax(x, dim)
    rows, moved_shape = _as_rows(x, dim)
    out = library.softmax_fwd(rows, log, masked_rows)
    if rows is x:  # no view to undo (a view costs a tensor object: microseconds on a small call)
        return out
    if moved_shape is None:
        return out.view(x.shape)
    return out.view(moved_shape).movedim(-1, dim)


def softmax(
    input: torch.Tensor, dim: int = -1, *, masked_rows: str = "nan", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Masked-safe softmax along ``dim`` (bf16/fp16/fp32 in, same dtype out, fp32 math), differentiable.

    ``dtype``: cast the input to it first, as ``torch.softmax``. ``masked_rows="nan"`` (default): a slice
    that is all ``-inf`` gives NaN, like PyTorch; ``"zero"``: it gives zeros and a zero gradient (the
    usual wish for fully masked attention rows). An empty input gives torch's empty result.
    """
    return _softmax(input, dim, False, masked_rows, dtype)


def log_softmax(
    input: torch.Tensor, dim: int = -1, *, masked_rows: str = "nan", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Masked-safe log_softmax along ``dim``; ``masked_rows="zero"`` makes an all ``-inf`` slice give
    ``-inf`` (log of zero probabilities) with a zero gradient instead of NaN. ``dtype`` as :func:`softmax`."""
    return _softmax(input, dim, True, masked_rows, dtype)


def logsumexp(
    input: torch.Tensor, dim: int | tuple[int, ...] | list[int] = -1, keepdim: bool = False
) -> torch.Tensor:
    """Masked-safe ``log Σ exp(x)`` over ``dim`` (an int or a tuple of ints, as ``torch.logsumexp``) in fp32
    math, returned in x's dtype: ``-inf`` for an all ``-inf`` or empty slice, ``inf`` where the slice holds
    ``inf``; differentiable."""
    x = _check_softmax_input(input, None)
    if isinstance(dim, (tuple, list)):
        dims = sorted(_dim_index(d, x.dim()) for d in dim)
        require(len(set(dims)) == len(dims), lambda: f"dim must not name a dimension twice, got {dim}")
    else:
        dims = [_dim_index(dim, x.dim())]
    require(len(dims) >= 1, lambda: "dim must name at least one dimension")
    if x.numel() == 0:
        return torch.logsumexp(x, dims, keepdim)
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims) if dims != list(range(x.dim() - len(dims), x.dim())) else x
    out_shape = [x.shape[d] for d in kept]
    width = 1
    for d in dims:  # a loop, not a generator: Dynamo traces it
        width *= x.shape[d]
    rows = moved.reshape(-1, width)
    lse = library.logsumexp(rows).to(x.dtype).view(out_shape)
    if keepdim:
        for d in dims:
            lse = lse.unsqueeze(d)
    return lse


def _interleave(glu_interleave_size: int | None) -> int:
    require(
        glu_interleave_size in (None, 32),
        lambda: f"glu_interleave_size must be None or 32, got {glu_interleave_size!r}",
    )
    return glu_interleave_size or 0


def swiglu(
    c: torch.Tensor, probs: torch.Tensor | None = None, *, glu_interleave_size: int | None = None
) -> torch.Tensor:
    """``silu(gate) * linear * probs``: ``c`` (tokens, 2F) holds the gate half first (TE's order) or
    alternating 32-wide gate/linear blocks (``glu_interleave_size=32``); ``probs`` (tokens,) fp32 or bf16
    (MoE experts), or None for a dense MLP (``silu(gate) * linear``). fp32 math, one rounding to c's
    dtype. Differentiable in ``c`` and ``probs``; the probability gradient is computed in fp32 and never
    rounded to bf16 for fp32 ``probs``. Only the input ``c`` and ``probs`` (ones when None) are saved for
    the backward, not the output."""
    require_tensor(c, "c")
    if probs is None:
        probs = c.new_ones(c.shape[:1], dtype=torch.float32)
    require_tensor(probs, "probs")
    return library.swiglu_fwd(c, probs, _interleave(glu_interleave_size))


def rms_norm(
    input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, round_normalized: bool = True
) -> torch.Tensor:
    """RMSNorm over the last dim: ``weight * (x / sqrt(mean(x^2) + eps))`` with fp32 statistics, output
    in x's dtype (docs/rms_norm.md).

    ``input`` (..., H) float32 / bfloat16 / float16, ``weight`` (H,) of the same dtype or fp32 (used as
    is: Gemma's ``1 + weight`` formed in fp32, say), H <= 16384; the weight gradient in weight's dtype.
    ``round_normalized=True`` rounds the normalized fp32 row to x's dtype before the weight multiplies it
    (transformers' Llama, Qwen, Mistral: ``weight * hidden.to(input_dtype)``); False multiplies in fp32
    and rounds once (OLMo 2). Differentiable in both; the backward saves x, weight and the fp32 ``rstd``
    (rows,) only, and sums the weight gradient in fp32 in a fixed order (deterministic).
    """
    require_tensor(input, "input")
    require_tensor(weight, "weight")
    check_real(eps, "eps")
    require(eps >= 0, lambda: f"eps must be >= 0, got {eps}")
    check_bool(round_normalized, "round_normalized")
    require(input.dim() >= 1, lambda: "input must have at least one dimension, got a 0-d tensor")
    rows = input if input.dim() == 2 else input.reshape(-1, input.shape[-1])
    y, _ = library.rms_norm_fwd(rows, weight, float(eps), round_normalized)
    return y.view(input.shape)


def dglu(
    grad: torch.Tensor,
    c: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    *,
    glu_interleave_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused SwiGLU backward of grouped experts: ``(dc, dprobs, amax)`` from ``grad = dL/dh`` (tokens, F).

    ``dc`` (tokens, 2F) in c's dtype and layout; ``dprobs`` (tokens,) fp32; ``amax`` (experts,) fp32, the
    per-expert max of ``|dc|`` before rounding, so ``amax.to(c.dtype)`` equals ``max |dc|`` of the expert
    exactly (0 for an empty expert): the NVFP4 quantization of ``dc`` needs no amax pass of its own.
    ``split_sizes`` (experts,) is an integer tensor on c's device (rows sorted by expert); rows past
    their sum belong to no expert and get ``dc = 0`` and ``dprobs = 0``, whatever ``grad`` holds there."""
    check_split_sizes(split_sizes, device=c.device, of="c")
    return library.dglu(grad, c, probs, split_sizes, _interleave(glu_interleave_size))
