"""lowp_ops inside Hugging Face transformers (5.x) causal language models: :func:`apply_lowp_ops`.

One call patches a model INSTANCE (its class and every other instance stay as they are); the
parameters stay the model's own (no copies), so optimizers, ``state_dict`` and checkpoints keep working.

- **LM head + loss.** ``model.lm_head`` hands the final hidden states through unchanged and
  ``model.loss_function`` computes ``lowp_ops.linear_cross_entropy(hidden, lm_head.weight, labels)``:
  the (tokens, vocab) logits are never materialized. The label shift (or the ``shift_labels`` the
  caller gives), ``ignore_index`` (-100) and ``num_items_in_batch`` (loss summed, then divided by it, for
  gradient accumulation) are those of transformers' ``ForCausalLMLoss``. ``model(...)`` returns logits
  (one ``F.linear`` of those hidden states) when no ``labels`` are given, in eval mode, or with
  ``return_logits=True``; when training with labels, ``logits`` is None (``return_logits=True`` costs
  one more (tokens, vocab) GEMM and its memory; with ``return_dict=False`` the None keeps the logits'
  place in the tuple, so the fields after it stay where the model's own tuple has them). ``lm_head``
  called on its own returns its input, not logits. A label outside ``[0, vocab)`` other than
  ``ignore_index`` gives a NaN loss (no host sync to raise, as ``lowp_ops.cross_entropy``) where
  transformers' loss raises an IndexError. Unless ``chunk_size`` is given, more tokens than the
  hidden size are chunked so that a chunk's logits hold at most ``LOSS_CHUNK_LOGITS`` elements (128 MiB
  in bf16): ``linear_cross_entropy``'s own default (2^28) accumulates the weight gradient in fewer
  passes, but its chunk adds to the whole model's peak memory (a ~1.5 B Llama at 4096 tokens: 13.10 GiB
  with it, 12.86 GiB with this; benchmarks/RESULTS.md).
- **Logit steps** (``LOGIT_TRANSFORMS``: Gemma 2 / 3 / 4's final-logit soft-capping, Granite's
  ``logits_scaling``, Cohere's ``logit_scale``). The class's forward would apply its step to the hidden
  states the head hands through, so the patched forward runs it with the step switched off (the config's
  or model's attribute set to a value that leaves its input as it is, and set back when the last running
  forward of the model returns, also traced by ``torch.compile``), and applies the step itself: in the
  loss as ``linear_cross_entropy(softcap=c)`` (fp32 ``c * tanh(z * (1/c))``; the model rounds each step
  to its dtype) or as a scale of the hidden states (``(h * s) W^T``: the model's ``(h W^T) * s`` up to the
  rounding of ``h * s``, none for powers of two), to returned logits as the model's own operations (the
  same bytes).
- **MoE experts** (``experts="bf16" | "mxfp8" | "nvfp4"``): every fused experts module of transformers
  5.x (3-D ``gate_up_proj`` (E, 2F, H), gate rows first, and ``down_proj`` (E, H, F), SiLU, no biases:
  Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...) runs through :func:`lowp_ops.grouped_swiglu_mlp`
  with the model's own router and top-k: the (token, choice) rows are sorted by expert on the device,
  split sizes never leave it (no host sync, one graph under ``torch.compile``). For ``mxfp8`` / ``nvfp4``
  each expert's rows are padded with zero rows to a multiple of 32 / 16, so no quantization block
  straddles two experts. GPT-OSS's experts are not this SwiGLU (biases, interleaved gate/up columns,
  a clamped gate, ``(up + 1) * gate * sigmoid(alpha * gate)``): they raise ``NotImplementedError``.
- **RMSNorm** (``rms_norm="eager"``, the default, or ``True``): every RMSNorm module whose forward is one
  that ``lowp_ops.rms_norm`` computes (``RMS_NORM_FORWARDS``, read from the module class's source: the
  layers' norms, the final norm, Qwen3's per-head q/k norms) runs through :func:`lowp_ops.rms_norm`, whose
  backward keeps only the input and the fp32 ``1/rms`` per row (transformers' own keeps the fp32 copy of the
  input and the normalized rows too). The rounding of the module's formula is kept (``round_normalized``:
  Llama's ``weight * hidden.to(dtype)``, OLMo 2's and GPT-OSS's ``(weight * hidden).to(dtype)``; Gemma's,
  Qwen 3.5's and Qwen3-Next's ``1 + weight`` is formed in fp32 and passed as the op's fp32 weight); an input
  whose dtype is not that of a weight multiplying it as is (e.g. fp32 activations, bf16 weights), rows wider
  than 16384 and DTensor operands run the module's own forward. With ``"eager"``, so does a norm that
  ``torch.compile`` traces: Inductor fuses it into the code around it, where a lowp call costs a custom-op
  dispatch and Python launches per norm (H200, batch 1 x 4096 tokens, compiled decoder layers: Qwen3-MoE
  41.7 k -> 55.1 k tokens/s, Llama 53.6 k -> 55.4 k, the Llama's peak memory +0.03 GiB; README, transformers
  models).
- **Dense SwiGLU MLPs** (``mlp=True``, the default): every MLP whose forward is ``down(silu(gate(x)) *
  up(x))`` and nothing else (``SWIGLU_FORWARDS``: ``gate_proj`` / ``up_proj`` / ``down_proj``, or a fused
  ``gate_up_proj`` as Phi-3's and GLM-4's; a dropout after it, say, leaves it alone; the MoE models' dense
  layers and shared experts included) computes ``silu(gate) * up`` with :func:`lowp_ops.swiglu`: one kernel,
  one rounding, and only ``[gate | up]`` saved for the backward; the activation itself, which ``down_proj``
  would keep, is recomputed there (transformers' own saves gate, silu(gate), up and their product: 4 x
  (tokens, intermediate) against lowp's 2).
- **Attention softmax** (``softmax=True``): only for models whose attention implementation is
  ``"eager"`` and whose eager attention function is Llama's plain one (``PLAIN_EAGER_ATTENTION``, read
  from the model's source; not Gemma's soft-capping or GPT-OSS's sinks): the probabilities go through
  :func:`lowp_ops.softmax` (an attention function registered as ``"lowp_eager"`` and selected on this
  model). Other implementations (sdpa, flash) are left alone.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import threading
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "lowp_ops.integrations.transformers needs transformers>=5,<6: pip install 'lowp_ops[transformers]'"
    ) from error

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = ()

from .. import grouped_swiglu_mlp, library, linear_cross_entropy
from .. import rms_norm as lowp_rms_norm
from .. import softmax as lowp_softmax
from .. import swiglu as lowp_swiglu
from ..meta.checks import check_bool, require
from ..meta.rms_norm import MAX_HIDDEN

__all__ = ["apply_lowp_ops"]

EXPERT_RECIPES = ("bf16", "mxfp8", "nvfp4")
GRAD_FORMATS = (None, "mxfp8_e4m3", "mxfp8_e5m2")
ROW_ALIGNMENT = {"bf16": 1, "mxfp8": 32, "nvfp4": 16}
"""Rows per expert are padded to these multiples: MXFP8 column-wise blocks are 32 tokens long, NVFP4's
RHT and column-wise blocks 16 (lowp_ops.composite.grouped_linear)."""


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

LM_HEAD_MODEL_TYPES = frozenset(
    {
        "apertus",
        "cohere",
        "cohere2",
        "cohere2_moe",
        "deepseek_v2",
        "deepseek_v3",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone4",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gemma4",
        "gemma4_text",
        "glm4",
        "glm4_moe",
        "glm4v",
        "gpt_oss",
        "granite",
        "granitemoe",
        "granitemoeshared",
        "hunyuan_v1_dense",
        "idefics3",
        "internvl",
        "llama",
        "llama4_text",
        "llava",
        "llava_next",
        "ministral",
        "ministral3",
        "mistral",
        "mistral3",
        "mixtral",
        "olmo2",
        "olmo3",
        "olmoe",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_vl",
        "qwen3_vl_moe",
        "smollm3",
        "smolvlm",
        "starcoder2",
    }
)
"""Causal LMs whose forward hands ``lm_head``'s output straight to ``loss_function``, or through one of
``LOGIT_TRANSFORMS``; each one is a test in tests/test_integrations_transformers.py."""


@dataclass(frozen=True)
class NormForm:
    """How a recognized RMSNorm forward maps onto ``lowp_ops.rms_norm``: its ``round_normalized``,
    whether the weight enters as fp32 ``1 + weight`` (``unit_offset``), and the attribute holding eps."""

    round_normalized: bool
    unit_offset: bool
    eps: str


_LLAMA_NORM_STATEMENTS = (
    "input_dtype = hidden_states.dtype",
    "hidden_states = hidden_states.to(torch.float32)",
    "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
    "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
)
_UNIT_OFFSET_STATEMENTS = (
    "output = self._norm(x.float())",
    "output = output * (1.0 + self.weight.float())",
    "return output.type_as(x)",
)
_LLAMA4_STATEMENTS = ("output = self._norm(x.float()).type_as(x)", "return output * self.weight")
_GEMMA4_STATEMENTS = (
    "normed_output = self._norm(hidden_states.float())",
    "if self.with_scale:\n    normed_output = normed_output * self.weight.float()",
    "return normed_output.type_as(hidden_states)",
)


def _gemma4_norm_statements(eps: str) -> tuple[str, str]:
    return (
        f"mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.{eps}",
        "return hidden_states * torch.pow(mean_squared, -0.5)",
    )


def _norm_statements(eps: str) -> tuple[str]:
    return (f"return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.{eps})",)


RMS_NORM_FORWARDS = {
    ((*_LLAMA_NORM_STATEMENTS, "return self.weight * hidden_states.to(input_dtype)"), None): NormForm(
        True, False, "variance_epsilon"
    ),
    ((*_LLAMA_NORM_STATEMENTS, "return (self.weight * hidden_states).to(input_dtype)"), None): NormForm(
        False, False, "variance_epsilon"
    ),
    (_UNIT_OFFSET_STATEMENTS, _norm_statements("eps")): NormForm(False, True, "eps"),
    (_LLAMA4_STATEMENTS, _norm_statements("variance_epsilon")): NormForm(True, False, "variance_epsilon"),
    (_LLAMA4_STATEMENTS, _norm_statements("eps")): NormForm(True, False, "eps"),
    (_GEMMA4_STATEMENTS, _gemma4_norm_statements("variance_epsilon")): NormForm(
        False, False, "variance_epsilon"
    ),
    (_GEMMA4_STATEMENTS, _gemma4_norm_statements("eps")): NormForm(False, False, "eps"),
}
"""The RMSNorm forwards ``lowp_ops.rms_norm`` computes, keyed by the statements of the class's ``forward``
and ``_norm`` (None without one) as ``ast.unparse`` writes them: Llama's and Llama 4's round the rows to
the input's dtype before the weight (``round_normalized``); OLMo 2's (and GPT-OSS's) multiply in fp32 and
round once, as Gemma 4's (the weight's only in modules that have one; ``torch.pow(.., -0.5)`` against the
op's correctly rounded ``1 / sqrt``: a last-bit difference at most); Gemma 1-3's, Qwen 3.5's and
Qwen3-Next's multiply by ``1 + weight`` formed in fp32, rounded once. A norm with another forward is left
alone: the module's code, not its name, decides."""


def norm_form(cls: type) -> NormForm | None:
    """The :class:`NormForm` of an RMSNorm class's forward, or None when it is not one we compute."""
    norm = getattr(cls, "_norm", None)
    key = (forward_statements(cls), _forward_statements(norm) if callable(norm) else None)
    return RMS_NORM_FORWARDS.get(key)


_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
SWIGLU_FORWARDS = {
    ("down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))", "return down_proj"): (
        "act_fn",
        _GATE_UP_DOWN,
    ),
    (
        "down_proj = self.activation_fn(self.gate_proj(x)) * self.up_proj(x)",
        "return self.down_proj(down_proj)",
    ): ("activation_fn", _GATE_UP_DOWN),
    (
        "up_states = self.gate_up_proj(hidden_states)",
        "gate, up_states = up_states.chunk(2, dim=-1)",
        "up_states = up_states * self.activation_fn(gate)",
        "return self.down_proj(up_states)",
    ): ("activation_fn", ("gate_up_proj", "down_proj")),
}
"""The dense MLP forwards patched with ``lowp_ops.swiglu``, each with the attribute of its activation
(patched when it is SiLU) and its linears: ``gate_proj`` / ``up_proj`` / ``down_proj`` (Llama's form and
Llama 4's), or one ``gate_up_proj`` (gate half first; Phi-3, GLM-4). One with any other step (a dropout,
say) is left alone."""

PLAIN_EAGER_ATTENTION = (
    "key_states = repeat_kv(key, module.num_key_value_groups)",
    "value_states = repeat_kv(value, module.num_key_value_groups)",
    "attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling",
    "if attention_mask is not None:\n    attn_weights = attn_weights + attention_mask",
    "attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)",
    "attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)",
    "attn_output = torch.matmul(attn_weights, value_states)",
    "attn_output = attn_output.transpose(1, 2).contiguous()",
    "return (attn_output, attn_weights)",
)
"""The statements of Llama's ``eager_attention_forward``, plain ``softmax(q k^T * scaling + mask) v`` (no
sinks, no soft-cap), which :func:`lowp_eager_attention` computes: ``softmax=True`` takes a model whose
modeling module's ``eager_attention_forward`` has them."""

LOSS_CHUNK_LOGITS = 2**26
"""Most logits elements of one chunk of the loss (see the module docstring)."""

ATTENTION_NAME = "lowp_eager"
_OWN_LOSS_ARGUMENTS = ("hidden", "weight", "target", "grad_format", "reduction", "ignore_index")


def apply_lowp_ops(
    model: nn.Module,
    *,
    grad_format: str | None = None,
    experts: str | None = None,
    softmax: bool = False,
    rms_norm: bool | str = "eager",
    mlp: bool = True,
    **loss_options,
) -> nn.Module:
    """Patch a transformers causal LM instance to train on lowp_ops; returns ``model`` itself.

    Args:
        model: a ``*ForCausalLM`` of transformers 5.x with ``model.config.model_type`` in
            ``LM_HEAD_MODEL_TYPES`` and a bias-free ``nn.Linear`` ``lm_head``.
        grad_format: the logits gradient of the LM head: None (the weights' dtype), ``"mxfp8_e4m3"`` or
            ``"mxfp8_e5m2"`` (see :func:`lowp_ops.linear_cross_entropy`).
        experts: None leaves MoE experts alone; ``"bf16"``, ``"mxfp8"`` or ``"nvfp4"`` runs every fused
            experts module through :func:`lowp_ops.grouped_swiglu_mlp` with that recipe (the expert
            weights must be bf16 with hidden and intermediate sizes multiples of 8).
        softmax: with eager attention, the attention probabilities go through :func:`lowp_ops.softmax`.
        rms_norm: ``"eager"``: every RMSNorm module runs through :func:`lowp_ops.rms_norm` when called
            eagerly and runs its own forward where ``torch.compile`` traces it (Inductor fuses that into
            the code around it, faster than a custom op per norm); True: through ``lowp_ops.rms_norm``
            compiled too; False: the modules are left alone.
        mlp: every dense SwiGLU MLP computes its activation with :func:`lowp_ops.swiglu`.
        loss_options: passed through to :func:`lowp_ops.linear_cross_entropy` (e.g. ``chunk_size``,
            ``other_operand``, ``label_smoothing``; later loss features the same way).

    The patched ``model(...)`` also takes ``return_logits`` (default: logits unless training with
    labels). Every check runs before anything is changed: a refused model is left untouched.
    Apply it after resizing embeddings and before wrapping ``lm_head`` alone in FSDP (the loss reads
    ``lm_head.weight`` after the head's own call returns). A PEFT model (``get_base_model()``) or a
    ``torch.compile``'d one (``_orig_mod``) has its transformers model patched and is returned as given.
    """
    wrapper, model = model, _transformers_model(model)
    _check_causal_lm(model)
    _check_loss_options(grad_format, loss_options)
    _check_softcap_option(model, loss_options)
    require(
        experts is None or experts in EXPERT_RECIPES,
        lambda: f"experts must be None or one of {EXPERT_RECIPES}, got {experts!r}",
    )
    check_bool(softmax, "softmax")
    check_bool(mlp, "mlp")
    if not (isinstance(rms_norm, bool) or rms_norm == "eager"):
        raise ValueError(f"rms_norm must be True, False or 'eager', got {rms_norm!r}")
    expert_modules = _supported_experts(model) if experts is not None else []
    use_lowp_attention = softmax and _eager_attention_allowed(model)
    norm_modules = _rms_norm_modules(model) if rms_norm else []
    mlp_modules = _dense_swiglu_modules(model) if mlp else []
    patched = [model, model.lm_head, *norm_modules, *mlp_modules, *expert_modules]
    _check_forwards_are_the_classes(model, patched)

    _patch_head_and_loss(model, {"grad_format": grad_format, **loss_options})
    if rms_norm:
        for module in norm_modules:
            module._lowp_norm_form = norm_form(type(module))
            module._lowp_eager_only = rms_norm == "eager"
            module.forward = _bound(_rms_norm_forward, module)
    for module in mlp_modules:
        module.forward = _bound(_dense_swiglu_forward, module)
    for module in expert_modules:
        module._lowp_recipe = experts
        module.forward = _bound(_grouped_experts_forward, module)
    if use_lowp_attention:
        _select_lowp_attention(model)
    return wrapper


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT's and ``torch.compile``'s wrappers (both forward their
    attributes to it, so patching the wrapper would leave the inner forward's loss unpatched)."""
    while True:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif callable(getattr(type(model), "get_base_model", None)):
            model = model.get_base_model()
        else:
            return model


def _bound(function, module: nn.Module) -> functools.partial:
    """``function`` bound to ``module`` as an instance attribute: a ``functools.partial``, which pickles
    by reference to the module-level function (``torch.save`` of a whole patched model loads back; a
    bound method pickles as ``getattr(module, name)``, which the module does not have), and which
    ``copy.deepcopy`` binds to the copy."""
    return functools.partial(function, module)


def _patch_head_and_loss(model: nn.Module, loss_options: dict) -> None:
    """Instance attributes only (:func:`_bound`), so the class and other instances stay as they are."""
    model._lowp_ops_loss = loss_options
    if model.config.model_type in LOGIT_TRANSFORMS:
        model._lowp_logit_step = _StepSwitch()
    model.lm_head.forward = _bound(_hidden_passthrough, model.lm_head)
    model.loss_function = _bound(_causal_lm_loss, model)
    model.forward = _bound(_forward_with_optional_logits, model)
    model.forward.__signature__ = _patched_forward_signature(type(model))


def _patched_forward_signature(cls: type) -> inspect.Signature:
    """The class forward's parameters (less ``self``) and ``return_logits``, for the readers of
    ``inspect.signature(model.forward)``: transformers' Trainer passes a batch only the columns it
    names there (a bare ``**kwargs`` loses ``input_ids`` and ``labels``)."""
    signature = inspect.signature(cls.forward)
    parameters = list(signature.parameters.values())[1:]
    return_logits = inspect.Parameter("return_logits", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = len(parameters) - (bool(parameters) and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD)
    return signature.replace(parameters=[*parameters[:at], return_logits, *parameters[at:]])


def _select_lowp_attention(model: nn.Module) -> None:
    """Registers ``"lowp_eager"`` (attention function and eager's additive mask) and selects it."""
    AttentionInterface.register(ATTENTION_NAME, lowp_eager_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation(ATTENTION_NAME)


# ------------------------------------------------------------------------------------------- checks


def _check_causal_lm(model: nn.Module) -> None:
    require(
        transformers.__version__.split(".")[0] == "5",
        lambda: f"apply_lowp_ops supports transformers 5.x, found {transformers.__version__}",
    )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in LM_HEAD_MODEL_TYPES:
        raise NotImplementedError(
            f"apply_lowp_ops: model_type {model_type!r} is not one of the checked causal LMs "
            f"{sorted(LM_HEAD_MODEL_TYPES)} (each family is checked against its unpatched model: its "
            "logits between lm_head and the loss, its norms, MLPs and experts)"
        )
    head = model._modules.get("lm_head")
    require(
        isinstance(head, nn.Linear),
        lambda: (
            f"model.lm_head must be an nn.Linear child of the model, got {type(head).__name__} "
            f"({type(model).__name__}; patch the transformers model before wrapping it, e.g. in DDP)"
        ),
    )
    if head.bias is not None:
        raise NotImplementedError("apply_lowp_ops: an lm_head with a bias is not supported")


def _check_loss_options(grad_format: str | None, loss_options: dict) -> None:
    require(
        grad_format in GRAD_FORMATS, lambda: f"grad_format must be one of {GRAD_FORMATS}, got {grad_format!r}"
    )
    accepted = set(inspect.signature(linear_cross_entropy).parameters) - set(_OWN_LOSS_ARGUMENTS)
    unknown = sorted(set(loss_options) - accepted)
    if unknown:
        raise TypeError(
            f"apply_lowp_ops got unexpected loss options {unknown}; "
            f"linear_cross_entropy takes {sorted(accepted)}"
        )
    if loss_options.get("process_group") is not None:
        raise NotImplementedError(
            "apply_lowp_ops: process_group (a vocabulary-parallel lm_head) is not wired into "
            "transformers models"
        )


def _check_forwards_are_the_classes(model: nn.Module, modules: list[nn.Module]) -> None:
    """Refuses modules whose ``forward`` another library replaced on the instance (accelerate's device
    hooks after ``device_map`` dispatch, another patcher): lowp's forward would drop that wrapper."""
    ours = (
        _forward_with_optional_logits,
        _hidden_passthrough,
        _rms_norm_forward,
        _dense_swiglu_forward,
        _grouped_experts_forward,
    )
    names = {id(module): name for name, module in model.named_modules()}
    for module in modules:
        forward = vars(module).get("forward")
        if forward is not None and getattr(forward, "func", None) not in ours:
            name = names.get(id(module)) or type(module).__name__
            raise ValueError(
                f"apply_lowp_ops: {name}.forward was replaced on the instance ({forward!r}), which lowp_ops' "
                "patch would drop: apply lowp_ops first (before accelerate's device_map dispatch or other "
                "patchers)"
            )


def _check_softcap_option(model: nn.Module, loss_options: dict) -> None:
    transform = LOGIT_TRANSFORMS.get(model.config.model_type)
    if transform is None or transform.kind != "softcap" or loss_options.get("softcap") is None:
        return
    value = getattr(transform.holder(model), transform.name)
    if value is not None:
        raise ValueError(
            f"apply_lowp_ops got softcap={loss_options['softcap']!r}, but the model soft-caps its logits "
            f"itself ({transform.owner}.{transform.name}={value!r}), which the loss applies"
        )


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    """The fused experts modules of transformers 5.x (3-D ``gate_up_proj`` and ``down_proj``)."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
        and module.gate_up_proj.dim() == 3
    ]


def _unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` is not the SwiGLU expert layout of grouped_swiglu_mlp (None when it is)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    experts, two_ffn, hidden = gate_up.shape
    checks = [
        (getattr(module, "has_bias", False), "biases"),
        (getattr(module, "is_transposed", False), "transposed weights (E, in, out)"),
        (not getattr(module, "is_concatenated", True), "interleaved gate/up columns"),
        (not getattr(module, "has_gate", True), "no gate"),
        (getattr(module, "has_post_expert_norm", False), "a norm after each expert"),
        (_has_own_gate(module), "its own gate function"),
        (not isinstance(getattr(module, "act_fn", None), _silu_classes()), "an activation other than SiLU"),
        (getattr(module, "_is_expert_parallel", False), "expert parallelism"),
        (tuple(down.shape) != (experts, hidden, two_ffn // 2), f"down_proj {tuple(down.shape)}"),
        (
            {gate_up.dtype, down.dtype} - {torch.bfloat16, torch.float32},
            f"{gate_up.dtype} weights, not bf16 (or fp32 under bf16 autocast)",
        ),
        (hidden % 8 != 0 or two_ffn % 16 != 0, "hidden or intermediate size not a multiple of 8"),
    ]
    reasons = [reason for failed, reason in checks if failed]
    return ", ".join(reasons) if reasons else None


def _has_own_gate(module: nn.Module) -> bool:
    """True when the experts class replaces transformers' default ``silu(gate) * up`` (``_apply_gate``)."""
    gate = getattr(type(module), "_apply_gate", None)
    return gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate"


def _silu_classes() -> tuple[type, ...]:
    from transformers import activations

    return tuple(cls for cls in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if cls is not None)


def _supported_experts(model: nn.Module) -> list[nn.Module]:
    modules = _experts_modules(model)
    if not modules:
        raise ValueError(f"experts= was given but {type(model).__name__} has no fused MoE experts module")
    for module in modules:
        reason = _unsupported_reason(module)
        if reason is not None:
            raise NotImplementedError(
                f"apply_lowp_ops(experts=...): {type(module).__name__} is not the SwiGLU expert layout of "
                f"lowp_ops.grouped_swiglu_mlp: {reason}"
            )
    return modules


def _eager_attention_allowed(model: nn.Module) -> bool:
    implementation = model.config._attn_implementation
    if implementation not in ("eager", ATTENTION_NAME):
        warnings.warn(
            f"apply_lowp_ops(softmax=True): attention implementation {implementation!r} is not 'eager'; "
            "the attention is left alone",
            stacklevel=3,
        )
        return False
    if model.config.get_text_config() is not model.config:
        raise NotImplementedError(
            f"apply_lowp_ops(softmax=True): {model.config.model_type!r} is a multimodal model, whose "
            "towers' attentions are not all the language model's: only text models take softmax=True"
        )
    own = getattr(sys.modules.get(type(model).__module__), "eager_attention_forward", None)
    if own is None or _forward_statements(own) != PLAIN_EAGER_ATTENTION:
        raise NotImplementedError(
            f"apply_lowp_ops(softmax=True): the eager attention of {model.config.model_type!r} is not "
            "Llama's plain softmax attention (PLAIN_EAGER_ATTENTION)"
        )
    return True


# ------------------------------------------------------------------------------- LM head and loss


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
    largest multiple of 256 whose logits hold at most ``LOSS_CHUNK_LOGITS`` elements (at least 256)."""
    vocab, width = weight.shape
    if hidden.numel() // width <= width:
        return None
    return max(256, LOSS_CHUNK_LOGITS // vocab // 256 * 256)


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
    if getattr(self.lm_head.forward, "func", None) is not _hidden_passthrough:
        raise RuntimeError(
            "model.lm_head was replaced after apply_lowp_ops (resize_token_embeddings replaces it): apply "
            "lowp_ops to the model after resizing its embeddings"
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


# ------------------------------------------------------------------------------ RMSNorm, dense MLPs


def forward_statements(cls: type) -> tuple[str, ...] | None:
    """The statements of ``cls.forward`` as ``ast.unparse`` writes them (no docstring, comments or
    layout), or None where its source cannot be read."""
    return _forward_statements(cls.forward)


@functools.cache
def _forward_statements(forward) -> tuple[str, ...] | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):  # no source, a builtin, a lambda's line
        return None
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return tuple(ast.unparse(statement) for statement in body)


def _rms_norm_modules(model: nn.Module) -> list[nn.Module]:
    """The RMSNorm modules whose forward is one of ``RMS_NORM_FORWARDS``, with a 1-D ``weight`` and a
    float epsilon."""
    modules = []
    for module in model.modules():
        form = norm_form(type(module))
        weight = getattr(module, "weight", None)
        if (
            form is not None
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 1
            and isinstance(getattr(module, form.eps, None), float)
        ):
            modules.append(module)
    return modules


def _rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The patched RMSNorm: :func:`lowp_ops.rms_norm` with the module's :class:`NormForm`, or the module's
    own forward for an input whose dtype differs from a weight that multiplies it as is (transformers
    then promotes; the op returns x's dtype), for rows wider than the kernels take (``MAX_HIDDEN``), for
    DTensor operands (tensor / sequence parallelism: the ops take plain tensors) and, with
    ``rms_norm="eager"``, under ``torch.compile``."""
    form = self._lowp_norm_form
    if (
        (self._lowp_eager_only and torch.compiler.is_compiling())
        or (hidden_states.dtype != self.weight.dtype and not form.unit_offset)
        or hidden_states.shape[-1] > MAX_HIDDEN
        or isinstance(self.weight, DTensor)
        or isinstance(hidden_states, DTensor)
    ):
        return type(self).forward(self, hidden_states)
    weight = 1.0 + self.weight.float() if form.unit_offset else self.weight
    return lowp_rms_norm(
        hidden_states, weight, getattr(self, form.eps), round_normalized=form.round_normalized
    )


def _dense_swiglu_modules(model: nn.Module) -> list[nn.Module]:
    """MLPs of ``down(silu(gate(x)) * up(x))``: a forward of ``SWIGLU_FORWARDS`` with its ``nn.Linear``
    projections and a SiLU activation."""
    silu = _silu_classes()
    modules = []
    for module in model.modules():
        form = SWIGLU_FORWARDS.get(forward_statements(type(module)))
        if form is None:
            continue
        activation, linears = form
        if isinstance(getattr(module, activation, None), silu) and all(
            isinstance(getattr(module, name, None), nn.Linear) for name in linears
        ):
            modules.append(module)
    return modules


def _dense_swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` with the activation from :func:`lowp_ops.swiglu` on ``[gate | up]``; a
    plain bias-free ``nn.Linear`` down projection (no hooks) recomputes the activation in the backward.
    DTensor inputs (tensor parallelism) run the module's own forward."""
    if isinstance(x, DTensor):
        return type(self).forward(self, x)
    if hasattr(self, "gate_up_proj"):
        c = self.gate_up_proj(x)
    else:
        c = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
    if isinstance(c, DTensor):  # column-parallel gate / up projections
        return type(self).forward(self, x)
    rows = c.reshape(-1, c.shape[-1])
    down = self.down_proj
    if _plain_linear(down) and down.bias is None and not isinstance(down.weight, DTensor):
        y = SwiGLUThenLinear.apply(*_as_autocast_would(rows, down.weight))
    else:
        y = down(lowp_swiglu(rows))
    return y.view(*c.shape[:-1], y.shape[-1])


def _as_autocast_would(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands of a linear layer in the dtype ``torch.autocast`` runs it in on their device (a
    differentiable cast, as autocast's: fp32 weights get fp32 gradients), as given outside autocast. The
    ops themselves compute in the dtypes they are given, autocast or not (``library._without_autocast``),
    so the patched modules cast where the model's own linear layers would have been cast."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` itself (no subclass, no hooks): its call is exactly ``F.linear``."""
    hooks = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
        nn.modules.module._global_forward_hooks,
        nn.modules.module._global_forward_pre_hooks,
    )
    return type(module) is nn.Linear and not any(hooks)


class SwiGLUThenLinear(torch.autograd.Function):
    """``F.linear(swiglu(c), weight)`` for c (tokens, 2F) and weight (H, F), saving only c and weight:
    the backward recomputes ``swiglu(c)`` (one kernel, reading c once more) for the weight's gradient
    instead of keeping the (tokens, F) activation alive from forward to backward. The gradients are the
    GEMMs ``F.linear``'s backward runs and :func:`lowp_ops.dglu`'s ``dc``."""

    @staticmethod
    def forward(ctx, c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ones = c.new_ones(c.shape[:1], dtype=torch.float32)
        ctx.save_for_backward(c, weight, ones)
        return F.linear(library.swiglu_fwd(c, ones, 0), weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        c, weight, ones = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # Probabilities from a node of their own: traced, this call is then not the forward's
            # (common-subexpression elimination would merge the two and save the activation again).
            h = library.swiglu_fwd(c, torch.ones_like(ones), 0)
            grad_weight = grad.t().mm(h)
        grad_c = None
        if ctx.needs_input_grad[0]:
            one_group = c.new_full((1,), c.shape[0], dtype=torch.int64)
            grad_c, _, _ = library.dglu(grad.mm(weight), c, ones, one_group, 0)
        return grad_c, grad_weight


# ------------------------------------------------------------------------------------------ experts


def _sort_by_expert(expert_of_choice: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order (n,) sorting the (token, choice) rows by expert, stably; split sizes (E,) int64), both on
    the device."""
    order = torch.argsort(expert_of_choice, stable=True)
    ones = torch.ones_like(expert_of_choice)
    split_sizes = torch.zeros(experts, dtype=torch.int64, device=ones.device).scatter_add_(
        0, expert_of_choice, ones
    )
    return order, split_sizes


def padded_capacity(choices: int, experts: int, alignment: int) -> int:
    """Rows of the padded layout: enough for any routing of ``choices`` rows, a multiple of ``alignment``."""
    return -(-(choices + experts * (alignment - 1)) // alignment) * alignment


def _padded_rows(
    sorted_expert: torch.Tensor, split_sizes: torch.Tensor, alignment: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each sorted choice in the padded layout (n,), padded split sizes (E,)): every expert's
    rows start at a multiple of ``alignment``; the rows in between stay zero, and the last expert also
    owns the zero rows up to ``capacity`` (the split sizes sum to it, as the CPU references require)."""
    padded_sizes = (split_sizes + (alignment - 1)) // alignment * alignment
    starts = torch.cumsum(split_sizes, 0) - split_sizes
    padded_starts = torch.cumsum(padded_sizes, 0) - padded_sizes
    rank_in_expert = torch.arange(sorted_expert.shape[0], device=sorted_expert.device) - starts[sorted_expert]
    slack = capacity - padded_sizes.sum()
    padded_sizes = torch.cat((padded_sizes[:-1], padded_sizes[-1:] + slack))
    return padded_starts[sorted_expert] + rank_in_expert, padded_sizes


def _grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward (tokens (T, H), top-k expert ids and weights (T, k)) through
    ``grouped_swiglu_mlp``; (T, H) in hidden_states' dtype, the k choices summed."""
    gate_up, down, out_dtype = self.gate_up_proj, self.down_proj, hidden_states.dtype
    if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
        hidden_as, gate_up, down = _as_autocast_would(hidden_states, gate_up, down)
        if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
            raise ValueError(
                f"apply_lowp_ops(experts={self._lowp_recipe!r}): {type(self).__name__}'s weights are "
                f"{self.gate_up_proj.dtype}; the lowp experts take bf16 weights, or fp32 ones inside a bf16 "
                "autocast region (mixed precision): convert the model to bf16, train under "
                "torch.autocast(dtype=torch.bfloat16), or patch it without experts="
            )
        hidden_states = hidden_as
    tokens, top_k = top_k_index.shape
    experts, hidden = self.gate_up_proj.shape[0], hidden_states.shape[-1]
    alignment = ROW_ALIGNMENT[self._lowp_recipe]
    expert_of_choice = top_k_index.reshape(-1)
    order, split_sizes = _sort_by_expert(expert_of_choice, experts)
    x = hidden_states[order // top_k]
    probs = top_k_weights.reshape(-1)[order]
    if alignment == 1:
        row = torch.arange(order.shape[0], device=order.device)
    else:
        capacity = padded_capacity(order.shape[0], experts, alignment)
        row, split_sizes = _padded_rows(expert_of_choice[order], split_sizes, alignment, capacity)
        x = x.new_zeros(capacity, hidden).index_copy(0, row, x)
        probs = probs.new_zeros(capacity).index_copy(0, row, probs)
    y = grouped_swiglu_mlp(x, gate_up, down, split_sizes, probs, recipe=self._lowp_recipe)
    row_of_choice = torch.empty_like(order).scatter_(0, order, row)
    return y[row_of_choice].view(tokens, top_k, hidden).sum(dim=1).to(out_dtype)


# ---------------------------------------------------------------------------------------- attention


def lowp_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention with the probabilities from :func:`lowp_ops.softmax` (fp32 math,
    one rounding to the scores' dtype). query (B, Hq, S, D), key / value (B, Hkv, S_kv, D | Dv), an
    additive mask broadcastable to (B, Hq, S, S_kv). Returns ((B, S, Hq, Dv), probs (B, Hq, S, S_kv))."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("lowp_eager attention has no soft-capping and no attention sinks")
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (
        query.shape[-1] ** -0.5 if scaling is None else scaling
    )
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = lowp_softmax(scores, dim=-1, masked_rows="zero")
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs
