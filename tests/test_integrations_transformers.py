"""``lowp_ops.integrations.transformers.apply_lowp_ops`` on tiny random transformers models (no downloads):
the patched model's loss and every parameter's gradient equal the unpatched model's (fp32: tight; bf16
experts: bf16 tolerance), the experts' padded layout equals each expert run alone, one compiled graph."""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import warnings

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="5", reason="needs transformers>=5,<6 (pip install 'lowp_ops[transformers]')"
)
from partition_checks import shapes_saved_by_compiled_forward  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator  # noqa: E402
from transformers.trainer_utils import RemoveColumnsCollator  # noqa: E402

import lowp_ops  # noqa: E402
from lowp_ops.integrations.transformers import LM_HEAD_MODEL_TYPES, apply_lowp_ops  # noqa: E402
from lowp_ops.integrations.transformers import attention as lowp_attention  # noqa: E402
from lowp_ops.integrations.transformers import experts as lowp_experts  # noqa: E402
from lowp_ops.integrations.transformers import forms as lowp_forms  # noqa: E402
from lowp_ops.integrations.transformers import head as lowp_head  # noqa: E402
from lowp_ops.integrations.transformers import layers as lowp_layers  # noqa: E402

VOCAB = 96
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
EXPERTS = {"num_experts_per_tok": 2}
EXTRA = {
    "qwen3": {"head_dim": 8},
    "qwen3_moe": {**EXPERTS, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 4},
    "qwen2_moe": {
        **EXPERTS,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
    },
    "mixtral": {**EXPERTS, "num_local_experts": 4, "intermediate_size": 16},
    "olmoe": {**EXPERTS, "num_experts": 4, "intermediate_size": 16},
    "deepseek_v3": {
        **EXPERTS,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
    },
    "gpt_oss": {
        **EXPERTS,
        "num_local_experts": 4,
        "intermediate_size": 16,
        "head_dim": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
    },
}
# Logit steps large enough that a loss without them is far off: tiny models' logits are ~0.1.
EXTRA.update(
    gemma={"head_dim": 8},
    gemma2={"head_dim": 8, "final_logit_softcapping": 0.05},
    gemma3_text={"head_dim": 8, "final_logit_softcapping": 0.05},
    gemma4_text={
        "head_dim": 8,
        "global_head_dim": 8,
        "final_logit_softcapping": 0.05,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 8,
    },
    granite={"logits_scaling": 0.3},
    cohere={"logit_scale": 3.0},
    cohere2={"logit_scale": 3.0},
)
LINEAR_ATTENTION = {
    "layer_types": ["linear_attention", "full_attention"],
    "head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
SMALL_EXPERTS = {
    **EXPERTS,
    "num_experts": 4,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 32,
}
EXTRA.update(
    apertus={"head_dim": 8},
    cohere2_moe={**EXPERTS, "num_local_experts": 4, "logit_scale": 3.0},
    deepseek_v2=EXTRA["deepseek_v3"],
    ernie4_5_moe={"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 16},
    glm4_moe={
        **EXPERTS,
        "n_routed_experts": 4,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    granitemoe={**EXPERTS, "num_local_experts": 4, "logits_scaling": 0.3},
    granitemoeshared={
        **EXPERTS,
        "num_local_experts": 4,
        "logits_scaling": 0.3,
        "shared_intermediate_size": 32,
    },
    hunyuan_v1_dense={"head_dim": 8},
    ministral={"head_dim": 8, "sliding_window": 8},
    qwen3_5_text=LINEAR_ATTENTION,
    qwen3_5_moe_text={**LINEAR_ATTENTION, **SMALL_EXPERTS},
    qwen3_next={**LINEAR_ATTENTION, **SMALL_EXPERTS},
)
MOE_TYPES = [
    *("cohere2_moe", "deepseek_v2", "deepseek_v3", "ernie4_5_moe", "glm4_moe", "granitemoe"),
    *("granitemoeshared", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"),
]
"""MoE families whose whole bf16 model is compared with lowp's experts; the linear-attention ones are
left out there (their gated-delta-net parameters' bf16 gradients differ from fp32 by 15-60% with the
model's own experts) and checked module by module."""
ALL_MOE_TYPES = [*MOE_TYPES, "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen3_vl_moe"]


TEXT_MODEL_TYPE = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
"""Multimodal causal LMs: their language model's options (``config`` goes there too) and a tiny vision
tower, which text-only batches leave unused."""
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}


MROPE = {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}
QWEN_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
IMAGE_TOKENS = {"image_token_id": VOCAB - 1, "video_token_id": VOCAB - 2, "vision_start_token_id": VOCAB - 3}
VISION_LANGUAGE = {
    "qwen2_vl": {
        **IMAGE_TOKENS,
        "text_config": {**COMMON, **MROPE},
        "vision_config": {**QWEN_VISION, "embed_dim": 32, "mlp_ratio": 2},
    },
    "qwen2_5_vl": {
        **IMAGE_TOKENS,
        "text_config": {**COMMON, **MROPE},
        "vision_config": {**QWEN_VISION, "fullatt_block_indexes": [0]},
    },
    "llava": {
        "image_token_id": VOCAB - 1,
        "text_config": {**COMMON, "model_type": "llama"},
        "vision_config": {**VISION, "model_type": "clip_vision_model", "image_size": 28, "patch_size": 14},
    },
    "mistral3": {
        "image_token_id": VOCAB - 1,
        "text_config": {**COMMON, "model_type": "mistral", "head_dim": 8},
        "vision_config": {
            **VISION,
            "model_type": "pixtral",
            "image_size": 28,
            "patch_size": 14,
            "head_dim": 16,
        },
    },
}
"""Vision-language models (``AutoModelForImageTextToText``), tiny; their image tokens at the top of the
vocabulary, which ``batch`` leaves out."""
QWEN3_VISION = {
    **QWEN_VISION,
    "patch_size": 16,
    "deepstack_visual_indexes": [0],
    "num_position_embeddings": 16,
}
INTERLEAVED_MROPE = {
    "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}
}
VISION_LANGUAGE.update(
    qwen3_vl={
        **IMAGE_TOKENS,
        "text_config": {**COMMON, "head_dim": 8, **INTERLEAVED_MROPE},
        "vision_config": QWEN3_VISION,
    },
    qwen3_vl_moe={
        **IMAGE_TOKENS,
        "text_config": {**COMMON, "head_dim": 8, **INTERLEAVED_MROPE, **SMALL_EXPERTS},
        "vision_config": QWEN3_VISION,
    },
    qwen3_5={**IMAGE_TOKENS, "text_config": {**COMMON, **LINEAR_ATTENTION}, "vision_config": QWEN3_VISION},
    qwen3_5_moe={
        **IMAGE_TOKENS,
        "text_config": {**COMMON, **LINEAR_ATTENTION, **SMALL_EXPERTS},
        "vision_config": QWEN3_VISION,
    },
)
LLAMA_TEXT = {**COMMON, "model_type": "llama"}
SMALL_IMAGES = {**VISION, "image_size": 28, "patch_size": 14}
VISION_LANGUAGE.update(
    llava_next={
        "image_token_id": VOCAB - 1,
        "text_config": LLAMA_TEXT,
        "vision_config": {**SMALL_IMAGES, "model_type": "clip_vision_model"},
        "image_grid_pinpoints": [[28, 28]],
    },
    idefics3={
        "image_token_id": VOCAB - 1,
        "text_config": LLAMA_TEXT,
        "vision_config": SMALL_IMAGES,
        "scale_factor": 2,
    },
    smolvlm={
        "image_token_id": VOCAB - 1,
        "text_config": LLAMA_TEXT,
        "vision_config": SMALL_IMAGES,
        "scale_factor": 2,
    },
    internvl={
        "image_token_id": VOCAB - 1,
        "text_config": {**COMMON, "model_type": "qwen2"},
        "vision_config": {**VISION, "image_size": [28, 28], "patch_size": [14, 14]},
    },
)
VISION_LANGUAGE["glm4v"] = {
    "image_token_id": VOCAB - 1,
    "video_token_id": VOCAB - 2,
    "image_start_token_id": VOCAB - 3,
    "text_config": {  # head_dim 16: half of it rotary (partial_rotary_factor), in M-RoPE sections 2, 1, 1
        **COMMON,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5},
    },
    "vision_config": {**QWEN_VISION, "image_size": 28},
}
IMAGE_TESTED = {
    "glm4v",
    "llava",
    "mistral3",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
}
"""Vision-language models run with images here; the others' vision towers hold no module lowp patches
(``test_untested_vision_towers_are_left_alone``), so text batches exercise every patch."""


AMPLIFYING = {"apertus", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
"""Families with parameters whose fp32 gradients amplify last-bit differences upstream (Apertus's xIELU,
the gated delta nets' ``dt_bias`` / ``A_log``: measured 1.0e-5 to 2.1e-5 of the norm)."""


def fp32_rtol(model_type: str) -> float:
    """Gradient tolerance of an fp32 model patched against its own: fp32 rounding, amplified or not."""
    return 5e-5 if model_type in AMPLIFYING else 5e-6


def tiny_model(model_type: str, dtype=torch.float32, seed=0, **config):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model_type in VISION_LANGUAGE:
            options = VISION_LANGUAGE[model_type]
            text = {**options["text_config"], **config}
            cfg = AutoConfig.for_model(model_type, **{**options, "text_config": text})
            return transformers.AutoModelForImageTextToText.from_config(cfg).to(dtype)
        if model_type in TEXT_MODEL_TYPE:
            text = {**COMMON, **EXTRA[TEXT_MODEL_TYPE[model_type]], **config}
            cfg = AutoConfig.for_model(model_type, text_config=text, vision_config=VISION)
        else:
            cfg = AutoConfig.for_model(model_type, **{**COMMON, **EXTRA.get(model_type, {}), **config})
        return AutoModelForCausalLM.from_config(cfg).to(dtype)


def batch(seed=0, rows=2, length=12, ignored=3):
    """Token ids and labels with -100 at the start of the first row (prompt tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 3, (rows, length), generator=gen)
    labels = ids.clone()
    labels[0, :ignored] = -100
    return ids, labels


def loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_same_training_signal(ref, patched, ids, labels, *, rtol, **kwargs):
    """Equal losses and, parameter by parameter, gradients within ``rtol`` of the gradient's norm."""
    want_loss, want = loss_and_grads(ref, ids, labels, **kwargs)
    got_loss, got = loss_and_grads(patched, ids, labels, **kwargs)
    torch.testing.assert_close(got_loss, want_loss, rtol=rtol, atol=0)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        error = (got[name].double() - grad.double()).norm() / grad.double().norm().clamp(min=1e-30)
        assert error <= rtol, f"{name}: gradient off by {float(error):.2e} of its norm"


# ----------------------------------------------------------------------------------- LM head + loss


@pytest.mark.parametrize("model_type", sorted(LM_HEAD_MODEL_TYPES))
def test_loss_and_gradients_equal_the_models_own_fp32(model_type):
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    assert_same_training_signal(ref, patched, *batch(), rtol=fp32_rtol(model_type))


def image_batch(model_type):
    """(ids, labels, image inputs) of a text batch with one image per row: its tokens at positions 2..,
    unlabelled, as a processor lays them out (their count is what the vision tower outputs per image)."""
    ids, labels = batch()
    gen = torch.Generator().manual_seed(7)
    tokens = 1
    grid_images = model_type.startswith("qwen") or model_type == "glm4v"
    if grid_images:  # 2 x 2 patches per image, merged 2 x 2 into one token
        patch = VISION_LANGUAGE[model_type]["vision_config"]["patch_size"]
        images = {
            "pixel_values": torch.randn(2 * 4, 3 * 2 * patch * patch, generator=gen),
            "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]]),
        }
    elif model_type == "mistral3":
        images = {
            "pixel_values": torch.randn(2, 3, 28, 28, generator=gen),
            "image_sizes": torch.tensor([[28, 28], [28, 28]]),
        }
    else:
        tokens, images = 4, {"pixel_values": torch.randn(2, 3, 28, 28, generator=gen)}
    ids[:, 2 : 2 + tokens] = VOCAB - 1
    labels[:, 2 : 2 + tokens] = -100
    if grid_images:
        images["mm_token_type_ids"] = (ids == VOCAB - 1).long()  # M-RoPE's image positions
    return ids, labels, images


@pytest.mark.parametrize("model_type", sorted(IMAGE_TESTED))
def test_vision_language_models_with_images(model_type):
    """Images through the vision tower (some of whose norms are patched too: Qwen2.5-VL's are Llama's)
    into the language model: the patched model's loss and gradients are the unpatched one's."""
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels, images = image_batch(model_type)
    assert_same_training_signal(ref, patched, ids, labels, rtol=fp32_rtol(model_type), **images)


@pytest.mark.parametrize("model_type", sorted(set(VISION_LANGUAGE) - IMAGE_TESTED))
def test_untested_vision_towers_are_left_alone(model_type):
    model = apply_lowp_ops(tiny_model(model_type))
    language_model = model.get_decoder()
    inside = {id(module) for module in language_model.modules()}
    patched = [name for name, m in model.named_modules() if "forward" in vars(m) and id(m) not in inside]
    assert sorted(patched) == ["", "lm_head"]


def test_tied_embeddings_router_aux_loss_and_mxfp8_gradient():
    ref = tiny_model("mixtral", tie_word_embeddings=True, output_router_logits=True)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    assert patched.lm_head.weight is patched.model.embed_tokens.weight
    assert_same_training_signal(ref, patched, *batch(), rtol=2e-6)
    mxfp8 = apply_lowp_ops(copy.deepcopy(ref), grad_format="mxfp8_e4m3")
    assert_same_training_signal(ref, mxfp8, *batch(), rtol=0.1)  # E4M3 logits gradient


@pytest.mark.parametrize("labels_given", [True, False])
def test_tuple_output_keeps_the_models_positions(labels_given):
    """``return_dict=False``: the model's own tuple drops None fields; the patched one keeps the logits'
    slot (None when training with labels) so that every later field stays where it was."""
    ref = tiny_model("qwen3_moe", output_router_logits=True)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels = batch()
    kwargs = {"labels": labels} if labels_given else {}
    want = ref(input_ids=ids, return_dict=False, **kwargs)
    got = patched(input_ids=ids, return_dict=False, **kwargs)
    assert len(got) == len(want)
    # (loss, aux_loss, logits, past_key_values, router_logits); no loss without labels
    logits_at = 2 if labels_given else 1
    assert want[logits_at].shape == (*ids.shape, VOCAB)
    if labels_given:
        assert got[logits_at] is None
        torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=0)
    else:
        torch.testing.assert_close(got[logits_at], want[logits_at], rtol=2e-6, atol=2e-6)
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        if index != logits_at:
            assert type(mine) is type(theirs), index


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma2"])
def test_a_whole_patched_model_saves_and_loads(model_type, tmp_path):
    """torch.save / pickle of the whole patched model loads back patched, with the same loss (bound
    methods pickled as getattr(module, name), which the modules do not have)."""
    options = {"experts": "bf16"} if model_type == "qwen3_moe" else {}
    dtype = torch.bfloat16 if options else torch.float32
    model = apply_lowp_ops(tiny_model(model_type, dtype=dtype), **options)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    ids, labels = batch()
    assert torch.equal(loaded(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss)
    assert loaded.lm_head.forward.func is lowp_head._hidden_passthrough
    assert inspect.signature(loaded.forward) == inspect.signature(model.forward)


class ForwardingWrapper(torch.nn.Module):
    """A wrapper whose attributes (``config``, ``lm_head``) read through to the model, as PEFT's do."""

    def __init__(self, model):
        super().__init__()
        self.base_model = model

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)


class PeftLikeWrapper(ForwardingWrapper):
    """PEFT's ``PeftModel``: the wrapped model from ``get_base_model()``."""

    def get_base_model(self):
        return self.base_model


@pytest.mark.parametrize(
    ("model_type", "options"), [("llama", {}), ("gemma2", {}), ("qwen3_moe", {"experts": "bf16"})]
)
def test_mixed_precision_computes_as_the_models_own_autocast(model_type, options, monkeypatch):
    """fp32 weights under ``torch.autocast(bfloat16)`` (transformers' Trainer with ``bf16=True``): the
    patched LM head, dense MLPs and experts take bf16 operands where the model's linear layers would
    (the ops themselves never autocast), and the fp32 weights get fp32 gradients; loss and gradients
    as close to the model's own autocast step as two bf16 computations are (measured: at most 8.3e-3)."""
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref), **options)
    dtypes = []
    loss_of = lowp_head.linear_cross_entropy
    monkeypatch.setattr(
        lowp_head,
        "linear_cross_entropy",
        lambda h, w, *a, **k: dtypes.append((h.dtype, w.dtype)) or loss_of(h, w, *a, **k),
    )
    ids, labels = batch()
    results = []
    for model in (ref, patched):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    assert dtypes == [(torch.bfloat16, torch.bfloat16)]
    (want_loss, want), (got_loss, got) = results
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-3, atol=0)
    assert got.keys() == want.keys() and all(g.dtype == torch.float32 for g in got.values())
    for name, grad in want.items():
        error = (got[name].double() - grad.double()).norm() / grad.double().norm().clamp(min=1e-30)
        assert error <= 2e-2, f"{name}: gradient off by {float(error):.2e} of its norm"


