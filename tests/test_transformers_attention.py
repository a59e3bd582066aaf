"""``apply_lowp_ops(softmax=True)`` on tiny random transformers models (no downloads): eager attention's
softmax through lowp_ops.softmax with the loss and gradients of the model's own (left padding
included), one call per attention layer; other eager attentions and multimodal models refused, SDPA
left alone."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip(
    "transformers", minversion="5", reason="needs transformers>=5,<6 (pip install 'lowp_ops[transformers]')"
)
from transformers_models import (
    COMMON,
    TEXT_MODEL_TYPE,
    VISION_LANGUAGE,
    assert_same_training_signal,
    batch,
    fp32_rtol,
    tiny_model,
)

import lowp_ops
from lowp_ops.integrations.transformers import LM_HEAD_MODEL_TYPES, apply_lowp_ops
from lowp_ops.integrations.transformers import attention as lowp_attention

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
