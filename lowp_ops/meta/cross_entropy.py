"""Argument checks and output allocation for the cross-entropy ops on ``(N, V)`` logits.

The forward's row statistics, which the backward takes, are one ``(2, N)`` fp32 tensor, rows in the
order of :data:`ROW_STATS`.
"""

from __future__ import annotations

import torch

from ..formats import HIGH_PRECISION_DTYPES
from .checks import require
from .mxfp8 import mxfp8_quantize_outputs

ROW_STATS = ("shift", "log_sum")
"""Rows of ``row_stats``: the masked-safe row maximum (the maximum; 0 when it is infinite) and
``log Σ exp(x - shift)`` (-inf for an all -inf row, NaN for a row holding +inf or NaN). The
log-sum-exp is their sum; kept apart, ``x - shift`` and ``log_sum`` keep their digits at any magnitude."""
SHIFT, LOG_SUM = range(len(ROW_STATS))
REDUCTIONS = ("none", "mean", "sum")
TARGET_DTYPES = (torch.int64, torch.int32)


def check_logits_target(logits: torch.Tensor, target: torch.Tensor) -> None:
    require(
        logits.dtype in HIGH_PRECISION_DTYPES,
        lambda: f"logits must be float32, bfloat16 or float16, got {logits.dtype}",
    )
    require(target.dtype in TARGET_DTYPES, lambda: f"target must be int64 or int32, got {target.dtype}")
    require(logits.dim() >= 1, lambda: "logits must have at least one dimension (the vocabulary)")
    require(
        target.shape == logits.shape[:-1],
        lambda: (
            f"target must have shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), "
            f"got {tuple(target.shape)}"
        ),
    )


def check_ignore_index(ignore_index: int, target: torch.Tensor) -> None:
    """An ``ignore_index`` that an int32 ``target`` can hold: one outside int32 would be compared after a
    wrap-around to another class's id (ignoring that class's rows), so it is refused."""
    if target.dtype == torch.int32:
        require(
            -(2**31) <= ignore_index < 2**31,
            lambda: f"ignore_index must fit the int32 target (no class id can equal it), got {ignore_index}",
        )


def check_label_smoothing(label_smoothing: float) -> None:
    require(
        0.0 <= label_smoothing <= 1.0, lambda: f"label_smoothing must be in [0, 1], got {label_smoothing}"
    )


def check_z_loss(z_loss: float) -> None:
    """The z-loss coefficient: a finite float >= 0 (0 = off)."""
    require(
        z_loss >= 0.0 and z_loss != float("inf"), lambda: f"z_loss must be a finite float >= 0, got {z_loss}"
    )


def check_softcap(softcap: float) -> None:
    """The ops' final-logit soft-cap: a finite float >= 0, where 0 means no cap (the public functions
    take None for that and require a cap > 0)."""
    require(
        softcap >= 0.0 and softcap != float("inf"),
        lambda: f"softcap must be a finite float > 0 (0.0 = no cap in the ops), got {softcap}",
    )


def check_loss_features(z_loss: float, softcap: float) -> None:
    """Both feature scalars of the cross-entropy ops (:func:`check_z_loss`, :func:`check_softcap`)."""
    check_z_loss(z_loss)
    check_softcap(softcap)


def public_z_loss(z_loss) -> float:
    """A public ``z_loss=`` argument as the ops' float: a real number >= 0, else a TypeError /
    ValueError naming ``z_loss``."""
    if not isinstance(z_loss, (int, float)) or isinstance(z_loss, bool):
        raise TypeError(f"z_loss must be a float, got {type(z_loss).__name__} {z_loss!r}")
    check_z_loss(float(z_loss))
    # The literal for the default: Dynamo would otherwise trace 0.0 as a symbolic float and restart.
    return 0.0 if z_loss == 0 else float(z_loss)