def test_wrapped_models_have_their_transformers_model_patched():
    """A PEFT-style wrapper (``get_base_model``) or a ``torch.compile``'d model: the model inside is
    patched, the wrapper returned; a wrapper that only forwards attributes is refused (patching it
    would leave the inner forward's loss unpatched, fed the hidden states)."""
    ref = tiny_model("llama")
    ids, labels = batch()
    want = ref(input_ids=ids, labels=labels).loss
    for wrap in (PeftLikeWrapper, functools.partial(torch.compile, backend="eager")):
        inner = copy.deepcopy(ref)
        wrapped = wrap(inner)
        assert apply_lowp_ops(wrapped) is wrapped
        assert inner.lm_head.forward.func is lowp_head._hidden_passthrough
        torch.testing.assert_close(wrapped(input_ids=ids, labels=labels).loss, want, rtol=2e-6, atol=0)
    forwarding = ForwardingWrapper(copy.deepcopy(ref))
    with pytest.raises(ValueError, match=r"lm_head must be an nn\.Linear child of the model"):
        apply_lowp_ops(forwarding)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_trainer_keeps_the_batch_columns_the_forward_names(model_type):
    """transformers' Trainer hands a batch only the columns ``inspect.signature(model.forward)`` names
    (``RemoveColumnsCollator``): the patched forward names the class's parameters (a bare ``**kwargs``
    dropped ``input_ids`` and ``labels``) and ``return_logits``."""
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    names = list(inspect.signature(patched.forward).parameters)
    want = [name for name in inspect.signature(type(ref).forward).parameters if name != "self"]
    assert [name for name in names if name != "return_logits"] == want and "return_logits" in names
    collate = RemoveColumnsCollator(default_data_collator, names)
    ids, labels = batch()
    columns = collate([{"input_ids": i, "labels": t, "text": "-"} for i, t in zip(ids, labels, strict=True)])
    assert set(columns) == {"input_ids", "labels"}
    torch.testing.assert_close(patched(**columns).loss, ref(**columns).loss, rtol=5e-6, atol=0)


