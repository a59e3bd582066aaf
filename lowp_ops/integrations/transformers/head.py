"""The LM head and loss of a patched model: the head hands the hidden states through, the loss is
``linear_cross_entropy``, the model's logit step (soft-capping, logit scales) is switched off in the
class's forward and applied here (docs/transformers.md, "Logit steps")."""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ... import linear_cross_entropy
from ...meta.checks import require
from ...meta.linear_cross_entropy import CHUNK_MULTIPLE, default_chunk_size
from .binding import bound_function
from .layers import DTensor, _as_autocast_would


@dataclass(frozen=True)
class LogitTransform:
    """What a model's forward does to ``lm_head``'s output before its loss: ``kind`` ``"softcap"`` (``c *
    tanh(x / c)``), ``"divide"`` (``x / s``) or ``"multiply"`` (``x * s``), its value read from attribute
    ``name`` of ``owner``: ``"config"`` (the model's config), ``"text_config"`` (its language model's, in
    multimodal models) or ``"model"`` (the model itself); ``identity`` (a value that makes the step leave
    its input as it is) switches the step off."""

    kind: str
    name: str
    owner: str
    identity: float | None

    def holder(self, model: nn.Module):
        if self.owner == "model":
            return model
        return model.config.get_text_config() if self.owner == "text_config" else model.config

    def apply(self, logits: torch.Tensor, value: float | None) -> torch.Tensor:
        """The model's own step on ``logits``, operation for operation (so its bytes)."""
        if value is None:
            return logits
        if self.kind == "softcap":
            return torch.tanh(logits / value) * value
        return logits / value if self.kind == "divide" else logits * value


_SOFTCAP = LogitTransform("softcap", "final_logit_softcapping", "config", identity=None)


_LOGITS_SCALING = LogitTransform("divide", "logits_scaling", "config", identity=1.0)


_LOGIT_SCALE = LogitTransform("multiply", "logit_scale", "model", identity=1.0)


LOGIT_TRANSFORMS = {
    "gemma2": _SOFTCAP,
    "gemma3_text": _SOFTCAP,
    "gemma4_text": _SOFTCAP,
    "gemma4": LogitTransform("softcap", "final_logit_softcapping", "text_config", identity=None),
    "granite": _LOGITS_SCALING,
    "granitemoe": _LOGITS_SCALING,
    "granitemoeshared": _LOGITS_SCALING,
    "cohere": _LOGIT_SCALE,
    "cohere2": _LOGIT_SCALE,
    "cohere2_moe": _LOGIT_SCALE,
}
"""Causal LMs whose forward changes ``lm_head``'s output before ``loss_function``: Gemma 2 / 3 / 4's
final-logit soft-capping, Granite's and Cohere's logit scales. The patched forward runs the class's
forward with the step switched off (the head hands the hidden states through) and applies it itself: to
the loss as ``linear_cross_entropy``'s ``softcap`` or as a scale of the hidden states, to returned logits
as the model's own operations."""


LOSS_CHUNK_LOGITS = 2**26
"""Logits elements of one chunk of the loss, unless that is fewer than ``MIN_LOSS_CHUNK_TOKENS`` tokens
(the package docstring says why)."""
MIN_LOSS_CHUNK_TOKENS = 1024
"""Fewest tokens of a chunk, within ``linear_cross_entropy``'s own default chunk (2^28 logits,
``meta.linear_cross_entropy.default_chunk_size``): each chunk after the
first adds one read and write of the bf16 weight gradient (4 V H bytes, its ``addmm_``), and small chunks
make thin GEMMs. H200, 4096 tokens, fwd+bwd of the head and loss (``benchmarks/probe_loss_chunks.py``,
benchmarks/RESULTS.md): Gemma 3's (H 1152, V 262144) 17.3 ms in 256-token chunks, 13.5 ms in 1024,
12.6 ms unchunked; Gemma 2's (H 2304, V 256000) 32.3 / 24.5 / 23.3 ms."""