def public_label_smoothing(label_smoothing) -> float:
    """A public ``label_smoothing=`` argument as the ops' float: a real number in [0, 1], else a TypeError /
    ValueError naming it. The public default is the int 0: a float default becomes a symbolic float
    under ``torch.compile(dynamic=True)``, and passing it to an op's ``float`` makes Dynamo restart
    (the backend compiles the graph twice); 0 is specialized, so the default compiles once."""
    if not isinstance(label_smoothing, (int, float)) or isinstance(label_smoothing, bool):
        raise TypeError(
            f"label_smoothing must be a float, got {type(label_smoothing).__name__} {label_smoothing!r}"
        )
    check_label_smoothing(label_smoothing)
    return 0.0 if label_smoothing == 0 else float(label_smoothing)


def public_softcap(softcap) -> float:
    """A public ``softcap=`` argument (None or a float > 0) as the ops' float (0.0 = no cap)."""
    if softcap is None:
        return 0.0
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise TypeError(f"softcap must be None or a float, got {type(softcap).__name__} {softcap!r}")
    require(
        softcap > 0 and softcap != float("inf"),
        lambda: f"softcap must be None or a finite float > 0, got {softcap}",
    )
    return float(softcap)


def check_reduction(reduction: str) -> None:
    require(
        reduction in REDUCTIONS, lambda: f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}"
    )


def check_class_weight(
    weight: torch.Tensor | None,
    n_classes: int,
    logits: torch.Tensor,
    name: str = "weight",
    device_of: str = "the logits'",
) -> None:
    """Class weights (``F.cross_entropy``'s ``weight=``), the argument ``name``: None or a float32/bf16/fp16
    ``(n_classes,)`` tensor on ``logits``' device (computed with in fp32). Errors name the argument."""
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(weight).__name__}")
    require(
        weight.dtype in HIGH_PRECISION_DTYPES,
        lambda: f"{name} must be float32, bfloat16 or float16, got {weight.dtype}",
    )
    require(
        weight.dim() == 1 and weight.shape[0] == n_classes,
        lambda: f"{name} must have shape ({n_classes},) (one per class), got {tuple(weight.shape)}",
    )
    require(
        weight.device == logits.device,
        lambda: f"{name} must be on {device_of} device {logits.device}, got {weight.device}",
    )


