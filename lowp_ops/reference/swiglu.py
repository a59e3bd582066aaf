"""SwiGLU times router probabilities, and its fused backward (dGLU) for grouped MoE experts, in fp32
(docs/grouped_mlp.md).

With ``(a, b)`` the gate and linear halves of the FC1 output ``c`` (TE's order: the nonlinearity is on
the first half), ``s = sigmoid(a)``, ``u = a s b``:

- forward ``h = u * p`` rounded once to c's dtype;
- backward from ``g = dL/dh``: ``dp = Σ_f g u`` in fp32 (never rounded to bf16),
  ``d1 = g p b s (1 + a (1 - s))``, ``d2 = g p a s``; ``dc`` = their rounding to c's dtype, in c's
  layout; per expert, ``amax = max(|d1|, |d2|)`` over exactly the fp32 values rounded into ``dc`` (0 for
  an empty expert), so ``round(amax) == max |dc|`` exactly (RNE is monotone). Rows past
  ``sum(split_sizes)`` belong to no expert (a total below the row count is allowed): their ``dc`` and
  ``dprobs`` are 0 whatever ``g``, ``c`` and ``p`` hold there (the grouped MLP's backward leaves those
  rows of ``g`` unwritten). The experts' rows are the effective boundaries of ``meta.split_sizes`` (the
  identity for sizes >= 0 summing to at most the rows; CPU raises for others unless the checks are
  off). Split sizes stay on the device: no host sync.

Every product is evaluated left to right exactly as written here, with ``sigmoid(x) = 1 / (1 +
exp(-x))``; the Triton kernels (``lowp_ops.kernels.swiglu``) follow the same fp32 steps.
"""

from __future__ import annotations

import torch

from ..meta.split_sizes import expert_of_rows
from ..meta.swiglu import dglu_outputs, swiglu_fwd_output


def split_glu(c: torch.Tensor, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (gate, linear) halves of ``c`` (tokens, 2F): concatenated or in alternating blocks."""
    tokens, width = c.shape
    if interleave == 0:
        gate, linear = c.float().chunk(2, dim=1)
        return gate, linear
    blocks = c.float().view(tokens, width // (2 * interleave), 2, interleave)
    return blocks[:, :, 0].reshape(tokens, width // 2), blocks[:, :, 1].reshape(tokens, width // 2)


def join_glu(gate: torch.Tensor, linear: torch.Tensor, interleave: int) -> torch.Tensor:
    """Inverse of :func:`split_glu`."""
    if interleave == 0:
        return torch.cat((gate, linear), dim=1)
    tokens, ffn = gate.shape
    blocks = torch.stack(
        (
            gate.view(tokens, ffn // interleave, interleave),
            linear.view(tokens, ffn // interleave, interleave),
        ),
        dim=2,
    )
    return blocks.view(tokens, 2 * ffn)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``1 / (1 + exp(-x))``, written out so that the Triton kernels can follow the same steps."""
    return 1.0 / (1.0 + torch.exp(-x))


def swiglu_fwd(
    c: torch.Tensor, probs: torch.Tensor, interleave: int, ends: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference of ``lowp::swiglu_fwd``: ``(a * sigmoid(a) * b * p)`` rounded once to c's dtype; with
    ``ends``, rows at or past ``ends[-1]`` (of no expert) are +0 whatever c and probs hold there."""
    out = swiglu_fwd_output(c, probs, interleave, ends)
    gate, linear = split_glu(c, interleave)
    h = gate * sigmoid(gate) * linear * probs.float().unsqueeze(1)
    if ends is not None:
        rows = torch.arange(c.shape[0], device=c.device)
        h = torch.where((rows < ends[-1]).unsqueeze(1), h, 0.0)
    out.copy_(h)
    return out


def dglu(
    grad: torch.Tensor, c: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor, interleave: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``lowp::dglu``: ``(dc, dprobs fp32, per-expert amax fp32)``."""
    dc, dprobs, amax = dglu_outputs(grad, c, probs, split_sizes, interleave)
    experts = split_sizes.shape[0]
    expert = expert_of_rows(split_sizes, c.shape[0])
    alive = expert < experts
    live = alive.unsqueeze(1)
    # Rows of no expert: zero inputs, hence zero outputs (0 * garbage could be NaN).
    gate, linear = (torch.where(live, half, 0.0) for half in split_glu(c, interleave))
    g = torch.where(live, grad.float(), 0.0)
    probs = torch.where(alive, probs.float(), 0.0)
    sig = sigmoid(gate)
    swish = gate * sig
    dprobs.copy_((g * swish * linear).sum(dim=1))
    scaled = g * probs.unsqueeze(1)
    d_gate = scaled * linear * sig * (1.0 + gate * (1.0 - sig))
    d_linear = scaled * swish
    dc.copy_(join_glu(d_gate, d_linear, interleave))
    row_amax = (
        torch.maximum(d_gate.abs().amax(dim=1), d_linear.abs().amax(dim=1)) if g.shape[1] else dprobs * 0
    )
    per_expert = torch.zeros(experts + 1, dtype=torch.float32, device=c.device)
    per_expert.scatter_reduce_(0, expert, row_amax, reduce="amax")
    amax.copy_(per_expert[:experts])
    return dc, dprobs, amax
