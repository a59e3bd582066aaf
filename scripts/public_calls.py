"""A fixed set of small public calls covering every kernel family (quantizers, losses, softmax, RMSNorm,
the grouped MLP's three recipes, the LM head with both gradient formats), with their outputs and
gradients by name. Shared by ``compare_ptx.py`` (which records the Triton launches these calls make)
and ``compare_bytes.py`` (which compares their bytes between two trees on one device).

The calls use ``lowp_ops`` as imported: put the tree to run first on ``sys.path``.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


def run_public_calls(device: str) -> dict[str, torch.Tensor]:
    """Run the calls on ``device`` from fixed seeds: {name: tensor} of every output and gradient."""
    import lowp_ops

    results: dict[str, torch.Tensor] = {}

    def keep(name: str, value) -> None:
        for index, leaf in enumerate(tree_leaves(value)):
            if isinstance(leaf, torch.Tensor):
                results[f"{name} #{index}"] = leaf.detach().cpu()

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(64, 256, dtype=bf16).to(device)
    for layout in ("compact", "swizzled"):
        q = lowp_ops.mxfp8_quantize(x, scale_layout=layout)
        keep(f"mxfp8_quantize {layout}", q)
        keep(f"mxfp8_dequantize {layout}", lowp_ops.mxfp8_dequantize(q))
    logits = torch.randn(64, 300, dtype=bf16).to(device)
    target = torch.randint(0, 300, (64,)).to(device)
    for reduction in ("mean", "none"):
        leaf = logits.clone().requires_grad_()
        loss = lowp_ops.cross_entropy(leaf, target, reduction=reduction, label_smoothing=0.1)
        loss.sum().backward()
        keep(f"cross_entropy {reduction}", (loss, leaf.grad))
        grad_loss = torch.rand(64) if reduction == "none" else torch.tensor(1.0)
        keep(
            f"cross_entropy_with_mxfp8_grad {reduction}",
            lowp_ops.cross_entropy_with_mxfp8_grad(logits, target, grad_loss.to(device), reduction=reduction),
        )
    for function in (lowp_ops.softmax, lowp_ops.log_softmax):
        leaf = x.clone().requires_grad_()
        out = function(leaf, -1)
        out.float().sum().backward()
        keep(function.__name__, (out, leaf.grad))
    keep("logsumexp", lowp_ops.logsumexp(x.float(), -1))
    for weight_dtype in (bf16, torch.float32):  # fp32: Gemma's 1 + weight
        for round_normalized in (True, False):
            leaf = x.clone().requires_grad_()
            weight = torch.rand(256, dtype=weight_dtype).to(device).requires_grad_()
            out = lowp_ops.rms_norm(leaf, weight, round_normalized=round_normalized)
            out.float().sum().backward()
            keep(f"rms_norm {weight_dtype} {round_normalized}", (out, leaf.grad, weight.grad))
    given = x.abs().amax().float().reshape(1)
    keep(
        "nvfp4_quantize given amax",
        lowp_ops.nvfp4_quantize(x, columnwise=True, rht=True, amax_rowwise=given, amax_columnwise=given),
    )
    q4 = lowp_ops.nvfp4_quantize(
        x, columnwise=True, rht=True, stochastic_rounding=True, sr_seed=torch.tensor([1, 2]).to(device)
    )
    keep("nvfp4_quantize SR", q4)
    keep("nvfp4_dequantize", lowp_ops.nvfp4_dequantize(q4))
    splits = torch.tensor([16, 0, 32, 16]).to(device)
    keep("nvfp4_group_quantize", lowp_ops.nvfp4_group_quantize(x, splits, columnwise=True, rht=True))
    tokens, hidden, ffn, experts = 64, 64, 32, 4
    for recipe in ("bf16", "mxfp8", "nvfp4"):
        xt = torch.randn(tokens, hidden, dtype=bf16).to(device).requires_grad_()
        w1 = (torch.randn(experts, 2 * ffn, hidden) * 0.1).to(bf16).to(device).requires_grad_()
        w2 = (torch.randn(experts, hidden, ffn) * 0.1).to(bf16).to(device).requires_grad_()
        probs = torch.rand(tokens).to(device).requires_grad_()
        sizes = [32, 0, 32, 0] if recipe == "mxfp8" else [16, 0, 32, 16]
        y = lowp_ops.grouped_swiglu_mlp(xt, w1, w2, torch.tensor(sizes).to(device), probs, recipe=recipe)
        y.float().sum().backward()
        keep(f"grouped_swiglu_mlp {recipe}", (y, xt.grad, w1.grad, w2.grad, probs.grad))
    head = (torch.randn(300, 64) * 0.1).to(bf16).to(device).requires_grad_()
    hidden_states = torch.randn(64, 64, dtype=bf16).to(device).requires_grad_()
    for grad_format in (None, "mxfp8_e4m3"):
        head.grad = hidden_states.grad = None
        # The MXFP8 logits gradient feeds the MXFP8 GEMM kernels (dgrad and wgrad).
        loss = lowp_ops.linear_cross_entropy(hidden_states, head, target, grad_format=grad_format)
        loss.backward()
        keep(f"linear_cross_entropy {grad_format}", (loss, hidden_states.grad, head.grad))
    return results
