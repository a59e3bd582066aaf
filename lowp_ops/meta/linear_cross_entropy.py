"""Argument checks, chunking rule and output allocation for the LM-head + cross-entropy ops.

Shapes: ``hidden (N, H)``, ``weight (V, H)`` of one dtype (bf16/fp16/fp32), ``target (N,)`` int64/int32.
Tokens are processed ``chunk_size`` rows at a time, so only one chunk's logits exist at once.

Peak extra memory (beyond inputs and the ``dhidden (N, H)`` / ``dweight (V, H)`` gradients), with
``C = chunk_size`` and ``b`` the inputs' element size:

- forward without gradients: ``C·V·b`` (one logits chunk) + 12 N bytes (loss, row statistics);
- gradient, ``grad_format=None``: ``C·V·b`` on CUDA (the gradient is written over its logits chunk),
  ``2·C·V·b`` in the CPU reference;
- gradient, MXFP8: ``C·V·(b + 2 + 1/16)`` (logits chunk, row- and column-wise FP8 copies, E8M0 scales),
  on sm90, where each copy is dequantized to bf16 for cuBLAS (one at a time), into the dead logits
  chunk when the inputs are bf16, else into ``2·C·V`` bytes more;
  ``other_operand="mxfp8"`` adds the quantized weight ``1.03·V·H`` and one ``1.03·C·H`` hidden chunk.

The reduced losses (mean, sum) compute the gradients in the forward and scale them in place in the
backward, so ``dhidden`` and ``dweight`` exist once. With the automatic chunk, a bf16 gradient that
``weight`` needs, ``N <= H`` tokens and at least ``IN_GRADIENT_MIN_LOGITS`` logits, the CUDA (and
interpreted) op keeps the whole ``V x N`` logits inside ``dweight``'s storage instead
(``lowp_ops.kernels.linear_cross_entropy.fwd_bwd_in_gradient_buffer``): peak extra ``min(V, 3072)·N·b``
bytes plus at most 2 MiB of row statistics (3 MiB with label smoothing). Fewer logits take one chunk
(peak extra ``N·V·b``, at most 64 MiB of bf16).

The default chunk keeps a logits chunk near 512 MiB of bf16: at V = 129280 that is 2048 tokens, half
the size of ``dweight`` at H = 4096.
"""

from __future__ import annotations

import torch

from ..formats import HIGH_PRECISION_DTYPES
from .checks import require
from .cross_entropy import (
    TARGET_DTYPES,
    check_class_weight,
    check_ignore_index,
    check_label_smoothing,
    check_loss_features,
    check_row_stats,
    row_loss_and_stats_outputs,
)
from .mxfp8_gemm import check_other_operand

GRAD_FORMATS = ("none", "mxfp8_e4m3", "mxfp8_e5m2")
"""Op-level names of the logits-gradient format; the public ``grad_format=None`` is ``"none"``."""

LOGITS_CHUNK_ELEMENTS = 2**28
CHUNK_MULTIPLE = 256
# Below this many logits (64 MiB of bf16) the in-gradient schedule's eight GEMMs and column kernels cost
# more than one chunk, host and GPU alike (H200: 1250 / 298 us against 1050 / 226 us fwd+bwd at
# N 512, H 1024, V 32000; benchmarks/RESULTS.md, "The LM head's schedule at small token counts").
IN_GRADIENT_MIN_LOGITS = 2**25


