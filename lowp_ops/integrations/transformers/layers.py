"""The patched RMSNorms and dense SwiGLU MLPs (their forwards recognized by :mod:`.forms`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ... import library
from ... import rms_norm as lowp_rms_norm
from ... import swiglu as lowp_swiglu
from ...meta.rms_norm import MAX_HIDDEN
from .forms import SWIGLU_FORWARDS, forward_statements, norm_form

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = ()


def _silu_classes() -> tuple[type, ...]:
    from transformers import activations

    return tuple(cls for cls in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if cls is not None)


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