def test_forwards_replaced_by_other_libraries_are_refused():
    """accelerate's device hooks (after ``device_map`` dispatch) and other patchers replace ``forward`` on
    the instance; lowp's patch would drop them: refused, naming the module, the model left as it was.
    Patching twice is fine (the forwards are lowp's own)."""
    for path in ("lm_head", "model.layers.1.post_attention_layernorm", "model.layers.0.mlp"):
        model = tiny_model("llama")
        module = model.get_submodule(path)
        module.forward = functools.partial(type(module).forward, module)
        with pytest.raises(ValueError, match=rf"{path}\.forward was replaced on the instance"):
            apply_lowp_ops(model)
        assert "forward" not in vars(model) and "forward" not in vars(model.model.norm)
    twice = apply_lowp_ops(apply_lowp_ops(tiny_model("llama")))
    ref = tiny_model("llama")
    ids, labels = batch()
    want = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(twice(input_ids=ids, labels=labels).loss, want, rtol=5e-6, atol=0)


def test_experts_converted_after_patching_are_named():
    model = apply_lowp_ops(tiny_model("qwen3_moe", dtype=torch.bfloat16), experts="bf16").float()
    with pytest.raises(ValueError, match=r"apply_lowp_ops\(experts='bf16'\): .* are torch.float32;"):
        model(input_ids=batch()[0])


def test_head_replaced_after_patching_is_named():
    """resize_token_embeddings replaces lm_head: the patched forward says so instead of feeding logits
    to the loss as hidden states."""
    model = apply_lowp_ops(tiny_model("llama"))
    model.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    ids, labels = batch()
    for kwargs in ({"labels": labels}, {}):
        with pytest.raises(RuntimeError, match="lm_head was replaced after apply_lowp_ops"):
            model(input_ids=ids, **kwargs)


