"""The tiny random transformers models (no downloads) of the transformers integration tests
(``test_transformers_*.py``): each family's config, text and image batches, the loss and gradients of a
training step and the comparison of two models' training signals (fp32 tolerance by family), and the
PEFT-like wrappers. Imported by the test modules after their ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import warnings

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

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