def _patched_forward_signature(cls: type) -> inspect.Signature:
    """The class forward's parameters and ``return_logits``, for the readers of
    ``inspect.signature(model.forward)``: transformers' Trainer passes a batch only the columns it
    names there (a bare ``**kwargs`` loses ``input_ids`` and ``labels``)."""
    signature = inspect.signature(cls.forward)
    parameters = list(signature.parameters.values())
    return_logits = inspect.Parameter("return_logits", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = len(parameters) - (bool(parameters) and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD)
    return signature.replace(parameters=[*parameters[:at], return_logits, *parameters[at:]])


def _hidden_passthrough(self: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """The patched ``lm_head``: the model's forward hands its output (the hidden states) to the loss."""
    return hidden_states


def _causal_lm_loss(
    self: nn.Module,
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_model_kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` through ``linear_cross_entropy``; ``logits`` holds the final
    hidden states (B, S, H) the patched head passed through. fp32 0-d loss."""
    hidden = logits
    weight = self.lm_head.weight
    require(
        not isinstance(weight, DTensor),
        lambda: "lm_head.weight is a DTensor here: do not shard lm_head as its own FSDP / TP module",
    )
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    options = self._lowp_ops_loss
    transform = LOGIT_TRANSFORMS.get(self.config.model_type)
    if transform is not None:
        hidden, options = _loss_with_logit_step(self, transform, hidden, options)
    hidden, weight = _as_autocast_would(hidden, weight)  # the model's lm_head is an autocast linear
    if options.get("chunk_size") is None:
        options = {**options, "chunk_size": loss_chunk_size(hidden, weight)}
    loss = linear_cross_entropy(
        hidden, weight, shift_labels, ignore_index=ignore_index, reduction=reduction, **options
    )
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _loss_with_logit_step(
    model: nn.Module, transform: LogitTransform, hidden: torch.Tensor, options: dict
) -> tuple[torch.Tensor, dict]:
    """The model's logit step in the loss: ``softcap`` for ``linear_cross_entropy``, or the scale on the
    hidden states (``(h * s) W^T = (h W^T) * s`` up to rounding; exact for powers of two)."""
    state = model._lowp_logit_step
    if state.running == 0:
        raise RuntimeError(
            f"the patched loss_function of a {model.config.model_type} model runs inside its patched "
            "forward only (there its logit step is switched off): call model(...), not the class's forward"
        )
    value = state.value
    if value is None:
        return hidden, options
    if transform.kind == "softcap":
        return hidden, {**options, "softcap": value}
    return (hidden / value if transform.kind == "divide" else hidden * value), options


def loss_chunk_size(hidden: torch.Tensor, weight: torch.Tensor) -> int | None:
    """Tokens per chunk of the loss: None (``linear_cross_entropy``'s automatic choice: the logits inside
    ``weight``'s gradient, unchunked, or one chunk below 2^25 logits) for at most H tokens; else the
    largest multiple of 256 whose logits hold at most ``LOSS_CHUNK_LOGITS`` elements, raised to
    ``MIN_LOSS_CHUNK_TOKENS`` within ``linear_cross_entropy``'s default chunk (at least 256)."""
    vocab, width = weight.shape
    if hidden.numel() // width <= width:
        return None
    by_memory = LOSS_CHUNK_LOGITS // vocab // CHUNK_MULTIPLE * CHUNK_MULTIPLE
    return max(by_memory, min(MIN_LOSS_CHUNK_TOKENS, default_chunk_size(vocab)))


def _forward_with_optional_logits(
    self: nn.Module,
    *args,
    logits_to_keep: int | torch.Tensor = 0,
    return_logits: bool | None = None,
    **kwargs,
):
    """The class's forward with the head's output (hidden states) turned back into logits when wanted
    (default: unless training with ``labels``; pass ``labels`` by keyword, as transformers' Trainer does,
    or the logits are computed too)."""
    if bound_function(self.lm_head.forward) is not _hidden_passthrough:
        raise RuntimeError(
            "model.lm_head was replaced after apply_lowp_ops (resize_token_embeddings replaces it, PEFT "
            "wraps it when it adapts lm_head): apply lowp_ops after resizing the embeddings; an adapted "
            "lm_head is not supported"
        )
    loss_function = getattr(self, "_loss_function", None)  # set on the instance by the patch
    if kwargs.get("labels") is not None and bound_function(loss_function) is not _causal_lm_loss:
        raise RuntimeError(
            "model.loss_function was replaced after apply_lowp_ops: the patched lm_head hands it the final "
            "hidden states, not logits; set a custom loss on an unpatched model"
        )
    if self.lm_head.weight.dtype == torch.float64:
        raise TypeError(
            "the model is float64 (converted after apply_lowp_ops): lowp_ops' kernels take float32, "
            "bfloat16 or float16; run float64 checks on an unpatched copy of the model"
        )
    return_dict = kwargs.pop("return_dict", None)
    if return_logits is None:
        return_logits = kwargs.get("labels") is None or not self.training
    kwargs.update(logits_to_keep=logits_to_keep, return_dict=True)
    transform = LOGIT_TRANSFORMS.get(self.config.model_type)
    if transform is None:
        output = type(self).forward(self, *args, **kwargs)
    else:
        value = _with_switch_lock(_switch_off, self, transform)
        try:
            output = type(self).forward(self, *args, **kwargs)
        finally:
            _with_switch_lock(_switch_back, self, transform)
    logits = F.linear(output.logits, self.lm_head.weight) if return_logits else None
    if logits is not None and transform is not None:
        logits = transform.apply(logits, value)
    values = {f.name: getattr(output, f.name) for f in fields(output)}
    output = type(output)(**{**values, "logits": logits})
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if return_dict:
        return output
    # The model's own tuple drops None fields; the logits keep their slot (None when not computed), so
    # out[1] is what it is without lowp_ops.
    return tuple(
        value for name, value in {**values, "logits": logits}.items() if name == "logits" or value is not None
    )


class _StepSwitch:
    """A patched model's logit step while its forwards run: how many run now (threads may share the
    model) and the step's value, read when the first of them switched the step off."""

    def __init__(self) -> None:
        self.running = 0
        self.value: float | None = None


_STEP_SWITCH_LOCK = threading.Lock()


# The patched forward bound to a model shows its class's parameters (binding.bind).
_forward_with_optional_logits.signature_of = _patched_forward_signature


def _with_switch_lock(function, model: nn.Module, transform: LogitTransform):
    """``function(model, transform)`` under the lock concurrent forwards share; traced, without it
    (Dynamo replays the attribute writes after the graph; a lock has no place in one)."""
    if torch.compiler.is_compiling():
        return function(model, transform)
    with _STEP_SWITCH_LOCK:
        return function(model, transform)


def _switch_off(model: nn.Module, transform: LogitTransform) -> float | None:
    """Switches the class forward's logit step off (the first of concurrent forwards does); its value."""
    state, holder = model._lowp_logit_step, transform.holder(model)
    if state.running == 0:
        state.value = getattr(holder, transform.name)
        setattr(holder, transform.name, transform.identity)
    state.running += 1
    return state.value


def _switch_back(model: nn.Module, transform: LogitTransform) -> None:
    """Restores the step's value when the last running forward ends."""
    state = model._lowp_logit_step
    state.running -= 1
    if state.running == 0:
        setattr(transform.holder(model), transform.name, state.value)