def test_gradient_accumulation_with_num_items_in_batch():
    """Two micro-batches, each loss summed and divided by the valid labels of both: the accumulated
    gradient equals the unpatched model's, and the summed loss equals the mean over the full batch."""
    ref = tiny_model("llama")
    patched = apply_lowp_ops(copy.deepcopy(ref))
    micro = [batch(seed=1, ignored=5), batch(seed=2, ignored=1)]
    num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
    losses = {}
    for model in (ref, patched):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for ids, labels in micro:
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(num_items)).loss
            loss.backward()
            total += loss.detach()
        losses[model] = total
    full_ids = torch.cat([ids for ids, _ in micro])
    full_labels = torch.cat([labels for _, labels in micro])
    full_mean = ref(input_ids=full_ids, labels=full_labels).loss.detach()
    torch.testing.assert_close(losses[patched], full_mean, rtol=2e-6, atol=0)
    torch.testing.assert_close(losses[patched], losses[ref], rtol=2e-6, atol=0)
    for (name, want), got in zip(ref.named_parameters(), patched.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_shift_labels_are_used_as_given():
    ref = tiny_model("qwen3")
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels = batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    assert_same_training_signal(ref, patched, ids, labels, rtol=2e-6, shift_labels=shifted)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "granite", "cohere"])
def test_logits_only_when_asked_or_without_labels(model_type):
    """The head's own logits, bit for bit (norms and MLPs left alone: they round in another order), its
    logit step (soft-capping, scales) included."""
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref), rms_norm=False, mlp=False)
    ids, labels = batch()
    assert patched(input_ids=ids, labels=labels).logits is None
    want = ref(input_ids=ids).logits
    torch.testing.assert_close(patched(input_ids=ids).logits, want, rtol=0, atol=0)
    out = patched(input_ids=ids, labels=labels, return_logits=True)
    torch.testing.assert_close(out.logits, want, rtol=0, atol=0)
    assert out["logits"] is out.logits
    last = patched(input_ids=ids, logits_to_keep=1).logits
    torch.testing.assert_close(last, ref(input_ids=ids, logits_to_keep=1).logits, rtol=0, atol=0)
    assert last.shape == (2, 1, VOCAB)
    patched.eval()
    loss, logits, *_ = patched(input_ids=ids, labels=labels, return_dict=False)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=labels).loss, rtol=2e-6, atol=0)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_generate_uses_the_patched_head(model_type):
    ref = tiny_model(model_type).eval()
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, _ = batch()
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(ids, **options), ref.generate(ids, **options))


# ----------------------------------------------------------------- logit steps (Gemma, Granite, Cohere)


def logit_step_value(model):
    transform = lowp_head.LOGIT_TRANSFORMS[model.config.model_type]
    return getattr(transform.holder(model), transform.name)


@pytest.mark.parametrize("model_type", sorted(lowp_head.LOGIT_TRANSFORMS))
def test_logit_step_is_back_after_each_forward(model_type):
    """The class forward runs with the step switched off; afterwards, an exception included, the model
    has its own value again (so save_pretrained and the unpatched class see it)."""
    model = apply_lowp_ops(tiny_model(model_type))
    value = logit_step_value(model)
    ids, labels = batch()
    model(input_ids=ids, labels=labels).loss.backward()
    assert logit_step_value(model) == value
    with pytest.raises(IndexError):
        model(input_ids=ids + VOCAB, labels=labels)  # the embedding raises inside the class forward
    assert logit_step_value(model) == value
    assert model._lowp_logit_step.running == 0


@pytest.mark.parametrize("model_type", sorted(lowp_head.LOGIT_TRANSFORMS))
def test_bf16_logit_steps_are_as_close_to_fp32_as_the_models_own(model_type):
    """In bf16 the model rounds its logits and each step to bf16, the fused loss soft-caps in fp32 and
    scales the hidden states: its loss and gradients are as close to the fp32 model's as the model's own
    bf16 ones (measured: 0.9-1.1x the model's gradient error; a missing step is off by percents)."""
    ids, labels = batch()
    fp32_loss, fp32 = loss_and_grads(tiny_model(model_type), ids, labels)
    ref = tiny_model(model_type, torch.bfloat16)
    loss_errors, grad_errors = {}, {}
    for name, model in (("own", ref), ("lowp", apply_lowp_ops(copy.deepcopy(ref)))):
        loss, grads = loss_and_grads(model, ids, labels)
        loss_errors[name] = float((loss.double() - fp32_loss.double()).abs() / fp32_loss.double())
        grad_errors[name] = max(
            float((grads[k].double() - g.double()).norm() / g.double().norm()) for k, g in fp32.items()
        )
    assert loss_errors["lowp"] <= max(1.5 * loss_errors["own"], 2e-4), loss_errors
    assert grad_errors["lowp"] <= 1.5 * grad_errors["own"], grad_errors


def test_loss_function_outside_the_patched_forward_is_refused():
    """The class's own forward would soft-cap the hidden states the patched head hands through."""
    model = apply_lowp_ops(tiny_model("gemma2"))
    ids, labels = batch()
    with pytest.raises(RuntimeError, match="inside its patched forward only"):
        type(model).forward(model, input_ids=ids, labels=labels)


def test_concurrent_forwards_keep_the_step_switched_off():
    """Forwards of one model on several threads: each loss is the model's own, and the value is back
    once the last one ends (the first to start switches the step off, the last to end restores it)."""
    ref = tiny_model("gemma2")
    model = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels = batch()
    with torch.no_grad():
        want = ref(input_ids=ids, labels=labels).loss
    start = threading.Barrier(4)
    losses = []

    def train_steps():
        start.wait()
        for _ in range(5):
            with torch.no_grad():
                losses.append(model(input_ids=ids, labels=labels).loss)

    threads = [threading.Thread(target=train_steps) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(losses) == 20
    for loss in losses:
        torch.testing.assert_close(loss, want, rtol=2e-6, atol=0)
    assert logit_step_value(model) == 0.05 and model._lowp_logit_step.running == 0


def test_softcap_is_the_models_own():
    """A soft-capping model refuses a second ``softcap``; a Gemma 3 built without one takes it as a loss
    option, and its loss then equals the soft-capping model's."""
    with pytest.raises(ValueError, match="soft-caps its logits itself"):
        apply_lowp_ops(tiny_model("gemma2"), softcap=30.0)
    capped = tiny_model("gemma3_text")
    uncapped = apply_lowp_ops(tiny_model("gemma3_text", final_logit_softcapping=None), softcap=0.05)
    ids, labels = batch()
    torch.testing.assert_close(
        uncapped(input_ids=ids, labels=labels).loss,
        capped(input_ids=ids, labels=labels).loss,
        rtol=2e-6,
        atol=0,
    )


def test_compiled_softcapped_loss_is_one_graph():
    """Dynamo traces the switch (attribute writes it replays): one graph, the eager loss, the value back."""
    model = apply_lowp_ops(tiny_model("gemma2"))
    ids, labels = batch()
    eager = model(input_ids=ids, labels=labels).loss
    counters.clear()
    compiled = torch.compile(
        lambda ids, labels: model(input_ids=ids, labels=labels).loss, backend="aot_eager", fullgraph=True
    )
    loss = compiled(ids, labels)
    loss.backward()
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=0)
    assert logit_step_value(model) == 0.05 and model._lowp_logit_step.running == 0


