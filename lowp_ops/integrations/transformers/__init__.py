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
  in bf16) but a chunk has at least ``MIN_LOSS_CHUNK_TOKENS`` (1024) tokens where that stays within
  2^28 logits (``linear_cross_entropy``'s own default, 512 MiB): fewer, larger chunks accumulate the
  weight gradient in fewer passes (each pass reads and writes it: at Gemma's 256000-262144 classes the
  head and loss took 28-32% longer in 256-token chunks than in 1024-token ones), smaller ones add less to
  the whole model's peak memory (a ~1.5 B Llama at 4096 tokens: 13.10 GiB with 2048-token chunks,
  12.86 GiB with 512; benchmarks/RESULTS.md).
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

import inspect

import torch
from torch import nn

try:
    import transformers
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "lowp_ops.integrations.transformers needs transformers>=5,<6: pip install 'lowp_ops[transformers]'"
    ) from error

from transformers import PretrainedConfig
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

from ... import linear_cross_entropy
from ...meta.checks import check_bool, require
from .attention import _eager_attention_allowed, _select_lowp_attention
from .binding import bind, bound_function
from .experts import EXPERT_RECIPES, _grouped_experts_forward, _supported_experts
from .forms import norm_form
from .head import (
    LOGIT_TRANSFORMS,
    _causal_lm_loss,
    _forward_with_optional_logits,
    _hidden_passthrough,
    _StepSwitch,
)
from .layers import _dense_swiglu_forward, _dense_swiglu_modules, _rms_norm_forward, _rms_norm_modules

__all__ = ["apply_lowp_ops"]


GRAD_FORMATS = (None, "mxfp8_e4m3", "mxfp8_e5m2")


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
``LOGIT_TRANSFORMS``; each one is a test in tests/test_transformers_head.py."""


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
    _check_the_models_loss_is_causal_lm(model)
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
    expert_modules = _supported_experts(model, experts) if experts is not None else []
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
            module.forward = bind(_rms_norm_forward, module)
    for module in mlp_modules:
        module.forward = bind(_dense_swiglu_forward, module)
    for module in expert_modules:
        module._lowp_recipe = experts
        module.forward = bind(_grouped_experts_forward, module)
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


def _patch_head_and_loss(model: nn.Module, loss_options: dict) -> None:
    """Instance attributes only (:func:`binding.bind`), so the class and other instances stay as they are."""
    model._lowp_ops_loss = loss_options
    if model.config.model_type in LOGIT_TRANSFORMS:
        model._lowp_logit_step = _StepSwitch()
    model.lm_head.forward = bind(_hidden_passthrough, model.lm_head)
    model.loss_function = bind(_causal_lm_loss, model)
    model.forward = bind(_forward_with_optional_logits, model)


def _check_causal_lm(model: nn.Module) -> None:
    require(
        transformers.__version__.split(".")[0] == "5",
        lambda: f"apply_lowp_ops supports transformers 5.x, found {transformers.__version__}",
    )
    inner = getattr(model, "module", None)
    if not hasattr(model, "config") and isinstance(getattr(inner, "config", None), PretrainedConfig):
        raise ValueError(
            f"apply_lowp_ops takes the transformers model, got a {type(model).__name__} holding one in "
            "`.module` (DistributedDataParallel, DataParallel): patch the model before wrapping it"
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
        head is not None,
        lambda: (
            f"{type(model).__name__} has no lm_head child module (a wrapper that forwards attributes to the "
            "model inside it?): pass the transformers model itself, patched before wrapping it"
        ),
    )
    require(
        type(head) is nn.Linear,
        lambda: (
            f"model.lm_head must be a plain torch.nn.Linear child of the model, got "
            f"{type(head).__module__}.{type(head).__qualname__} ({type(model).__name__}): the fused loss "
            "reads lm_head.weight itself; patch before fully_shard(lm_head) or other wrappers of the head; "
            "an adapted head (PEFT's LoRA or modules_to_save on lm_head) is not supported, adapters on "
            "other modules are"
        ),
    )
    if head.bias is not None:
        raise NotImplementedError("apply_lowp_ops: an lm_head with a bias is not supported")


def _check_the_models_loss_is_causal_lm(model: nn.Module) -> None:
    """Refuses a model whose loss is not transformers' causal-LM loss (a ``loss_function`` set on the
    instance, or a ``loss_type`` of another loss): the patch computes that loss, and would drop another."""
    custom = vars(model).get("_loss_function")
    if custom is not None and custom is not ForCausalLMLoss and bound_function(custom) is not _causal_lm_loss:
        raise ValueError(
            f"apply_lowp_ops: model.loss_function was set to {custom!r}; the patch computes transformers' "
            "causal-LM loss (ForCausalLMLoss) with linear_cross_entropy and would drop it (its options: "
            "loss_options=...)"
        )
    loss_type = getattr(model, "loss_type", None)
    if custom is None and LOSS_MAPPING.get(loss_type, ForCausalLMLoss) is not ForCausalLMLoss:
        raise ValueError(
            f"apply_lowp_ops: model.loss_type {loss_type!r} selects {LOSS_MAPPING[loss_type].__name__}, not "
            "the causal-LM loss (ForCausalLMLoss) the patch computes"
        )


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
        if forward is not None and bound_function(forward) not in ours:
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
