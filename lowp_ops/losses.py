"""Loss modules: ``CrossEntropyLoss`` (as ``torch.nn.CrossEntropyLoss``) and ``LinearCrossEntropyLoss``
(the LM head and its loss in one node, as Liger's ``LigerFusedLinearCrossEntropyLoss``).

Both hold their options and call the functions :func:`lowp_ops.cross_entropy` and
:func:`lowp_ops.linear_cross_entropy`; keyword options they do not name themselves (``chunk_size``,
``classes_last``, later loss features) pass through unchanged, so the functions' checks and errors apply.
"""

from __future__ import annotations

import torch

from .functional import cross_entropy
from .linear_cross_entropy import linear_cross_entropy
from .meta.checks import check_bool, check_int, require
from .meta.cross_entropy import check_reduction, public_label_smoothing, public_softcap, public_z_loss

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss"]


def _check_options(ignore_index: int, reduction: str, label_smoothing: float) -> None:
    check_int(ignore_index, "ignore_index")
    check_reduction(reduction)
    public_label_smoothing(label_smoothing)


def _check_class_weight(weight: torch.Tensor | None, name: str) -> None:
    """Class weights ``name``: None, or a 1-D floating tensor."""
    require(
        weight is None
        or (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.is_floating_point()),
        lambda: f"{name} must be a 1-D floating tensor of class weights, got {weight!r:.80}",
    )


def _features(z_loss, lse_square_scale, softcap, return_z_loss) -> dict:
    """The loss-feature options, checked now: ``z_loss`` (or Liger's name ``lse_square_scale``, not both),
    ``softcap`` (None or > 0), ``return_z_loss``; only those that are not the defaults."""
    if lse_square_scale is not None:
        require(z_loss == 0, lambda: "pass z_loss or lse_square_scale (Liger's name for it), not both")
        z_loss = lse_square_scale
    z_loss, cap = public_z_loss(z_loss), public_softcap(softcap)
    check_bool(return_z_loss, "return_z_loss")
    features = {"z_loss": z_loss} if z_loss else {}
    features.update({"softcap": softcap} if cap else {})
    features.update({"return_z_loss": True} if return_z_loss else {})
    return features


class _LossModule(torch.nn.Module):
    """What both loss modules hold: the checked options of their function, the class weights as a buffer
    named ``weight_name``, and the keyword arguments of the call."""

    def __init__(
        self,
        weight_name: str,
        weight,
        ignore_index,
        reduction,
        label_smoothing,
        process_group,
        features,
        options,
    ):
        super().__init__()
        for legacy in ("size_average", "reduce"):
            if legacy in options:  # cross_entropy takes them, as F.cross_entropy does; the modules do not
                raise TypeError(f"{legacy} (deprecated in torch) is not taken: pass reduction=")
        _check_options(ignore_index, reduction, label_smoothing)
        _check_class_weight(weight, weight_name)
        self.weight_name = weight_name
        self.register_buffer(weight_name, weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.process_group = process_group
        self.options = {**_features(*features), **options}

    def call_options(self) -> dict:
        """Keyword arguments of the function call (class weights only when set)."""
        weight = getattr(self, self.weight_name)
        return {
            "ignore_index": self.ignore_index,
            "reduction": self.reduction,
            "label_smoothing": self.label_smoothing,
            "process_group": self.process_group,
            **({} if weight is None else {self.weight_name: weight}),
            **self.options,
        }

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, process_group={self.process_group is not None}"
            + "".join(f", {name}={value!r}" for name, value in self.options.items())
        )


class CrossEntropyLoss(_LossModule):
    """``torch.nn.CrossEntropyLoss`` on :func:`lowp_ops.cross_entropy` (masked-safe, fp32 loss, gradient
    in the logits' dtype; vocabulary-parallel with ``process_group``).

    Args:
        weight: (C,) class weights (a buffer, moved with the module), or None.
        ignore_index, reduction, label_smoothing: as ``torch.nn.CrossEntropyLoss`` (keyword arguments:
            torch's deprecated ``size_average`` / ``reduce`` are not taken).
        process_group: vocabulary-parallel loss: each rank passes its vocabulary shard of the logits.
        z_loss (alias ``lse_square_scale``, Liger's name), softcap, return_z_loss: the loss features of
            :func:`lowp_ops.cross_entropy` (z-loss coefficient, final-logit soft-cap, also return the
            z-loss apart: ``forward`` then returns ``(loss, z_loss)``).
        options: passed to :func:`lowp_ops.cross_entropy` as given (e.g. ``classes_last=True`` for
            ``(..., V)`` logits with ``(...)`` targets, the LLM layout; ``overwrite_logits=True`` to write
            the gradient over the logits, as Liger's loss does; later loss features the same way).

    ``forward(input, target)``: the layouts of :func:`lowp_ops.cross_entropy` (``(N, C)`` with ``(N,)`` as
    torch), class-index targets. Returns the fp32 loss (0-d, or the target's shape for ``"none"``).
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0,
        process_group=None,
        z_loss: float = 0,
        lse_square_scale: float | None = None,
        softcap: float | None = None,
        return_z_loss: bool = False,
        **options,
    ):
        features = (z_loss, lse_square_scale, softcap, return_z_loss)
        super().__init__(
            "weight", weight, ignore_index, reduction, label_smoothing, process_group, features, options
        )

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(input, target, **self.call_options())


class LinearCrossEntropyLoss(_LossModule):
    """The LM head and its cross entropy without the (tokens, vocab) logits in memory:
    :func:`lowp_ops.linear_cross_entropy`, with the constructor options of Liger's
    ``LigerFusedLinearCrossEntropyLoss`` and ``torch.nn.CrossEntropyLoss``.

    Args:
        ce_weight: (V,) class weights (Liger's name; a buffer), or None.
        ignore_index, reduction, label_smoothing: as ``torch.nn.CrossEntropyLoss``.
        z_loss (alias ``lse_square_scale``), softcap, return_z_loss: the loss features of
            :func:`lowp_ops.linear_cross_entropy`.
        grad_format: None (logits gradient in the inputs' dtype), ``"mxfp8_e4m3"`` or ``"mxfp8_e5m2"``
            (written directly as MXFP8 and fed to the dgrad / wgrad GEMMs).
        process_group: vocabulary-parallel LM head: each rank passes the weight rows of its shard.
        options: passed to :func:`lowp_ops.linear_cross_entropy` as given (``chunk_size``,
            ``other_operand``, ``reduce_hidden_grad``; later loss features the same way).

    ``forward(lin_weight, _input, target, bias=None)`` takes Liger's argument order: the head's weight
    (V, H) FIRST, then the hidden states (..., H) and the targets (...); a bias is not supported
    (NotImplementedError). Returns the fp32 loss (0-d, or the target's shape for ``"none"``).
    """

    def __init__(
        self,
        ce_weight: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0,
        grad_format: str | None = None,
        process_group=None,
        z_loss: float = 0,
        lse_square_scale: float | None = None,
        softcap: float | None = None,
        return_z_loss: bool = False,
        **options,
    ):
        features = (z_loss, lse_square_scale, softcap, return_z_loss)
        super().__init__(
            "ce_weight", ce_weight, ignore_index, reduction, label_smoothing, process_group, features, options
        )
        self.grad_format = grad_format

    def forward(
        self,
        lin_weight: torch.Tensor,
        _input: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if bias is not None:
            raise NotImplementedError("LinearCrossEntropyLoss: an LM head bias is not supported")
        return linear_cross_entropy(
            _input, lin_weight, target, grad_format=self.grad_format, **self.call_options()
        )

    def extra_repr(self) -> str:
        return f"grad_format={self.grad_format!r}, " + super().extra_repr()