# ------------------------------------------------------------------------------------------ experts


def sharpen_routers(model, factor=30.0):
    """Routers' weights (``*gate`` / ``*router*`` linears of (experts, hidden)) scaled up: a tiny random
    model's router logits are near ties, which one last-bit difference upstream flips (measured: 1 of 24
    tokens routed elsewhere in DeepSeek-V2, its experts' gradients then 33% apart), a trained one's are
    not."""
    experts = {module.gate_up_proj.shape[0] for module in lowp_experts._experts_modules(model)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner = name.rsplit(".", 1)[0]
            if (
                param.dim() == 2
                and param.shape[0] in experts
                and ("gate" in owner.rsplit(".", 1)[-1] or "router" in owner)
            ):
                param.mul_(factor)
    return model


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_bf16_experts_match_the_models_own(model_type):
    ref = sharpen_routers(tiny_model(model_type, torch.bfloat16))
    patched = apply_lowp_ops(copy.deepcopy(ref), experts="bf16")
    experts = lowp_experts._experts_modules(patched)
    assert experts and all("forward" in vars(module) for module in experts)
    assert_same_training_signal(ref, patched, *batch(), rtol=3e-2)


def test_expert_weights_stay_the_models_parameters():
    model = tiny_model("qwen3_moe", torch.bfloat16)
    before = dict(model.named_parameters())
    apply_lowp_ops(model, experts="mxfp8")
    assert dict(model.named_parameters()) == before
    model(input_ids=batch()[0], labels=batch()[1]).loss.backward()
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad is not None and experts.down_proj.grad is not None


def expert_rows_alone(module, recipe, hidden, top_k_index, top_k_weights):
    """The oracle of the padded layout: each expert's (token, choice) rows, zero-padded on their own to
    the recipe's alignment, through grouped_swiglu_mlp with that expert's weights only."""
    alignment = lowp_experts.ROW_ALIGNMENT[recipe]
    out = hidden.new_zeros(top_k_index.numel(), hidden.shape[1])
    for expert in range(module.gate_up_proj.shape[0]):
        choices = (top_k_index.reshape(-1) == expert).nonzero().squeeze(1)
        rows = -(-max(len(choices), 1) // alignment) * alignment
        x = hidden.new_zeros(rows, hidden.shape[1])
        x[: len(choices)] = hidden[choices // top_k_index.shape[1]]
        probs = top_k_weights.new_zeros(rows)
        probs[: len(choices)] = top_k_weights.reshape(-1)[choices]
        y = lowp_ops.grouped_swiglu_mlp(
            x,
            module.gate_up_proj[expert : expert + 1],
            module.down_proj[expert : expert + 1],
            torch.tensor([rows]),
            probs,
            recipe=recipe,
        )
        out[choices] = y[: len(choices)]
    return out.view(*top_k_index.shape, -1).sum(dim=1)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
def test_padded_expert_layout_equals_each_expert_alone(recipe):
    """Bit for bit: the quantization blocks of one expert never see another expert's rows."""
    model = tiny_model("qwen3_moe", torch.bfloat16, moe_intermediate_size=32, num_experts=3)
    experts = model.model.layers[0].mlp.experts
    apply_lowp_ops(model, experts=recipe)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(29, 32, generator=gen).bfloat16()
    top_k_index = torch.stack([torch.randint(0, 3, (29,), generator=gen), torch.full((29,), 2)], dim=1)
    top_k_index[:5, 0] = 1
    top_k_weights = torch.rand(29, 2, generator=gen)
    got = experts(hidden, top_k_index, top_k_weights)
    assert got.dtype == torch.bfloat16 and got.shape == hidden.shape
    assert torch.equal(got, expert_rows_alone(experts, recipe, hidden, top_k_index, top_k_weights))


def test_bf16_experts_match_float64():
    model = tiny_model("mixtral", torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    apply_lowp_ops(model, experts="bf16")
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(17, 32, generator=gen).bfloat16()
    top_k_weights, top_k_index = torch.rand(17, 4, generator=gen).topk(2, dim=-1)
    got = experts(hidden, top_k_index, top_k_weights).detach()
    gate_up, down = experts.gate_up_proj.detach().double(), experts.down_proj.detach().double()
    want = torch.zeros(17, 32, dtype=torch.float64)
    for token in range(17):
        for choice in range(2):
            expert = top_k_index[token, choice]
            gate, up = (gate_up[expert] @ hidden[token].double()).chunk(2)
            act = torch.nn.functional.silu(gate) * up * top_k_weights[token, choice].double()
            want[token] += down[expert] @ act
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


@pytest.mark.parametrize("model_type", sorted(ALL_MOE_TYPES))
def test_each_familys_experts_equal_their_own_forward(model_type):
    """The patched experts module of every MoE family against its class's own forward in fp32 (the same
    bf16 weights and inputs; its grouped GEMMs take no float64): bf16 rounding apart, the same weighted
    sum of the chosen experts."""
    model = tiny_model(model_type, torch.bfloat16)
    experts = lowp_experts._experts_modules(model)[0]
    oracle = copy.deepcopy(experts).float()
    apply_lowp_ops(model, experts="bf16")
    assert "forward" in vars(experts)
    count, hidden_size = experts.gate_up_proj.shape[0], experts.down_proj.shape[1]
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(17, hidden_size, generator=gen).bfloat16()
    top_k_weights, top_k_index = torch.rand(17, count, generator=gen).topk(2, dim=-1)
    got = experts(hidden, top_k_index, top_k_weights).double()
    want = type(oracle).forward(oracle, hidden.float(), top_k_index, top_k_weights).double()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_gpt_oss_experts_are_refused_and_the_model_left_alone():
    model = tiny_model("gpt_oss", torch.bfloat16)
    with pytest.raises(NotImplementedError, match="biases, transposed weights"):
        apply_lowp_ops(model, experts="bf16")
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)


def test_fp32_experts_run_only_under_bf16_autocast():
    """fp32 expert weights are mixed precision's master weights: taken inside a bf16 autocast region (cast
    per call, as autocast casts a linear layer's), refused outside one, naming the way out."""
    model = apply_lowp_ops(tiny_model("olmoe"), experts="bf16")
    with pytest.raises(ValueError, match=r"weights are torch.float32; .* bf16 autocast region"):
        model(input_ids=batch()[0])
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="bf16 autocast"):
        model(input_ids=batch()[0])
    with pytest.raises(NotImplementedError, match="not bf16"):
        apply_lowp_ops(tiny_model("olmoe", dtype=torch.float16), experts="bf16")


def test_experts_on_a_dense_model_are_refused():
    with pytest.raises(ValueError, match="no fused MoE experts"):
        apply_lowp_ops(tiny_model("llama", torch.bfloat16), experts="bf16")


# ---------------------------------------------------------------------------------------- attention


NOT_PLAIN_ATTENTION = {"gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "gpt_oss", "llama4_text"}
"""Families whose eager attention is not Llama's plain softmax (soft-capping, sinks, other scalings)."""


@pytest.mark.parametrize(
    "model_type", sorted(LM_HEAD_MODEL_TYPES - NOT_PLAIN_ATTENTION - set(VISION_LANGUAGE))
)
def test_eager_attention_softmax_through_lowp(model_type, monkeypatch):
    ref = tiny_model(model_type, attn_implementation="eager")
    patched = apply_lowp_ops(copy.deepcopy(ref), softmax=True)
    assert patched.config._attn_implementation == lowp_attention.ATTENTION_NAME
    assert ref.config._attn_implementation == "eager"
    calls = []

    def counting_softmax(*args, **kwargs):
        calls.append(args[0].shape)
        return lowp_ops.softmax(*args, **kwargs)

    monkeypatch.setattr(lowp_attention, "lowp_softmax", counting_softmax)
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    assert_same_training_signal(ref, patched, ids, labels, rtol=fp32_rtol(model_type), attention_mask=mask)
    layer_types = getattr(ref.config, "layer_types", None) or ["full_attention"] * COMMON["num_hidden_layers"]
    assert len(calls) == sum(kind != "linear_attention" for kind in layer_types)


@pytest.mark.parametrize("model_type", sorted(NOT_PLAIN_ATTENTION - set(TEXT_MODEL_TYPE)))
def test_softmax_refuses_other_eager_attentions(model_type):
    model = tiny_model(model_type, attn_implementation="eager")
    with pytest.raises(NotImplementedError, match="not Llama's plain softmax attention"):
        apply_lowp_ops(model, softmax=True)
    assert "forward" not in vars(model)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_softmax_refuses_multimodal_models(model_type):
    model = tiny_model(model_type)
    model.set_attn_implementation("eager")
    with pytest.raises(NotImplementedError, match="multimodal model"):
        apply_lowp_ops(model, softmax=True)
    assert "forward" not in vars(model)


def test_softmax_leaves_sdpa_alone():
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="left alone"):
        apply_lowp_ops(model, softmax=True)
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------------- compile, errors


@pytest.mark.parametrize(
    ("model_type", "options"),
    [("qwen3_moe", {"experts": "mxfp8", "grad_format": "mxfp8_e4m3"}), ("llama", {})],
    ids=["qwen3_moe-mxfp8", "llama"],
)
def test_compiled_loss_is_one_graph(model_type, options):
    """The whole patched forward with its loss in one Dynamo graph: no graph break anywhere, in lowp ops
    or around them (MoE: router, sorted and padded MXFP8 experts, MXFP8 LM-head gradient; Llama: the
    dense MLPs with their recomputed activation; both: the RMSNorms through lowp_ops.rms_norm, which
    ``rms_norm=True`` keeps under compile)."""
    model = apply_lowp_ops(tiny_model(model_type, torch.bfloat16), rms_norm=True, **options)
    ids, labels = batch()
    items = torch.tensor(int((labels[:, 1:] != -100).sum()))
    eager = model(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    counters.clear()
    compiled = torch.compile(
        lambda ids, labels: model(input_ids=ids, labels=labels, num_items_in_batch=items).loss,
        backend="aot_eager",
        fullgraph=True,
    )
    loss = compiled(ids, labels)
    loss.backward()
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=0)


def lowp_ops_in_compiled_graph(model, ids, labels) -> set[str]:
    """The lowp:: ops of the graph Dynamo traces from the patched model's loss."""
    seen = set()

    def backend(graph_module, example_inputs):
        seen.update(str(n.target) for n in graph_module.graph.nodes if str(n.target).startswith("lowp."))
        return graph_module.forward

    loss = torch.compile(lambda i, t: model(input_ids=i, labels=t).loss, backend=backend, fullgraph=True)
    loss(ids, labels)
    return seen


@pytest.mark.parametrize(("rms_norm", "compiled_norm"), [("eager", False), (True, True)])
def test_rms_norm_eager_leaves_compiled_norms_to_inductor(rms_norm, compiled_norm, monkeypatch):
    """``rms_norm="eager"`` (the default): eager calls of a norm run lowp_ops.rms_norm, traced ones the
    module's own forward, so no lowp::rms_norm op reaches Inductor; ``True`` keeps the op traced too."""
    model = apply_lowp_ops(tiny_model("llama", torch.bfloat16), rms_norm=rms_norm)
    ids, labels = batch()
    norm = model.model.norm
    x = torch.randn(4, norm.weight.shape[0]).bfloat16()
    calls = []
    lowp_norm = lowp_layers.lowp_rms_norm
    monkeypatch.setattr(lowp_layers, "lowp_rms_norm", lambda *a, **k: calls.append(1) or lowp_norm(*a, **k))
    norm(x)
    assert calls, "the eager call did not run lowp_ops.rms_norm"
    monkeypatch.undo()
    ops = lowp_ops_in_compiled_graph(model, ids, labels)
    assert any(op.startswith("lowp.linear_cross_entropy") for op in ops), ops
    assert any(op.startswith("lowp.rms_norm") for op in ops) == compiled_norm, ops


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"grad_format": "fp8"}, ValueError, "grad_format"),
        ({"experts": "fp8"}, ValueError, "experts"),
        ({"softmax": "yes"}, TypeError, "softmax must be a bool"),
        ({"rms_norm": "always"}, ValueError, "rms_norm"),
        ({"chunk_sise": 256}, TypeError, "chunk_sise"),
        ({"process_group": object()}, NotImplementedError, "process_group"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    model = tiny_model("llama")
    with pytest.raises(error, match=message):
        apply_lowp_ops(model, **kwargs)
    assert "forward" not in vars(model)


def test_unchecked_model_types_are_refused():
    model = tiny_model("phimoe", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(NotImplementedError, match="phimoe"):
        apply_lowp_ops(model)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.interp
def test_interp_patched_moe_runs_the_kernels():
    """The Triton kernels (under the interpreter) behind the patched LM head, experts and softmax."""
    ref = tiny_model("qwen3_moe", torch.bfloat16, attn_implementation="eager", num_hidden_layers=1)
    patched = apply_lowp_ops(copy.deepcopy(ref), experts="bf16", softmax=True)
    assert_same_training_signal(ref, patched, *batch(length=6), rtol=3e-2)


@pytest.mark.slow
def test_inductor_compiles_the_patched_moe():
    """Inductor lowers the patched step in one graph, with the eager loss and gradients to bf16
    tolerance (Inductor fuses the model's own bf16 ops and rounds them differently)."""
    ref = apply_lowp_ops(tiny_model("qwen3_moe", torch.bfloat16, num_hidden_layers=1), experts="bf16")
    compiled = copy.deepcopy(ref)
    ids, labels = batch()
    want_loss, want = loss_and_grads(ref, ids, labels)
    counters.clear()
    step = torch.compile(lambda ids, labels: compiled(input_ids=ids, labels=labels).loss, fullgraph=True)
    loss = step(ids, labels)
    loss.backward()
    assert not counters["graph_break"]
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    for name, p in compiled.named_parameters():
        error = (p.grad.double() - want[name].double()).norm() / want[name].double().norm()
        assert error <= 3e-2, f"{name}: {float(error):.2e}"


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
def test_gpu_patched_experts_and_loss_never_sync(recipe):
    """The sorted experts (forward and backward) and the loss function run without a host sync."""
    model = apply_lowp_ops(
        tiny_model("qwen3_moe", torch.bfloat16).cuda(), experts=recipe, grad_format="mxfp8_e4m3"
    )
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(64, 32, device="cuda", generator=gen).bfloat16().requires_grad_()
    top_k_weights, top_k_index = torch.rand(64, 4, device="cuda", generator=gen).topk(2, dim=-1)
    ids, labels = (t.cuda() for t in batch())
    final_hidden = torch.randn(*ids.shape, 32, device="cuda", generator=gen).bfloat16().requires_grad_()
    num_items = torch.tensor(20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = experts(hidden, top_k_index, top_k_weights)
        loss = model.loss_function(final_hidden, labels, VOCAB, num_items_in_batch=num_items)
        (out.float().sum() + loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(final_hidden.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_next"])
def test_gpu_soft_capped_loss_and_unit_offset_norms(model_type):
    """A patched bf16 training step on the GPU (Gemma 2: the soft-capped fused loss, its 1 + weight norms
    on the fp32-weight kernels; Qwen3-Next: the same norms beside its gated delta nets): loss and
    gradients within bf16 of the model's own."""
    ref = tiny_model(model_type, torch.bfloat16).cuda()
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels = (t.cuda() for t in batch())
    want_loss, want = loss_and_grads(ref, ids, labels)
    got_loss, got = loss_and_grads(patched, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-3, atol=0)
    for name, grad in want.items():
        error = (got[name].double() - grad.double()).norm() / grad.double().norm().clamp(min=1e-30)
        assert error <= 5e-2, f"{name}: gradient off by {float(error):.2e} of its norm"


@pytest.mark.gpu
def test_gpu_bf16_experts_match_the_models_own():
    ref = tiny_model("qwen3_moe", torch.bfloat16).cuda()
    patched = apply_lowp_ops(copy.deepcopy(ref), experts="bf16")
    ids, labels = (t.cuda() for t in batch())
    assert_same_training_signal(ref, patched, ids, labels, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_gpu_low_precision_experts_train(recipe):
    """MXFP8 / NVFP4 experts and the MXFP8 LM-head gradient: the loss of the bf16 model, gradients of
    the quantization's size (the bf16 patched model is the reference)."""
    ref = apply_lowp_ops(tiny_model("mixtral", torch.bfloat16).cuda(), experts="bf16")
    low = apply_lowp_ops(copy.deepcopy(ref), experts=recipe, grad_format="mxfp8_e4m3")
    ids, labels = (t.cuda() for t in batch())
    want_loss, want = loss_and_grads(ref, ids, labels)
    got_loss, got = loss_and_grads(low, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-2, atol=0)
    for name, grad in want.items():
        error = (got[name].double() - grad.double()).norm() / grad.double().norm()
        assert error <= 0.5, f"{name}: {float(error):.2e}"


# ------------------------------------------------------------------------------ RMSNorm, dense MLPs


def saved_bytes(model, ids, labels) -> int:
    """Bytes of the distinct tensors autograd saves for the backward of one training forward."""
    saved = {}

    def pack(tensor):
        saved[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=labels)
    return sum(saved.values())


NO_RMS_NORMS = {"cohere", "cohere2", "cohere2_moe", "starcoder2"}
"""Families with LayerNorms."""
NORMS_LEFT_ALONE: set[str] = set()
"""Families whose RMSNorms with a weight lowp_ops.rms_norm does not compute as written (none now)."""
MLPS_LEFT_ALONE = {
    *("gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text"),
    *("apertus", "starcoder2"),
}
"""Families whose dense MLPs are not SwiGLU: GELU (Gemma, StarCoder 2), xIELU without a gate (Apertus)."""


@pytest.mark.parametrize("model_type", sorted(LM_HEAD_MODEL_TYPES))
def test_every_rms_norm_and_dense_mlp_is_patched(model_type):
    """Every RMSNorm and the language model's SwiGLU MLPs, but the families' listed in NORMS_LEFT_ALONE /
    MLPS_LEFT_ALONE (vision towers' MLPs are patched where their forward is a known one)."""
    model = apply_lowp_ops(tiny_model(model_type))
    norms = [  # weightless norms (Llama 4's, Gemma 4's) have nothing to patch
        m
        for m in model.modules()
        if type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
    assert norms or model_type in NO_RMS_NORMS
    assert all(("forward" in vars(m)) != (model_type in NORMS_LEFT_ALONE) for m in norms)
    assert all(m.forward.func is lowp_layers._rms_norm_forward for m in norms if "forward" in vars(m))
    dense = [
        m
        for name, m in model.named_modules()
        if type(m).__name__.endswith("MLP")
        and hasattr(m, "down_proj")
        and "vision" not in name
        and "visual" not in name
    ]
    assert all(("forward" in vars(m)) != (model_type in MLPS_LEFT_ALONE) for m in dense)
    assert all(m.forward.func is lowp_layers._dense_swiglu_forward for m in dense if "forward" in vars(m))
    if model_type in ("llama", "phi3", "qwen2_moe", "deepseek_v3", "gemma", "granite", "cohere", "glm4"):
        assert dense, "the dense or shared-expert MLPs were not found"
    untouched = apply_lowp_ops(tiny_model(model_type), rms_norm=False, mlp=False)
    assert not any("forward" in vars(m) for m in untouched.model.modules())


def test_norms_and_mlps_with_other_forwards_are_left_alone():
    """The module's code decides, not its name or attributes: a Llama norm or MLP whose class's forward
    adds a step (a dropout after the MLP, as Seed-OSS's; a rescaled norm) runs that forward."""
    model = tiny_model("llama")
    layer = model.model.layers[0]
    mlp_class, norm_class = type(layer.mlp), type(layer.input_layernorm)

    class DropoutMLP(mlp_class):
        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return torch.nn.functional.dropout(down_proj, p=0.5, training=self.training)

    class ScaledRMSNorm(norm_class):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    layer.mlp.__class__, layer.input_layernorm.__class__ = DropoutMLP, ScaledRMSNorm
    apply_lowp_ops(model)
    assert "forward" not in vars(layer.mlp) and "forward" not in vars(layer.input_layernorm)
    assert "forward" in vars(layer.post_attention_layernorm) and "forward" in vars(model.model.layers[1].mlp)


def test_forwards_without_readable_source_match_nothing():
    """A forward whose statements cannot be read (a builtin, a lambda) is no known form: fail closed."""

    class LambdaForward(torch.nn.Module):
        forward = lambda self, x: x

    assert lowp_forms.forward_statements(LambdaForward) is None
    assert lowp_forms._forward_statements(len) is None
    assert lowp_forms.norm_form(LambdaForward) is None
    linear = lowp_forms.forward_statements(torch.nn.Linear)
    assert linear == ("return F.linear(input, self.weight, self.bias)",)


@pytest.mark.parametrize("model_type", sorted(LM_HEAD_MODEL_TYPES))
def test_bf16_norms_round_as_the_models_own(model_type):
    """Each patched norm against its class's forward in bf16: equal, or one ulp off where the fp32 sum
    of squares rounds differently. A wrong rounding order (weight product in bf16 or in fp32) would make
    about a quarter of the elements differ."""
    model = apply_lowp_ops(tiny_model(model_type, torch.bfloat16))
    gen = torch.Generator().manual_seed(1)
    for module in lowp_layers._rms_norm_modules(model):
        with torch.no_grad():
            module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=gen))
        x = (torch.randn(64, module.weight.shape[0], generator=gen) * 3).bfloat16()
        got, want = module(x), type(module).forward(module, x)
        assert got.dtype == want.dtype
        ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2**-126))) - 7)
        assert ((got.float() - want.float()).abs() <= ulp).all()
        assert (got != want).float().mean() <= 0.02


def test_patched_llama_saves_less_for_the_backward():
    """Per layer, transformers' RMSNorm saves the fp32 input and normalized rows and its MLP saves gate,
    silu(gate), up and their product; lowp saves the bf16 input and fp32 1/rms per row, and [gate | up]."""
    config = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2}
    ids, labels = batch(length=32)
    stock = saved_bytes(tiny_model("llama", torch.bfloat16, **config), ids, labels)
    loss_only = saved_bytes(
        apply_lowp_ops(tiny_model("llama", torch.bfloat16, **config), rms_norm=False, mlp=False), ids, labels
    )
    patched = saved_bytes(apply_lowp_ops(tiny_model("llama", torch.bfloat16, **config)), ids, labels)
    tokens, layers = ids.numel(), config["num_hidden_layers"]
    # per norm: 4 bytes (fp32 x) + 2 (bf16 normalized) - 2 (bf16 x) per element; 5 norms
    norm_saving = 5 * tokens * config["hidden_size"] * 4
    # per MLP: two (tokens, intermediate) bf16 tensors fewer (silu(gate), and the product down_proj keeps)
    mlp_saving = layers * tokens * config["intermediate_size"] * 2 * 2
    assert loss_only - patched >= 0.9 * (norm_saving + mlp_saving), (stock, loss_only, patched)


