"""``apply_lowp_ops``'s RMSNorms and dense SwiGLU MLPs on tiny random transformers models (no
downloads): every one patched (the forms the module's code matches, others left alone), bf16 norms
rounded as the model's own, less saved for the backward (eager and compiled), the recomputed
activation's gradients equal to the plain path's, the loss chunk sizes, DTensor inputs."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip(
    "transformers", minversion="5", reason="needs transformers>=5,<6 (pip install 'lowp_ops[transformers]')"
)
from partition_checks import shapes_saved_by_compiled_forward
from torch._dynamo.utils import counters
from transformers_models import VOCAB, batch, loss_and_grads, tiny_model

import lowp_ops
from lowp_ops.integrations.transformers import LM_HEAD_MODEL_TYPES, apply_lowp_ops
from lowp_ops.integrations.transformers import forms as lowp_forms
from lowp_ops.integrations.transformers import head as lowp_head
from lowp_ops.integrations.transformers import layers as lowp_layers
from lowp_ops.integrations.transformers.binding import bound_function


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
    patched_norms = [m for m in norms if "forward" in vars(m)]
    assert all(bound_function(m.forward) is lowp_layers._rms_norm_forward for m in patched_norms)
    dense = [
        m
        for name, m in model.named_modules()
        if type(m).__name__.endswith("MLP")
        and hasattr(m, "down_proj")
        and "vision" not in name
        and "visual" not in name
    ]
    assert all(("forward" in vars(m)) != (model_type in MLPS_LEFT_ALONE) for m in dense)
    patched_mlps = [m for m in dense if "forward" in vars(m)]
    assert all(bound_function(m.forward) is lowp_layers._dense_swiglu_forward for m in patched_mlps)
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
    MIN_LOSS_CHUNK_TOKENS tokens within linear_cross_entropy's default chunk (at least 256 tokens); at
    most H tokens: no chunk size (the unchunked in-gradient schedule); a given chunk_size wins."""
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
        1, str(tmp_path), "test_transformers_layers", "dtensor_inputs_run_the_modules_own_forward", [0]
    )
    process_groups.assert_all_passed(results, [0])


@pytest.mark.parametrize(
    ("model_type", "options"), [("llama", {"rms_norm": True}), ("qwen3_moe", {"experts": "bf16"})]
)
def test_regional_compilation_is_one_graph_for_every_layer(model_type, options):
    """``layer.compile()`` on every decoder layer (transformers' regional compilation): the layers share
    one graph. Patched forwards stored as ``functools.partial`` were guarded by identity, one graph per
    layer, and past Dynamo's recompile limit (8) the remaining layers ran uncompiled."""
    dtype = torch.bfloat16 if "experts" in options else torch.float32
    ref = tiny_model(model_type, dtype=dtype, num_hidden_layers=4)
    eager = apply_lowp_ops(copy.deepcopy(ref), **options)
    model = apply_lowp_ops(copy.deepcopy(ref), **options)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    ids, labels = batch()
    counters.clear()
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["frames"]["total"] == 1 and not counters["graph_break"]
    want = eager(input_ids=ids, labels=labels, use_cache=False).loss
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)


def test_a_second_patched_model_reuses_the_compiled_graph():
    """Two patched models of one class, each compiled whole: the second runs the first one's graph (as
    unpatched models do), not a recompilation keyed to its own forwards."""
    ids, labels = batch()
    counters.clear()
    losses = []
    for seed in (0, 1):
        model = apply_lowp_ops(tiny_model("llama", seed=seed))
        model.compile(backend="aot_eager")
        losses.append(model(input_ids=ids, labels=labels, use_cache=False).loss)
        eager = apply_lowp_ops(tiny_model("llama", seed=seed))
        want = eager(input_ids=ids, labels=labels, use_cache=False).loss
        torch.testing.assert_close(losses[-1], want, rtol=1e-6, atol=0)
    assert counters["stats"]["unique_graphs"] == 1
    assert not torch.equal(losses[0], losses[1])
