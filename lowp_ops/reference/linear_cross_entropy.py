"""LM head + cross entropy, chunk by chunk over tokens (pure PyTorch: the semantics and the CPU ops).

Per chunk of rows ``c``:

- ``logits_c = dtype(hidden_c @ weight^T)`` (fp32 accumulation, one rounding to the inputs' dtype);
- the cross-entropy forward of :mod:`lowp_ops.reference.cross_entropy` (per-row loss and row statistics);
- ``dlogits_c`` by the cross-entropy backward for the given per-row gradient: in the inputs' dtype, or
  its MXFP8 payload (E4M3/E5M2, row- and column-wise copies, compact scales), byte for byte
  ``cross_entropy_bwd_mxfp8`` of the same logits;
- ``dhidden_c = dtype(op(dlogits_c) @ weight)``: the row-wise copy (blocks along V, the K dim) for MXFP8;
- ``dweight = dtype(dweight + op(dlogits_c)^T @ hidden_c)``: the column-wise copy (blocks along the
  chunk's tokens, the K dim) for MXFP8; fp32 inside a chunk, one rounding per chunk.

``other_operand="mxfp8"`` also quantizes the GEMMs' other operand with its blocks along K (E4M3, TE's
recipe): ``weight`` column-wise once, each ``hidden_c`` column-wise. The loss features ``z_loss`` and
``softcap`` (0.0 = off) and the class weights ``ce_weight`` (None = off; the whole vocabulary's ``(V,)``,
or ``(vocab_total,)`` for a shard) go to every chunk's cross entropy unchanged: each row's loss and
gradient are the class-weighted ones of :mod:`lowp_ops.reference.cross_entropy`; the mean's denominator
(the non-ignored rows' target weights) is in the per-row gradient the caller passes. The schedule
(:func:`forward_chunks`, :func:`gradient_chunks`) is shared with the CUDA implementation, which passes
its own :class:`Steps`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..meta.linear_cross_entropy import (
    check_scale_by_args,
    chunk_bounds,
    fp8_dtype_of,
    linear_cross_entropy_bwd_outputs,
    linear_cross_entropy_fwd_bwd_outputs,
    linear_cross_entropy_fwd_outputs,
)
from . import cross_entropy as ce_ref
from . import mxfp8 as mxfp8_ref
from .mxfp8_gemm import dequantized_operands

OTHER_FP8_DTYPE = "e4m3"
"""Weights and activations quantize to E4M3 (TE's MXFP8 recipe); dY may be E4M3 or E5M2."""


@dataclass(frozen=True)
class Steps:
    """The per-chunk building blocks of one implementation (signatures as the ``lowp::`` ops)."""

    logits: Callable  # (hidden_c, weight) -> logits_c in the inputs' dtype
    ce_fwd: Callable  # lowp::cross_entropy_fwd
    ce_bwd: Callable  # lowp::cross_entropy_bwd; may write dlogits over its (chunk's own) logits
    ce_bwd_mxfp8: Callable  # lowp::cross_entropy_bwd_mxfp8
    # (logits_c, target_c, grad_rows_c, label_smoothing, ignore_index, ce_weight, z_loss, softcap)
    # -> (loss_c, stats_c, dlogits_c): ce_fwd then ce_bwd, bytes included; may write dlogits over logits_c
    ce_fwd_bwd: Callable
    matmul_into: Callable  # (out, a, b, accumulate): out = dtype(a @ b [+ out])
    mxfp8_gemm_into: Callable  # (out, *lowp::mxfp8_gemm args without out_dtype, accumulate, scratch=)
    quantize_columnwise: Callable  # (x, fp8_dtype) -> (col_data uint8, col_scale)


def _logits(hidden_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden_c.float() @ weight.float().t()).to(hidden_c.dtype)


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    product = a.float() @ b.float()
    out.copy_(product + out.float() if accumulate else product)


def _mxfp8_gemm_into(
    out, a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, accumulate, scratch=None
) -> None:
    """``out = op(A) @ B [+ out]`` in fp32 from the dequantized operands; ``scratch`` is unused here."""
    a, b32 = dequantized_operands(a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype)
    product = a @ b32
    out.copy_(product + out.float() if accumulate else product)


def _quantize_columnwise(x: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, col_data, col_scale = mxfp8_ref.mxfp8_quantize(x, fp8_dtype, False, True, "compact")
    return col_data, col_scale


def _ce_fwd_bwd(logits_c, target_c, grad_rows_c, label_smoothing, ignore_index, ce_weight, z_loss, softcap):
    features = (ce_weight, z_loss, softcap)
    loss_c, stats_c = ce_ref.cross_entropy_fwd(logits_c, target_c, label_smoothing, ignore_index, *features)
    dlogits_c = ce_ref.cross_entropy_bwd(
        logits_c, target_c, stats_c, grad_rows_c, label_smoothing, ignore_index, 0, 0, *features
    )
    return loss_c, stats_c, dlogits_c


REFERENCE_STEPS = Steps(
    logits=_logits,
    ce_fwd=ce_ref.cross_entropy_fwd,
    ce_bwd=ce_ref.cross_entropy_bwd,
    ce_bwd_mxfp8=ce_ref.cross_entropy_bwd_mxfp8,
    ce_fwd_bwd=_ce_fwd_bwd,
    matmul_into=_matmul_into,
    mxfp8_gemm_into=_mxfp8_gemm_into,
    quantize_columnwise=_quantize_columnwise,
)


@dataclass
class GradientWriter:
    """Writes one chunk's ``dlogits`` into ``dhidden`` rows and accumulates it into ``dweight``."""

    weight: torch.Tensor
    dhidden: torch.Tensor
    dweight: torch.Tensor
    label_smoothing: float
    ignore_index: int
    grad_format: str
    other_operand: str
    steps: Steps
    z_loss: float = 0.0
    softcap: float = 0.0
    ce_weight: torch.Tensor | None = None  # class weights (V,), or (vocab_total,) for a shard
    vocab: tuple[int, int] = (0, 0)  # (vocab_start, vocab_total) of a vocabulary shard; (0, 0): all
    dweight_written: bool = False
    weight_mxfp8: tuple[torch.Tensor, torch.Tensor] | None = None
    on_dlogits: Callable | None = None  # test hook: called with each chunk's dlogits (tensor or payload)

    @property
    def loss_features(self) -> tuple:
        """``(ce_weight, z_loss, softcap)``: the cross entropy's trailing arguments."""
        return self.ce_weight, self.z_loss, self.softcap

    @property
    def compute_dhidden(self) -> bool:
        return self.dhidden.dim() == 2

    @property
    def compute_dweight(self) -> bool:
        return self.dweight.dim() == 2

    def write(self, start: int, end: int, hidden_c, logits_c, target_c, stats_c, grad_rows_c) -> None:
        args = (logits_c, target_c, stats_c, grad_rows_c, self.label_smoothing, self.ignore_index)
        features = (*self.vocab, self.ce_weight, self.z_loss, self.softcap)
        if self.grad_format == "none":
            self.write_dlogits(start, end, hidden_c, self.steps.ce_bwd(*args, *features))
        else:
            fp8_dtype = fp8_dtype_of(self.grad_format)
            payload = self.steps.ce_bwd_mxfp8(
                *args, fp8_dtype, self.compute_dhidden, self.compute_dweight, "compact", *features
            )
            if self.on_dlogits is not None:
                self.on_dlogits(start, end, payload)
            # The logits are dead once the payload exists: the GEMMs may dequantize into their buffer.
            self._mxfp8_gemms(start, end, hidden_c, fp8_dtype, *payload, scratch=logits_c)

    def write_dlogits(self, start: int, end: int, hidden_c, dlogits) -> None:
        """The bf16 (input-dtype) GEMMs of one chunk's ``dlogits`` made elsewhere."""
        if self.on_dlogits is not None:
            self.on_dlogits(start, end, dlogits)
        self._bf16_gemms(start, end, hidden_c, dlogits)

    def _bf16_gemms(self, start, end, hidden_c, dlogits) -> None:
        if self.compute_dhidden:
            self.steps.matmul_into(self.dhidden[start:end], dlogits, self.weight, False)
        if self.compute_dweight:
            self.steps.matmul_into(self.dweight, dlogits.t(), hidden_c, self.dweight_written)
            self.dweight_written = True

    def _other(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The GEMM's other operand (K, N) as given, or its column-wise MXFP8 copy."""
        if self.other_operand == "bf16":
            return x, None
        return self.steps.quantize_columnwise(x, OTHER_FP8_DTYPE)

    def _mxfp8_gemms(
        self, start, end, hidden_c, fp8_dtype, row_data, row_scale, col_data, col_scale, scratch=None
    ) -> None:
        if self.compute_dhidden:
            if self.weight_mxfp8 is None:
                self.weight_mxfp8 = self._other(self.weight)
            w, w_scale = self.weight_mxfp8
            self.steps.mxfp8_gemm_into(
                self.dhidden[start:end],
                row_data,
                row_scale,
                "rowwise",
                fp8_dtype,
                w,
                w_scale,
                OTHER_FP8_DTYPE,
                False,
                scratch=scratch,
            )
        if self.compute_dweight:
            x, x_scale = self._other(hidden_c)
            self.steps.mxfp8_gemm_into(
                self.dweight,
                col_data,
                col_scale,
                "columnwise",
                fp8_dtype,
                x,
                x_scale,
                OTHER_FP8_DTYPE,
                self.dweight_written,
                scratch=scratch,
            )
            self.dweight_written = True

    def finish(self) -> None:
        if self.compute_dweight and not self.dweight_written:
            self.dweight.zero_()  # no tokens: dweight is an empty sum


def forward_chunks(
    hidden,
    weight,
    target,
    label_smoothing,
    ignore_index,
    grad_format,
    other_operand,
    chunk_size,
    z_loss=0.0,
    softcap=0.0,
    ce_weight=None,
    *,
    steps,
):
    """``lowp::linear_cross_entropy_fwd`` with the given steps: ``(loss (N,), row_stats (2, N))`` fp32."""
    loss, stats = linear_cross_entropy_fwd_outputs(
        hidden, weight, target, label_smoothing, ignore_index, grad_format, other_operand, chunk_size,
        z_loss, softcap, ce_weight,
    )  # fmt: skip
    for start, end in chunk_bounds(hidden.shape[0], weight.shape[0], chunk_size):
        logits_c = steps.logits(hidden[start:end], weight)
        loss_c, stats_c = steps.ce_fwd(
            logits_c, target[start:end], label_smoothing, ignore_index, ce_weight, z_loss, softcap
        )
        loss[start:end] = loss_c
        stats[:, start:end] = stats_c
        del logits_c
    return loss, stats


def gradient_chunks(
    hidden, weight, target, stats, per_row, writer: GradientWriter, chunk_size, loss_rows=None, stats_out=None
) -> None:
    """The gradient of ``Σ per_row[r] · loss[r]`` into ``writer``. With ``stats`` None (fused forward),
    the forward runs on the same logits chunk, fills ``loss_rows`` and ``stats_out`` and supplies the
    row statistics."""
    for start, end in chunk_bounds(hidden.shape[0], weight.shape[0], chunk_size):
        hidden_c, target_c = hidden[start:end], target[start:end]
        logits_c = writer.steps.logits(hidden_c, weight)
        loss_args = (writer.label_smoothing, writer.ignore_index, *writer.loss_features)
        if stats is not None:
            writer.write(start, end, hidden_c, logits_c, target_c, stats[:, start:end], per_row[start:end])
        elif writer.grad_format == "none" and writer.vocab == (0, 0):
            # The loss and the input-dtype gradient in one step (one read of the logits where it fits).
            step = writer.steps.ce_fwd_bwd
            loss_c, stats_c, dlogits_c = step(logits_c, target_c, per_row[start:end], *loss_args)
            loss_rows[start:end], stats_out[:, start:end] = loss_c, stats_c
            writer.write_dlogits(start, end, hidden_c, dlogits_c)
            del dlogits_c  # on CUDA the logits chunk itself: freed with it below
        else:
            loss_c, stats_c = writer.steps.ce_fwd(logits_c, target_c, *loss_args)
            loss_rows[start:end], stats_out[:, start:end] = loss_c, stats_c
            writer.write(start, end, hidden_c, logits_c, target_c, stats_c, per_row[start:end])
        del logits_c  # before the next chunk's logits exist: one chunk at a time
    writer.finish()


def backward_chunks(
    hidden,
    weight,
    target,
    stats,
    grad_rows,
    label_smoothing,
    ignore_index,
    grad_format,
    other_operand,
    chunk_size,
    compute_dhidden,
    compute_dweight,
    z_loss=0.0,
    softcap=0.0,
    ce_weight=None,
    *,
    steps: Steps,
    on_dlogits=None,
    vocab: tuple[int, int] = (0, 0),
):
    """``lowp::linear_cross_entropy_bwd`` with the given steps: logits recomputed per chunk; ``vocab``:
    ``(vocab_start, vocab_total)`` when ``weight`` holds one vocabulary shard."""
    dhidden, dweight = linear_cross_entropy_bwd_outputs(
        hidden,
        weight,
        target,
        stats,
        grad_rows,
        label_smoothing,
        ignore_index,
        grad_format,
        other_operand,
        chunk_size,
        compute_dhidden,
        compute_dweight,
        z_loss,
        softcap,
        ce_weight,
        vocab[1],
    )
    writer = GradientWriter(
        weight,
        dhidden,
        dweight,
        label_smoothing,
        ignore_index,
        grad_format,
        other_operand,
        steps,
        z_loss,
        softcap,
        ce_weight,
        vocab,
        on_dlogits=on_dlogits,
    )
    gradient_chunks(hidden, weight, target, stats, grad_rows, writer, chunk_size)
    return dhidden, dweight


def fwd_bwd_chunks(
    hidden,
    weight,
    target,
    row_weight,
    label_smoothing,
    ignore_index,
    grad_format,
    other_operand,
    chunk_size,
    compute_dhidden,
    compute_dweight,
    z_loss=0.0,
    softcap=0.0,
    ce_weight=None,
    *,
    steps: Steps,
    on_dlogits=None,
):
    """``lowp::linear_cross_entropy_fwd_bwd`` with the given steps: ``loss = Σ row_weight · loss_rows``,
    its gradients and the row statistics, from one logits chunk each (three GEMMs per chunk, none
    recomputed). With class weights ``row_weight`` is ``1 / Σ w_y`` for the mean (the caller's)."""
    loss, dhidden, dweight, stats = linear_cross_entropy_fwd_bwd_outputs(
        hidden,
        weight,
        target,
        row_weight,
        label_smoothing,
        ignore_index,
        grad_format,
        other_operand,
        chunk_size,
        compute_dhidden,
        compute_dweight,
        z_loss,
        softcap,
        ce_weight,
    )
    writer = GradientWriter(
        weight,
        dhidden,
        dweight,
        label_smoothing,
        ignore_index,
        grad_format,
        other_operand,
        steps,
        z_loss,
        softcap,
        ce_weight,
        on_dlogits=on_dlogits,
    )
    loss_rows = row_weight.new_empty(row_weight.shape)
    gradient_chunks(hidden, weight, target, None, row_weight, writer, chunk_size, loss_rows, stats)
    loss.copy_((loss_rows * row_weight).sum())
    return loss, dhidden, dweight, stats


def linear_cross_entropy_fwd(*args):
    """Reference of ``lowp::linear_cross_entropy_fwd``."""
    return forward_chunks(*args, steps=REFERENCE_STEPS)


def linear_cross_entropy_bwd(*args):
    """Reference of ``lowp::linear_cross_entropy_bwd``."""
    return backward_chunks(*args, steps=REFERENCE_STEPS)


def linear_cross_entropy_fwd_bwd(*args):
    """Reference of ``lowp::linear_cross_entropy_fwd_bwd``."""
    return fwd_bwd_chunks(*args, steps=REFERENCE_STEPS)


def scale_by_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """Reference of ``lowp::scale_by_``: ``x = dtype(x * scale)`` in place, in fp32 with one rounding (the
    upstream gradient of a fused loss applied to the gradients computed in its forward). ``scale == 1``
    leaves ``x`` as it is, which is also what the product gives."""
    check_scale_by_args(x, scale)
    x.copy_(x.float() * scale.float())
