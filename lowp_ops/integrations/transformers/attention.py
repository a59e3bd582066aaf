"""``softmax=True``: transformers' eager attention with its probabilities from :func:`lowp_ops.softmax`."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ... import softmax as lowp_softmax
from .forms import PLAIN_EAGER_ATTENTION, _forward_statements

ATTENTION_NAME = "lowp_eager"


def _select_lowp_attention(model: nn.Module) -> None:
    """Registers ``"lowp_eager"`` (attention function and eager's additive mask) and selects it."""
    AttentionInterface.register(ATTENTION_NAME, lowp_eager_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation(ATTENTION_NAME)


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
