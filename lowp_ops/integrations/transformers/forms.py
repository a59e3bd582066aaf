"""What a module's code computes, read from its source: the statements of a class's ``forward`` (and
``_norm``) as ``ast.unparse`` writes them, and the forms of RMSNorm, SwiGLU MLP and eager attention that
lowp_ops computes (docs/transformers.md, "What decides")."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass


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