def test_patched_gemma_norms_save_less_for_the_backward():
    """Gemma's ``1 + weight`` norm, differentiated by autograd, keeps the fp32 input and the fp32
    normalized rows (8 bytes per element); lowp keeps the bf16 input and the fp32 1/rms per row: 6 bytes
    fewer per element in each of Gemma 2's nine hidden-size norms (4 a layer, the final one)."""
    config = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2}
    ids, labels = batch(length=32)
    without = apply_lowp_ops(tiny_model("gemma2", torch.bfloat16, **config), rms_norm=False)
    patched = apply_lowp_ops(tiny_model("gemma2", torch.bfloat16, **config))
    saving = saved_bytes(without, ids, labels) - saved_bytes(patched, ids, labels)
    assert saving >= 0.9 * 9 * ids.numel() * config["hidden_size"] * 6, saving


def test_recomputed_activation_gives_the_gradients_of_the_plain_path():
    """The MLP whose down projection recomputes swiglu(c) in the backward, against the same MLP through
    ``down_proj``'s own call (a forward hook makes the patch take that path): equal bits."""
    model = apply_lowp_ops(tiny_model("llama", torch.bfloat16))
    plain = copy.deepcopy(model)
    for layer in plain.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda module, args, out: None)
    ids, labels = batch()
    want_loss, want = loss_and_grads(plain, ids, labels)
    got_loss, got = loss_and_grads(model, ids, labels)
    assert torch.equal(got_loss, want_loss)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


