"""``apply_lowp_ops(experts=...)`` on tiny random MoE transformers models (no downloads): bf16 experts'
loss and gradients within bf16 tolerance of the model's own, the padded expert layout equal to each
expert run alone (bit for bit, every recipe), every family's experts against their class's forward,
the expert weights left the model's parameters, unsupported experts refused; on the GPU no host sync."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip(
    "transformers", minversion="5", reason="needs transformers>=5,<6 (pip install 'lowp_ops[transformers]')"
)
from transformers_models import (
    ALL_MOE_TYPES,
    MOE_TYPES,
    VOCAB,
    assert_same_training_signal,
    batch,
    loss_and_grads,
    tiny_model,
)

import lowp_ops
from lowp_ops.integrations.transformers import apply_lowp_ops
from lowp_ops.integrations.transformers import experts as lowp_experts


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


def test_nvfp4_experts_need_a_hidden_size_that_is_a_multiple_of_16():
    """The NVFP4 recipe's 16x16 weight blocks: hidden 24 is refused before anything is patched (bf16
    takes it)."""
    model = tiny_model("qwen3_moe", torch.bfloat16, hidden_size=24)
    with pytest.raises(NotImplementedError, match=r"hidden of 16 for recipe='nvfp4'\), got hidden=24"):
        apply_lowp_ops(model, experts="nvfp4")
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)
    apply_lowp_ops(model, experts="bf16")


def test_experts_on_a_dense_model_are_refused():
    with pytest.raises(ValueError, match="no fused MoE experts"):
        apply_lowp_ops(tiny_model("llama", torch.bfloat16), experts="bf16")


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