def _check_rows(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> None:
    require(logits.dim() == 2, lambda: f"logits must be 2-D (N, V) here, got {logits.dim()}-D")
    check_logits_target(logits, target)
    check_ignore_index(ignore_index, target)


def cross_entropy_fwd_outputs(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss (N,) fp32, row_stats (2, N) fp32)``; ``weight``: optional class weights (V,)."""
    _check_rows(logits, target, ignore_index)
    check_label_smoothing(label_smoothing)
    check_loss_features(z_loss, softcap)
    check_class_weight(weight, logits.shape[1], logits)
    rows = logits.shape[0]
    return row_loss_and_stats_outputs(logits, rows)


def cross_entropy_reduced_outputs(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    mean: bool,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, grad_scale)`` 0-d fp32 as :func:`cross_entropy_reduce_outputs`, then ``row_stats`` (2, N) fp32
    as :func:`cross_entropy_fwd_outputs`."""
    loss_rows, stats = cross_entropy_fwd_outputs(
        logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    return (*cross_entropy_reduce_outputs(loss_rows, target, ignore_index, mean, weight), stats)


def cross_entropy_fwd_bwd_outputs(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowp::cross_entropy_fwd_bwd_``: ``(loss, row_stats (2, N) fp32)``, the loss 0-d fp32 (``mean``,
    ``sum``) or ``(N,)`` (``none``); :func:`cross_entropy_fwd_outputs`' checks. The logits receive the
    gradient in their own layout (any strides: a compiled graph may hand the op a padded matmul's
    strided view)."""
    loss_rows, stats = cross_entropy_fwd_outputs(
        logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    check_reduction(reduction)
    return (loss_rows if reduction == "none" else loss_rows.new_empty(())), stats


def cross_entropy_mxfp8_grad_outputs(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor | None,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """``lowp::cross_entropy_mxfp8_grad``: ``(loss, row_stats, row_data, row_scale, col_data, col_scale)``,
    the loss 0-d fp32 (``mean``, ``sum``) or ``(N,)`` (``none``), the row statistics as
    :func:`cross_entropy_fwd_outputs`', the MXFP8 payload of dlogits as ``mxfp8_quantize_outputs`` of the
    logits. ``grad_loss``: None (ones) or fp32-castable of the loss's shape, on the logits' device."""
    loss_rows, stats = cross_entropy_fwd_outputs(
        logits, target, label_smoothing, ignore_index, weight, z_loss, softcap
    )
    check_reduction(reduction)
    check_grad_loss(grad_loss, (loss_rows.shape[0],) if reduction == "none" else (), logits.device)
    payload = mxfp8_quantize_outputs(logits, fp8_dtype, rowwise, columnwise, scale_layout)
    return (loss_rows if reduction == "none" else loss_rows.new_empty(())), stats, *payload


def check_grad_loss(grad_loss: torch.Tensor | None, shape: tuple, device: torch.device) -> None:
    """``grad_loss``: None, or a tensor of the loss's ``shape`` on ``device``."""
    if grad_loss is None:
        return
    require(
        isinstance(grad_loss, torch.Tensor),
        lambda: f"grad_loss must be a Tensor or None, got {type(grad_loss).__name__}",
    )
    require(
        grad_loss.shape == shape,
        lambda: f"grad_loss must have the loss's shape {tuple(shape)}, got {tuple(grad_loss.shape)}",
    )
    require(
        grad_loss.device == device,
        lambda: f"grad_loss must be on the logits' device {device}, got {grad_loss.device}",
    )


def row_loss_and_stats_outputs(like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss (rows,) fp32, row_stats (2, rows) fp32)`` on ``like``'s device."""
    return like.new_empty((rows,), dtype=torch.float32), like.new_empty(
        (len(ROW_STATS), rows), dtype=torch.float32
    )


def check_row_stats(stats: torch.Tensor, rows: int) -> None:
    """``stats`` is a ``(2, rows)`` fp32 row-statistics tensor (any strides)."""
    require(
        stats.dtype == torch.float32 and stats.shape == (len(ROW_STATS), rows),
        lambda: (
            f"row_stats must be float32 of shape ({len(ROW_STATS)}, {rows}) (the forward's shift and "
            f"log_sum), got {stats.dtype} {tuple(stats.shape)}"
        ),
    )


def check_vocab_shard(n_cols: int, vocab_start: int, vocab_total: int) -> None:
    """The logits hold vocabulary ids ``[vocab_start, vocab_start + n_cols)`` of ``vocab_total``
    (0 = single rank: the logits' width)."""
    require(vocab_start >= 0, lambda: f"vocab_start must be >= 0, got {vocab_start}")
    require(
        vocab_total == 0 or vocab_start + n_cols <= vocab_total,
        lambda: (
            f"vocab_start + V ({vocab_start} + {n_cols}) must not exceed vocab_total ({vocab_total}) "
            "(0 = single rank)"
        ),
    )
    require(vocab_total != 0 or vocab_start == 0, lambda: "vocab_start must be 0 when vocab_total is 0")


def _check_bwd_inputs(
    logits, target, stats, grad_rows, ignore_index, vocab_start=0, vocab_total=0, weight=None, z_loss=0.0,
    softcap=0.0,
) -> None:  # fmt: skip
    _check_rows(logits, target, ignore_index)
    check_loss_features(z_loss, softcap)
    check_vocab_shard(logits.shape[1], vocab_start, vocab_total)
    check_class_weight(weight, vocab_total or logits.shape[1], logits)
    rows = logits.shape[0]
    check_row_stats(stats, rows)
    require(
        grad_rows.dtype == torch.float32 and grad_rows.shape == (rows,),
        lambda: (
            f"grad_rows must be float32 of shape ({rows},), got {grad_rows.dtype} {tuple(grad_rows.shape)}"
        ),
    )


def cross_entropy_bwd_output(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    vocab_start: int = 0,
    vocab_total: int = 0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dlogits: ``(N, V)`` contiguous, logits' dtype; ``weight``: optional class weights of the whole
    vocabulary (``vocab_total``,); ``out`` (launchers only), when given, is checked and returned instead
    of a new tensor. It may be ``logits`` itself when that is contiguous."""
    _check_bwd_inputs(
        logits, target, stats, grad_rows, ignore_index, vocab_start, vocab_total, weight, z_loss, softcap
    )
    if out is None:
        return logits.new_empty(logits.shape)
    require(
        out.shape == logits.shape and out.dtype == logits.dtype and out.is_contiguous(),
        lambda: f"out must be a contiguous {logits.dtype} tensor of shape {tuple(logits.shape)}",
    )
    require(
        out.data_ptr() != logits.data_ptr() or logits.is_contiguous(),
        lambda: "out may alias logits only when logits is contiguous",
    )
    return out


def cross_entropy_bwd_mxfp8_outputs(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    fp8_dtype: str,
    rowwise: bool,
    columnwise: bool,
    scale_layout: str,
    vocab_start: int = 0,
    vocab_total: int = 0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    zero_padding: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MXFP8 payload of dlogits, as :func:`lowp_ops.meta.mxfp8.mxfp8_quantize_outputs` of logits
    (``zero_padding`` as there)."""
    _check_bwd_inputs(
        logits, target, stats, grad_rows, ignore_index, vocab_start, vocab_total, weight, z_loss, softcap
    )
    return mxfp8_quantize_outputs(logits, fp8_dtype, rowwise, columnwise, scale_layout, zero_padding)


def cross_entropy_reduce_outputs(
    loss_rows: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    mean: bool,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, grad_scale)``: two 0-d float32 tensors; ``weight``: optional class weights (C,) (the mean
    divides by the weights of the non-ignored rows' targets)."""
    if weight is not None:
        require(weight.dim() == 1, lambda: f"weight must be 1-D (C,), got {tuple(weight.shape)}")
        check_class_weight(weight, weight.shape[0], loss_rows)
    require(
        loss_rows.dtype == torch.float32 and loss_rows.dim() == 1,
        lambda: f"loss_rows must be a 1-D float32 tensor, got {loss_rows.dtype} {tuple(loss_rows.shape)}",
    )
    require(target.dtype in TARGET_DTYPES, lambda: f"target must be int64 or int32, got {target.dtype}")
    require(
        target.shape == loss_rows.shape,
        lambda: f"target must have loss_rows' shape {tuple(loss_rows.shape)}, got {tuple(target.shape)}",
    )
    check_ignore_index(ignore_index, target)
    return loss_rows.new_empty(()), loss_rows.new_empty(())


def _check_grad_rows(grad_rows: torch.Tensor, rows: int) -> None:
    require(
        grad_rows.dtype == torch.float32 and grad_rows.shape == (rows,),
        lambda: (
            f"grad_rows must be float32 of shape ({rows},), got {grad_rows.dtype} {tuple(grad_rows.shape)}"
        ),
    )


def cross_entropy_scale_grad_output(dlogits: torch.Tensor, grad_rows: torch.Tensor) -> None:
    """Checks of ``lowp::cross_entropy_scale_grad_`` (in place, no output): ``dlogits`` (N, V), any
    strides, ``grad_rows`` (N,) float32 on its device (any stride)."""
    require(dlogits.dim() == 2, lambda: f"dlogits must be an (N, V) tensor, got {tuple(dlogits.shape)}")
    _check_grad_rows(grad_rows, dlogits.shape[0])
    require(
        grad_rows.device == dlogits.device,
        lambda: f"grad_rows must be on dlogits' device {dlogits.device}, got {grad_rows.device}",
    )