def test_compiled_mlp_saves_gate_and_up_not_the_activation():
    """Traced by Dynamo and split by the min-cut partitioner (Inductor's), the dense MLP's down
    projection still saves [gate | up] and the weight, not the (tokens, F) activation."""
    c = torch.randn(64, 96, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(32, 48, dtype=torch.bfloat16, requires_grad=True)
    saved = shapes_saved_by_compiled_forward(lowp_layers.SwiGLUThenLinear.apply, c, weight)
    assert (64, 48) not in saved and (64, 96) in saved, saved


def test_loss_chunks_bound_the_logits(monkeypatch):
    """More tokens than the hidden size: chunks of at most LOSS_CHUNK_LOGITS logits, but at least
    MIN_LOSS_CHUNK_TOKENS tokens within MAX_LOSS_CHUNK_LOGITS (at least 256 tokens); at most H tokens: no
    chunk size (the unchunked in-gradient schedule); a given chunk_size wins."""
    seen = []

    @functools.wraps(lowp_ops.linear_cross_entropy)
    def spy(*args, **kwargs):
        seen.append(kwargs["chunk_size"])
        return lowp_ops.linear_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(lowp_head, "linear_cross_entropy", spy)
    monkeypatch.setattr(lowp_head, "LOSS_CHUNK_LOGITS", 2**10 * VOCAB)
    ids, labels = batch(rows=8, length=256)  # 2048 tokens, hidden 32
    apply_lowp_ops(tiny_model("llama"))(input_ids=ids, labels=labels)
    apply_lowp_ops(tiny_model("llama"))(input_ids=ids[:, :4], labels=labels[:, :4])  # 32 tokens
    apply_lowp_ops(tiny_model("llama"), chunk_size=512)(input_ids=ids, labels=labels)
    assert seen == [1024, None, 512]


@pytest.mark.parametrize(
    ("vocab", "hidden", "tokens", "chunk"),
    [
        (32000, 4096, 8192, 2048),  # 2^26 logits hold 2048 tokens
        (128256, 2048, 4096, 1024),  # 2^26 logits: 512 tokens; raised to 1024 (2^27 logits)
        (262144, 1152, 4096, 1024),  # 256 -> 1024 tokens, exactly 2^28 logits
        (400000, 1024, 4096, 512),  # 1024 tokens would pass 2^28 logits: 671 -> 512
        (2**21, 1024, 4096, 256),  # at least 256 tokens
        (262144, 8192, 4096, None),  # at most H tokens: the in-gradient schedule
    ],
)
def test_loss_chunk_size_weighs_memory_against_weight_gradient_passes(vocab, hidden, tokens, chunk):
    weight, states = torch.empty(vocab, hidden, device="meta"), torch.empty(tokens, hidden, device="meta")
    assert lowp_head.loss_chunk_size(states, weight) == chunk


def dtensor_inputs_run_the_modules_own_forward(rank, world, case, group):
    """(run_checks worker) The patched norm and MLP with replicated DTensor parameters and input (as under
    tensor parallelism): the module's own result."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = apply_lowp_ops(tiny_model("llama"))
    layer = distribute_module(model.model.layers[0], mesh)
    x = distribute_tensor(torch.randn(2, 5, 32), mesh, [Replicate()])
    for module in (layer.input_layernorm, layer.mlp):
        got, want = module(x), type(module).forward(module, x)
        assert isinstance(got, DTensor) and torch.equal(got.to_local(), want.to_local())


def test_dtensor_inputs_run_the_modules_own_forward(tmp_path):
    import process_groups

    results = process_groups.run_checks(
        1, str(tmp_path), "test_integrations_transformers", "dtensor_inputs_run_the_modules_own_forward", [0]
    )
    process_groups.assert_all_passed(results, [0])