def default_chunk_size(vocab: int) -> int:
    """The largest multiple of 256 tokens whose logits hold at most 2^28 elements (at least 256)."""
    return max(CHUNK_MULTIPLE, LOGITS_CHUNK_ELEMENTS // max(vocab, 1) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


def chunk_bounds(n_rows: int, vocab: int, chunk_size: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, end)`` of the chunks; ``chunk_size == 0`` picks :func:`default_chunk_size`."""
    size = chunk_size or default_chunk_size(vocab)
    return [(start, min(start + size, n_rows)) for start in range(0, n_rows, size)]


def fp8_dtype_of(grad_format: str) -> str:
    """``"mxfp8_e4m3"`` -> ``"e4m3"``."""
    return grad_format.removeprefix("mxfp8_")


def check_grad_format(grad_format: str) -> None:
    require(
        grad_format in GRAD_FORMATS,
        lambda: f"grad_format must be one of {list(GRAD_FORMATS)}, got {grad_format!r}",
    )


def check_chunk_size(chunk_size: int) -> None:
    require(
        isinstance(chunk_size, int) and chunk_size >= 0,
        lambda: f"chunk_size must be a positive int (0 or None: automatic), got {chunk_size!r}",
    )


def check_hidden_weight_target(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    """Shapes, dtypes and devices of ``hidden (..., H)``, ``weight (V, H)``, ``target (...)``."""
    require(
        hidden.dtype in HIGH_PRECISION_DTYPES,
        lambda: f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}",
    )
    require(
        weight.dtype == hidden.dtype,
        lambda: f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}",
    )
    require(hidden.dim() >= 1, lambda: "hidden must have at least one dimension (the hidden size)")
    require(weight.dim() == 2, lambda: f"weight must be 2-D (V, H), got {weight.dim()}-D")
    require(
        weight.shape[1] == hidden.shape[-1],
        lambda: (
            f"weight must have shape (V, {hidden.shape[-1]}) to match hidden's last dim, "
            f"got {tuple(weight.shape)}"
        ),
    )
    require(weight.shape[0] >= 1, lambda: "weight must have at least one row (the vocabulary)")
    require(target.dtype in TARGET_DTYPES, lambda: f"target must be int64 or int32, got {target.dtype}")
    require(
        weight.device == hidden.device,
        lambda: f"weight must be on hidden's device {hidden.device}, got {weight.device}",
    )
    require(
        target.device == hidden.device,
        lambda: f"target must be on hidden's device {hidden.device}, got {target.device}",
    )
    require(
        target.shape == hidden.shape[:-1],
        lambda: (
            f"target must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), "
            f"got {tuple(target.shape)}"
        ),
    )


def _check_rows(hidden, weight, target, label_smoothing, ignore_index, chunk_size) -> None:
    require(hidden.dim() == 2, lambda: f"hidden must be 2-D (N, H) here, got {hidden.dim()}-D")
    check_hidden_weight_target(hidden, weight, target)
    check_ignore_index(ignore_index, target)
    check_label_smoothing(label_smoothing)
    check_chunk_size(chunk_size)


def _check_grad_args(hidden, grad_format, other_operand, name: str, per_row: torch.Tensor) -> None:
    check_grad_format(grad_format)
    check_other_operand(other_operand)
    rows = hidden.shape[0]
    require(
        per_row.dtype == torch.float32 and per_row.shape == (rows,),
        lambda: f"{name} must be float32 of shape ({rows},), got {per_row.dtype} {tuple(per_row.shape)}",
    )


def _grad_outputs(hidden, weight, compute_dhidden: bool, compute_dweight: bool):
    """``(dhidden (N, H), dweight (V, H))`` in the inputs' dtype; one not computed is an empty ``(0,)``."""
    dhidden = hidden.new_empty(hidden.shape if compute_dhidden else (0,))
    dweight = weight.new_empty(weight.shape if compute_dweight else (0,))
    return dhidden, dweight


def linear_cross_entropy_fwd_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    grad_format: str,
    other_operand: str,
    chunk_size: int,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    ce_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss (N,) fp32, row_stats (2, N) fp32)`` (:mod:`lowp_ops.meta.cross_entropy`); ``grad_format``
    and ``other_operand`` are for the backward; ``z_loss``, ``softcap`` the loss features (0.0 = off);
    ``ce_weight`` the optional class weights ``(V,)``."""
    _check_rows(hidden, weight, target, label_smoothing, ignore_index, chunk_size)
    check_loss_features(z_loss, softcap)
    check_class_weight(ce_weight, weight.shape[0], hidden)
    check_grad_format(grad_format)
    check_other_operand(other_operand)
    return row_loss_and_stats_outputs(hidden, hidden.shape[0])


def linear_cross_entropy_bwd_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    grad_format: str,
    other_operand: str,
    chunk_size: int,
    compute_dhidden: bool,
    compute_dweight: bool,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    ce_weight: torch.Tensor | None = None,
    vocab_total: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden, dweight)`` as :func:`_grad_outputs`; ``ce_weight``: optional class weights of the whole
    vocabulary (``vocab_total`` classes for a shard's backward, 0: ``V``)."""
    _check_rows(hidden, weight, target, label_smoothing, ignore_index, chunk_size)
    check_loss_features(z_loss, softcap)
    check_class_weight(ce_weight, vocab_total or weight.shape[0], hidden)
    _check_grad_args(hidden, grad_format, other_operand, "grad_rows", grad_rows)
    check_row_stats(stats, hidden.shape[0])
    return _grad_outputs(hidden, weight, compute_dhidden, compute_dweight)


def linear_cross_entropy_fwd_bwd_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    row_weight: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    grad_format: str,
    other_operand: str,
    chunk_size: int,
    compute_dhidden: bool,
    compute_dweight: bool,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    ce_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss () fp32, dhidden, dweight, row_stats (2, N) fp32)``: the row statistics as the forward's
    (for the lse and the z-loss of logging); ``ce_weight`` the optional class weights ``(V,)``."""
    _check_rows(hidden, weight, target, label_smoothing, ignore_index, chunk_size)
    check_loss_features(z_loss, softcap)
    check_class_weight(ce_weight, weight.shape[0], hidden)
    _check_grad_args(hidden, grad_format, other_operand, "row_weight", row_weight)
    loss, stats = row_loss_and_stats_outputs(hidden, hidden.shape[0])
    return (loss.new_empty(()), *_grad_outputs(hidden, weight, compute_dhidden, compute_dweight), stats)


def check_ce_weight(ce_weight, n_classes: int, like: torch.Tensor) -> None:
    """Public check of ``linear_cross_entropy``'s class weights: :func:`check_class_weight` for the
    argument ``ce_weight`` (``n_classes``: the whole vocabulary with a process group), and no gradient."""
    check_class_weight(ce_weight, n_classes, like, "ce_weight", "hidden's")
    require(
        ce_weight is None or not ce_weight.requires_grad,
        lambda: "ce_weight must not require grad: linear_cross_entropy gives class weights no gradient",
    )


def check_scale_by_args(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``lowp::scale_by_`` (in place): ``x`` float32/bf16/fp16, ``scale`` a 0-d float tensor."""
    require(
        scale.dim() == 0 and scale.is_floating_point(),
        lambda: f"scale must be a 0-d float tensor, got {scale.dtype} of shape {tuple(scale.shape)}",
    )
    require(
        x.dtype in HIGH_PRECISION_DTYPES, lambda: f"x must be float32, bfloat16 or float16, got {x.dtype}"
    )
