"""Grouped SwiGLU MLP of MoE experts: float64 oracle per recipe, probability gradient dtype contract,
the grouped GEMM, opcheck, and compile without recompiles when split sizes (data) or token counts change.

CPU tests run the references; ``interp`` runs the Triton SwiGLU/dGLU/MXFP8 kernels in the MLP; ``gpu``
runs ``torch._grouped_mm`` and the kernels on CUDA.
"""

from __future__ import annotations

import itertools
import weakref

import nvfp4_oracles
import pytest
import torch
from cudagraph_checks import same_bits, warm_up
from hypothesis import given
from hypothesis import strategies as st
from partition_checks import lowp_ops_in_compiled_graphs, shapes_saved_by_compiled_forward

import lowp_ops
from lowp_ops import library
from lowp_ops.composite import grouped_linear, grouped_nvfp4
from lowp_ops.reference import grouped_mm as grouped_mm_ref
from lowp_ops.reference import nvfp4 as nvfp4_ref

TE_TOLERANCES = {"bf16": (0.125, 0.25), "mxfp8": (0.125, 0.25), "nvfp4": (0.25, 0.5)}  # (rtol, atol)
# Relative Frobenius error against float64 (ours, tighter than TE's elementwise bounds).
NORM_TOLERANCES = {"bf16": 0.02, "mxfp8": 0.08, "nvfp4": 0.35}
RECIPES = ["bf16", "mxfp8", "nvfp4"]


def make_inputs(split_sizes, hidden, ffn, seed, device="cpu", probs_dtype=torch.float32):
    """TE's test data: x, dy and weights ~ U(-0.25, 0.25), probs ~ U(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, experts = sum(split_sizes), len(split_sizes)

    def uniform(*shape):
        return ((torch.rand(*shape, generator=gen) - 0.5) * 0.5).bfloat16().to(device)

    return {
        "x": uniform(tokens, hidden),
        "fc1_weight": uniform(experts, 2 * ffn, hidden),
        "fc2_weight": uniform(experts, hidden, ffn),
        "split_sizes": torch.tensor(split_sizes, device=device),
        "probs": torch.rand(tokens, generator=gen).to(probs_dtype).to(device),
        "dy": uniform(tokens, hidden),
    }


def float64_mlp(inputs, interleave: int = 0):
    """(y, dx, dW1, dW2, dprobs) in float64 by autograd, one expert at a time (docs/grouped_mlp.md#math)."""
    x, w1, w2, probs = (
        inputs[name].double().cpu().requires_grad_() for name in ("x", "fc1_weight", "fc2_weight", "probs")
    )
    outputs, start = [], 0
    for expert, size in enumerate(inputs["split_sizes"].tolist()):
        c = x[start : start + size] @ w1[expert].t()
        if interleave:
            blocks = c.view(size, -1, 2, interleave)
            gate, linear = blocks[:, :, 0].reshape(size, -1), blocks[:, :, 1].reshape(size, -1)
        else:
            gate, linear = c.chunk(2, dim=1)
        h = torch.nn.functional.silu(gate) * linear * probs[start : start + size, None]
        outputs.append(h @ w2[expert].t())
        start += size
    y = torch.cat(outputs)
    y.backward(inputs["dy"].double().cpu())
    return y.detach(), x.grad, w1.grad, w2.grad, probs.grad


def run_mlp(inputs, recipe, **kwargs):
    """(y, dx, dW1, dW2, dprobs) of lowp_ops.grouped_swiglu_mlp."""
    leaves = {
        name: inputs[name].detach().clone().requires_grad_()
        for name in ("x", "fc1_weight", "fc2_weight", "probs")
    }
    y = lowp_ops.grouped_swiglu_mlp(
        leaves["x"],
        leaves["fc1_weight"],
        leaves["fc2_weight"],
        inputs["split_sizes"],
        leaves["probs"],
        recipe=recipe,
        **kwargs,
    )
    y.backward(inputs["dy"])
    return y.detach(), *(leaves[name].grad for name in ("x", "fc1_weight", "fc2_weight", "probs"))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    return ((got.double().cpu() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_matches_float64(got, expected, recipe: str) -> None:
    rtol, atol = TE_TOLERANCES[recipe]
    for name, g, e in zip(("y", "dx", "dW1", "dW2", "dprobs"), got, expected, strict=True):
        torch.testing.assert_close(
            g.double().cpu(), e, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )
        assert relative_error(g, e) < NORM_TOLERANCES[recipe], (name, relative_error(g, e))


# ------------------------------------------------------------------------------------ float64 oracle


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("hidden", [128, 256])
def test_mlp_matches_float64_with_an_empty_expert(recipe, hidden):
    """TE's test_grouped_mlp structure (E=4, splits {0, 1, 2, 3} x 256 shuffled, F = H) at 1/4 the tokens."""
    inputs = make_inputs([64, 0, 192, 128], hidden, hidden, seed=hidden)
    got = run_mlp(inputs, recipe)
    assert_matches_float64(got, float64_mlp(inputs), recipe)
    assert not got[2][1].any() and not got[3][1].any(), "an empty expert gets zero weight gradients"


@pytest.mark.parametrize("recipe", RECIPES)
def test_interleaved_gate_layout_is_the_concatenated_one_permuted(recipe):
    inputs = make_inputs([64, 0, 32, 96], 64, 64, seed=1)
    ffn = 64
    # Row j of the interleaved FC1 weight: block j // 64, half (j % 64) // 32, channel j % 32.
    perm = torch.arange(2 * ffn).view(2, ffn // 32, 32).transpose(0, 1).reshape(-1)
    interleaved = dict(inputs, fc1_weight=inputs["fc1_weight"][:, perm])
    got = run_mlp(interleaved, recipe, glu_interleave_size=32)
    expected = run_mlp(inputs, recipe)
    for index, name in ((0, "y"), (2, "dW1"), (3, "dW2"), (4, "dprobs")):
        expected_value = expected[index][:, perm] if name == "dW1" else expected[index]
        assert torch.equal(got[index], expected_value), name
    # dx sums over the 2F channels in another order.
    torch.testing.assert_close(got[1], expected[1], rtol=2**-7, atol=1e-6)


@given(
    splits=st.lists(st.sampled_from([0, 0, 1, 3, 8, 13, 32]), min_size=1, max_size=5),
    probs_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**20),
)
def test_bf16_mlp_over_random_splits_matches_float64(splits, probs_dtype, seed):
    inputs = make_inputs(splits, 32, 16, seed, probs_dtype=probs_dtype)
    got = run_mlp(inputs, "bf16")
    expected = float64_mlp(inputs)
    assert got[4].dtype == probs_dtype
    for name, g, e in zip(("y", "dx", "dW1", "dW2", "dprobs"), got, expected, strict=True):
        torch.testing.assert_close(g.double(), e, rtol=0.02, atol=0.02, msg=lambda m, n=name: f"{n}: {m}")


# -------------------------------------------------------------------------------- probability gradient


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2**-126))) - 7)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp32_probs_get_an_fp32_gradient_never_rounded_to_bf16(recipe):
    """The op's dprobs against float64 sum(dh * silu(gate) * linear) from the same bf16 dh and c: far
    below a bf16 ulp."""
    inputs = make_inputs([32, 0, 64], 64, 32, seed=2)
    x, w1, w2, splits, dy = (inputs[k] for k in ("x", "fc1_weight", "fc2_weight", "split_sizes", "dy"))
    probs = inputs["probs"].clone().requires_grad_()
    y, c, _ = torch.ops.lowp.grouped_swiglu_mlp(x, w1, w2, probs, splits, recipe, 0, False)
    y.backward(dy)
    h = torch.ops.lowp.swiglu_fwd(c, grouped_linear.fc1_probs(probs.detach(), recipe), 0)
    dh = grouped_linear.linear_backward(dy, h, w2, splits, recipe)[0]  # the FC2 dgrad the op runs
    gate, linear = c.double().chunk(2, dim=1)
    expected = (dh.double() * torch.nn.functional.silu(gate) * linear).sum(dim=1)
    assert probs.grad.dtype == torch.float32
    assert ((probs.grad.double() - expected).abs() < 0.01 * bf16_ulp(expected) + 1e-12).all()


def grad_leaves(inputs) -> tuple[torch.Tensor, ...]:
    """Fresh leaves (x, fc1_weight, fc2_weight, probs) that require gradients."""
    return tuple(inputs[k].clone().requires_grad_() for k in ("x", "fc1_weight", "fc2_weight", "probs"))


def saved_shapes(function, *args) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves for the backward while ``function(*args)`` runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        function(*args)
    return shapes


@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_keeps_c_and_recomputes_h(recipe):
    """Under saved-tensor hooks (checkpointing, offload) the op saves both weights, probs, split sizes, the
    forward's (2, E) group ends (nvfp4: its plan), x and c (T, 2F), never h (T, F); without hooks it
    keeps x and c itself and frees them as it goes (test below). The gradients are those of FC1, SwiGLU
    and FC2 as three autograd nodes (h saved), bit for bit. The probabilities are bf16 values, so
    mxfp8's rounding of them in the forward changes nothing."""
    inputs = make_inputs([32, 0, 64], 64, 48, seed=4)
    inputs["probs"] = inputs["probs"].bfloat16().float()
    shapes = saved_shapes(run_mlp, inputs, recipe)
    ends = (2, 3)
    assert sorted(shapes) == sorted([(3,), ends, (3, 64, 48), (3, 96, 64), (96,), (96, 64), (96, 96)]), shapes
    got = run_mlp(inputs, recipe)
    x, w1, w2, probs = grad_leaves(inputs)
    splits = inputs["split_sizes"]
    c = torch.ops.lowp.grouped_linear(x, w1, splits, recipe)
    h = lowp_ops.swiglu(c, probs)
    y = torch.ops.lowp.grouped_linear(h, w2, splits, recipe)
    y.backward(inputs["dy"])
    expected = (y.detach(), x.grad, w1.grad, w2.grad, probs.grad)
    for name, g, e in zip(("y", "dx", "dW1", "dW2", "dprobs"), got, expected, strict=True):
        assert torch.equal(g, e), name


@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_frees_each_activation_after_its_last_use(monkeypatch, recipe):
    """At each grouped GEMM of the backward (FC2 wgrad, FC2 dgrad, FC1 wgrad, FC1 dgrad): c is gone once
    the dGLU has run, x (a non-leaf, as a MoE layer's gathered tokens) once FC1's weight gradient no
    longer needs it (mxfp8 / nvfp4: once its column-wise copy exists)."""
    inputs = make_inputs([32, 0, 64], 64, 48, seed=4)
    leaf, w1, w2, probs = grad_leaves(inputs)
    x = leaf * 1
    y, c, _ = torch.ops.lowp.grouped_swiglu_mlp(x, w1, w2, probs, inputs["split_sizes"], recipe, 0, False)
    x_alive, c_alive = weakref.ref(x), weakref.ref(c)
    del x, c
    seen = []
    grouped_mm = library.grouped_mm

    def spy(*args):
        seen.append((c_alive() is not None, x_alive() is not None))
        return grouped_mm(*args)

    monkeypatch.setattr(library, "grouped_mm", spy)
    y.backward(inputs["dy"])
    x_at_fc1_wgrad = recipe == "bf16"
    assert seen == [(True, True), (True, True), (False, x_at_fc1_wgrad), (False, False)]
    assert leaf.grad is not None


def test_activation_checkpointing_gives_the_same_gradients():
    """Non-reentrant checkpointing (saved-tensor hooks: x and c go through them) around the MLP: the
    gradients of the plain call, bit for bit."""
    inputs = make_inputs([32, 0, 64], 64, 48, seed=8)
    splits = inputs["split_sizes"]

    def grads(checkpointed: bool):
        x, w1, w2, probs = grad_leaves(inputs)

        def mlp(a):
            return lowp_ops.grouped_swiglu_mlp(a * 1, w1, w2, splits, probs)

        y = torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False) if checkpointed else mlp(x)
        y.backward(inputs["dy"])
        return y.detach(), x.grad, w1.grad, w2.grad, probs.grad

    for got, expected in zip(grads(True), grads(False), strict=True):
        assert torch.equal(got, expected)


def test_second_backward_and_modified_activations_raise():
    inputs = make_inputs([16, 16], 32, 16, seed=6)
    x, w1, w2, probs = grad_leaves(inputs)
    y, c, _ = torch.ops.lowp.grouped_swiglu_mlp(x, w1, w2, probs, inputs["split_sizes"], "bf16", 0, False)
    y.backward(inputs["dy"], retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran already"):
        y.backward(inputs["dy"])
    y, c, _ = torch.ops.lowp.grouped_swiglu_mlp(x, w1, w2, probs, inputs["split_sizes"], "bf16", 0, False)
    c.mul_(2)
    with pytest.raises(RuntimeError, match="x or its output c was modified in place"):
        y.backward(inputs["dy"])
    y, *_ = torch.ops.lowp.grouped_swiglu_mlp(x, w1, w2, probs, inputs["split_sizes"], "bf16", 0, False)
    with torch.no_grad():
        x.mul_(2)
    with pytest.raises(RuntimeError, match="x or its output c was modified in place"):
        y.backward(inputs["dy"])


def test_compiled_mlp_saves_c_not_h():
    """Traced by Dynamo and split by Inductor's min-cut partitioner, the forward graph still saves c,
    not h (the backward formula's recomputation stays in the backward graph)."""
    inputs = make_inputs([32, 0, 64], 64, 48, seed=4)
    x, w1, w2, probs = grad_leaves(inputs)
    saved = shapes_saved_by_compiled_forward(
        lowp_ops.grouped_swiglu_mlp, x, w1, w2, inputs["split_sizes"], probs
    )
    assert (96, 96) in saved and (96, 48) not in saved, saved


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_probs_get_the_single_rounding_of_the_fp32_gradient(recipe):
    inputs = make_inputs([32, 16, 0], 64, 32, seed=3, probs_dtype=torch.bfloat16)
    got16 = run_mlp(inputs, recipe)
    got32 = run_mlp(dict(inputs, probs=inputs["probs"].float()), recipe)
    assert got16[4].dtype == torch.bfloat16
    if recipe != "mxfp8":  # mxfp8 rounds fp32 probs to bf16 in its forward (docs/grouped_mlp.md): same values
        assert torch.equal(got16[0], got32[0])
    assert torch.equal(got16[4], got32[4].bfloat16())


# ---------------------------------------------------------------------- NVFP4 amaxes from the dGLU (seed 001)


def test_fc1_dy_amax_from_dglu_changes_only_the_fc1_weight_gradient():
    """y, dx, dW2 and dprobs are bit-identical with the flag on; the FC1 wgrad error against float64
    stays within 5% of the default path's."""
    inputs = make_inputs([64, 0, 192, 128], 128, 128, seed=7)
    off = run_mlp(inputs, "nvfp4")
    on = run_mlp(inputs, "nvfp4", fc1_dy_amax_from_dglu=True)
    for index, name in ((0, "y"), (1, "dx"), (3, "dW2"), (4, "dprobs")):
        assert torch.equal(on[index], off[index]), name
    expected_dw1 = float64_mlp(inputs)[2]
    assert relative_error(on[2], expected_dw1) <= 1.05 * relative_error(off[2], expected_dw1)


def test_dglu_amaxes_equal_the_fc1_gradient_amaxes_and_bound_the_rht_ones():
    split_sizes = torch.tensor([32, 0, 48, 16])
    gen = torch.Generator().manual_seed(8)
    c = (torch.randn(96, 128, generator=gen) * 2).bfloat16()
    grad = torch.randn(96, 64, generator=gen).bfloat16()
    probs = torch.rand(96, generator=gen)
    dc, _, dglu_amax = lowp_ops.dglu(grad, c, probs, split_sizes)
    amax_row, amax_col = grouped_nvfp4.grad_amaxes(dglu_amax)
    default_row_local, default_row = grouped_nvfp4.rowwise_operand(dc, split_sizes)
    _, default_col = grouped_nvfp4.columnwise_operand(dc, split_sizes)
    expected = torch.stack(
        [
            dc[s:e].float().abs().amax() if e > s else torch.tensor(0.0)
            for s, e in ((0, 32), (32, 32), (32, 80), (80, 96))
        ]
    )
    assert torch.equal(amax_row, expected) and torch.equal(default_row, expected)
    assert torch.equal(amax_col, 4 * amax_row)
    assert (default_col <= amax_col).all()
    # Same amax -> the same row-wise FP4 data and scales (here: their exact local values).
    assert torch.equal(grouped_nvfp4.rowwise_operand(dc, split_sizes, amax_row)[0], default_row_local)


def test_nvfp4_local_values_times_the_global_scale_are_the_reference_dequantization():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(32, 64, generator=gen).bfloat16()
    local, amax = grouped_nvfp4.rowwise_operand(x, torch.tensor([32]))
    q = nvfp4_ref.nvfp4_quantize(x, True, False, False, None, None, False)
    expected = nvfp4_ref.nvfp4_dequantize(q[0], q[1], q[4], torch.float32)
    torch.testing.assert_close(local.float() * (amax * (1 / 2688)), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("splits", [[32, 0, 48, 16], [0, 96, 0, 0], [16, 16, 32, 32]])
def test_nvfp4_operands_from_the_quantize_ops_equal_the_pure_pytorch_local_values(splits):
    """The recipe decodes the grouped / 16x16 quantize ops' codes and scales: those local values must be
    the pure-PyTorch block quantization's, bit for bit (row-wise, column-wise after the RHT, weights)."""
    split_sizes = torch.tensor(splits)
    gen = torch.Generator().manual_seed(10)
    t = (torch.randn(96, 48, generator=gen) * torch.logspace(-3, 3, 48)).bfloat16()
    local, amax = grouped_nvfp4.rowwise_operand(t, split_sizes)
    assert torch.equal(amax, nvfp4_oracles.per_expert_amax(t.abs().amax(dim=1), split_sizes, 96))
    token_amax = nvfp4_oracles.row_values(amax, split_sizes, 96)[:, None]
    assert torch.equal(local, nvfp4_oracles.local_values(t, token_amax))
    local, amax = grouped_nvfp4.columnwise_operand(t, split_sizes)
    transformed = nvfp4_ref.apply_rht(t.t().contiguous())
    block_amax = nvfp4_oracles.row_values(amax, split_sizes, 96)[::16][None, :]
    assert torch.equal(local, nvfp4_oracles.local_values(transformed, block_amax))
    expected_amax = nvfp4_oracles.per_expert_amax(transformed.abs().amax(dim=0), split_sizes, 96)
    assert torch.equal(amax, expected_amax)
    weight = torch.randn(3, 32, 48, generator=gen).bfloat16()
    local, amax = grouped_nvfp4.weight_operand(weight)
    assert torch.equal(amax, weight.abs().amax(dim=(1, 2)).float())
    for e in range(3):
        assert torch.equal(local[e], nvfp4_oracles.local_values(weight[e], amax[e].reshape(1), block_2d=True))


# ------------------------------------------------------------------------------------------ grouped_mm


def test_grouped_mm_reference_loops_over_groups():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(20, 16, generator=gen).bfloat16()
    b = torch.randn(3, 16, 8, generator=gen).bfloat16()
    offs = torch.tensor([5, 5, 20], dtype=torch.int32)
    out = grouped_mm_ref.grouped_mm(a, b, offs)
    bounds = list(itertools.pairwise([0, 5, 5, 20]))
    for group, (start, end) in enumerate(bounds):
        assert torch.equal(out[start:end], (a[start:end].double() @ b[group].double()).bfloat16())
    wgrad = grouped_mm_ref.grouped_mm(a.t(), torch.randn(20, 8).bfloat16(), offs)
    assert wgrad.shape == (3, 16, 8) and not wgrad[1].any()


# ------------------------------------------------------------------------------------ traceability


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])  # nvfp4: the same ops, 20 s of reference math
def test_opcheck(recipe):
    inputs = make_inputs([16, 0, 16], 32, 32, seed=5)
    x, w1, w2, splits, probs = (inputs[k] for k in ("x", "fc1_weight", "fc2_weight", "split_sizes", "probs"))
    offs = torch.cumsum(splits, 0, dtype=torch.int32)
    if recipe == "bf16":
        torch.library.opcheck(torch.ops.lowp.grouped_mm.default, (x, w1.transpose(1, 2), offs))
        torch.library.opcheck(torch.ops.lowp.grouped_mm.default, (x.t(), x, offs))
    torch.library.opcheck(
        torch.ops.lowp.grouped_linear.default,
        (x.requires_grad_(), w2.transpose(1, 2).contiguous(), splits, recipe),
    )
    torch.library.opcheck(
        torch.ops.lowp.grouped_swiglu_mlp.default,
        (
            x.detach().requires_grad_(),
            w1.requires_grad_(),
            w2.requires_grad_(),
            probs.requires_grad_(),
            splits,
            recipe,
            32,
            False,
        ),
    )
    w = w2.detach().transpose(1, 2).contiguous()
    dy = torch.randn(x.shape[0], w.shape[1]).bfloat16()
    torch.library.opcheck(torch.ops.lowp.grouped_linear_bwd.default, (dy, x.detach(), w, splits, recipe))
    config = (recipe, 32, False)  # recipe, interleave, fc1_dy_amax_from_dglu
    y, c, ends = torch.ops.lowp.grouped_swiglu_mlp(x, w1, w2, probs, splits, *config)
    torch.library.opcheck(
        torch.ops.lowp.grouped_swiglu_mlp_bwd.default,
        (torch.randn_like(y), x.detach(), c, w1.detach(), w2.detach(), probs.detach(), splits, ends, *config),
    )


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
def test_compiled_backward_is_one_op_with_the_eager_bytes(recipe):
    """A compiled backward calls ``lowp::grouped_swiglu_mlp_bwd`` (``grouped_linear_bwd``) once, not its
    GEMM, quantize and GLU ops one by one, and gives the eager backward's gradients bit for bit."""
    inputs = make_inputs([16, 0, 32, 16], 32, 32, seed=7)
    splits, dy = inputs["split_sizes"], inputs["dy"]

    def grads(fn, *names):
        leaves = [inputs[name].detach().requires_grad_() for name in names]
        fn(*leaves).backward(dy)
        return [leaf.grad for leaf in leaves]

    def mlp(x, w1, w2, probs):
        return lowp_ops.grouped_swiglu_mlp(x, w1, w2, splits, probs, recipe=recipe)

    def linear(x, w):
        return torch.ops.lowp.grouped_linear(x, w, splits, recipe)

    for fn, names, ops in (
        (mlp, ("x", "fc1_weight", "fc2_weight", "probs"), ["grouped_swiglu_mlp", "grouped_swiglu_mlp_bwd"]),
        (linear, ("x", "fc2_weight"), ["grouped_linear", "grouped_linear_bwd"]),  # (E, 32, 32)
    ):
        compiled, graphs = lowp_ops_in_compiled_graphs(fn)
        got, expected = grads(compiled, *names), grads(fn, *names)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), fn.__name__
        assert graphs == [[f"lowp.{op}.default"] for op in ops]


def test_compiled_forward_backward_does_not_recompile_over_token_counts_and_splits():
    """One forward and one backward graph (AOTAutograd) reused for new token counts and split sizes."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    mlp = lowp_ops.nn.GroupedSwiGLUMLP(3, 32, 16)
    compiled = torch.compile(mlp, fullgraph=True, dynamic=True, backend="aot_eager")

    def step(module, inputs):
        x = inputs["x"].detach().requires_grad_()
        probs = inputs["probs"].detach().requires_grad_()
        y = module(x, inputs["split_sizes"], probs)
        y.backward(inputs["dy"])
        grads = [y.detach(), x.grad, probs.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]
        mlp.zero_grad()
        return grads

    for index, splits in enumerate(([8, 0, 16], [5, 30, 2], [40, 9, 0], [1, 1, 1])):
        inputs = make_inputs(splits, 32, 16, seed=index)
        if index == 2:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = step(compiled, inputs)
        finally:
            torch.compiler.set_stance("default")
        expected = step(mlp, inputs)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), splits
    assert not counters["graph_break"]


# ----------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"recipe": "fp8"}, "recipe must be one of"),
        ({"glu_interleave_size": 16}, "None or 32"),
        ({"fc1_dy_amax_from_dglu": True}, "needs recipe='nvfp4'"),
        ({"fc2_weight": torch.zeros(2, 32, 8, dtype=torch.bfloat16)}, "fc2_weight must have shape"),
        ({"fc2_weight": torch.zeros(2, 32, 16)}, "fc2_weight must be bfloat16"),
        ({"split_sizes": torch.tensor([4, 4, 4])}, "one entry per expert"),
        ({"split_sizes": torch.tensor([4.0, 4.0])}, "integer tensor"),
        ({"x": torch.zeros(8, 32)}, "x must be bfloat16"),
        # Another device (meta stands in on a CPU-only machine): the reference would read unwritten memory.
        ({"fc1_weight": torch.zeros(2, 32, 32, dtype=torch.bfloat16).to("meta")}, "fc1_weight must be on"),
        ({"fc2_weight": torch.zeros(2, 32, 16, dtype=torch.bfloat16).to("meta")}, "fc2_weight must be on"),
        ({"probs": torch.ones(8, device="meta")}, "probs must be on"),
        ({"probs": torch.ones(2, 4)}, r"probs must have shape \(8,\) or \(8, 1\)"),
        ({"x": torch.zeros(2, 4, 32, dtype=torch.bfloat16)}, r"x must be 2-D \(tokens, hidden\), got 3-D"),
    ],
)
def test_bad_arguments_raise_naming_them(change, match):
    inputs = make_inputs([4, 4], 32, 16, seed=0)
    args = {
        "x": inputs["x"],
        "fc1_weight": inputs["fc1_weight"],
        "fc2_weight": inputs["fc2_weight"],
        "split_sizes": inputs["split_sizes"],
        "probs": inputs["probs"],
    }
    kwargs = {}
    for key, value in change.items():
        (args if key in args else kwargs)[key] = value
    with pytest.raises(ValueError, match=match):
        lowp_ops.grouped_swiglu_mlp(*args.values(), **kwargs)


@pytest.mark.parametrize("checks", ["cpu", "off"])
def test_nvfp4_hidden_size_not_a_multiple_of_16_raises_naming_it(checks):
    """The NVFP4 recipe quantizes all experts' weights in one call over their stacked rows in 16x16
    blocks. With H = 24 (a multiple of 8), FC2's (E, H, F) rows straddled experts: on CPU the error named
    the caller's valid split sizes; with the host's split-size checks off (as for CUDA tensors) the stack's
    last rows dequantized to zeros and the last expert's output columns 16-23 were exactly 0."""
    from lowp_ops.meta.split_sizes import set_split_size_checks

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 24, generator=gen).bfloat16()
    fc1 = (torch.randn(3, 32, 24, generator=gen) / 4).bfloat16()
    fc2 = (torch.randn(3, 24, 16, generator=gen) / 4).bfloat16()
    split_sizes, probs = torch.tensor([16, 16, 16]), torch.rand(48, generator=gen)
    previous = set_split_size_checks(checks)
    try:
        with pytest.raises(ValueError, match=r"fc2_weight \(E, N, K\) needs N a multiple of 16.*N=24"):
            lowp_ops.grouped_swiglu_mlp(x, fc1, fc2, split_sizes, probs, recipe="nvfp4")
    finally:
        set_split_size_checks(previous)
    # bf16 and mxfp8 take the shape.
    assert lowp_ops.grouped_swiglu_mlp(x, fc1, fc2, split_sizes, probs, recipe="bf16").shape == (48, 24)


@pytest.mark.parametrize("suite", ["cpu", pytest.param("interp", marks=pytest.mark.interp)])
@pytest.mark.parametrize("n", [24, 40, 64])
def test_mxfp8_dgrad_weight_blocks_are_each_experts_own(n, suite):
    """The MXFP8 recipe's dgrad weight is each expert's (N, K) through its own 32-row blocks along N, as
    TE quantizes each expert's tensor: with N not a multiple of 32 the stacked (E * N, K) blocks spanned
    two experts, and an expert 2^16 times larger than its neighbour flushed the neighbour's values."""
    from lowp_ops import library
    from lowp_ops.composite.grouped_linear import _mxfp8_dgrad_weight

    weight = torch.randn(3, n, 16, generator=torch.Generator().manual_seed(n)).bfloat16()
    weight[1] *= 2**16
    want = torch.stack([library.mxfp8_round_trip(w, "e4m3", False, True)[1] for w in weight])
    got = _mxfp8_dgrad_weight(weight)
    assert got.shape == weight.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("suite", ["cpu", pytest.param("interp", marks=pytest.mark.interp)])
def test_mxfp8_wgrad_blocks_are_each_experts_own(suite):
    """The MXFP8 recipe's weight gradient contracts each expert's column-wise copies of dy and x, whose
    32-row blocks are that expert's tokens only (as TE quantizes each expert's tensor), for split sizes
    that are not multiples of 32 and a tail of no expert: with blocks along the whole token dim, expert
    1's tokens (2^16 larger) shared blocks with experts 0 and 2 and flushed their values."""
    gen = torch.Generator().manual_seed(5)
    sizes, tokens, n, k = [20, 45, 25], 100, 40, 32
    x = torch.randn(tokens, k, generator=gen).bfloat16()
    dy = torch.randn(tokens, n, generator=gen).bfloat16()
    x[20:65] *= 2**16
    dy[20:65] *= 2**16
    weight = torch.randn(3, n, k, generator=gen).bfloat16()
    _, dweight = grouped_linear.linear_backward(dy, x, weight, torch.tensor(sizes), "mxfp8")
    starts = [0, 20, 65, 90]
    for expert in range(3):
        rows = slice(starts[expert], starts[expert + 1])
        x_col = library.mxfp8_round_trip(x[rows], "e4m3", False, True)[1]
        dy_col = library.mxfp8_round_trip(dy[rows], "e4m3", False, True)[1]
        want = dy_col.double().t() @ x_col.double()
        torch.testing.assert_close(
            dweight[expert].double(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item()
        )


def test_nvfp4_token_count_not_divisible_by_16_raises_before_the_forward():
    """40 tokens with split sizes [16, 16] (the last 8 rows in no expert, CUDA's rule): the forward ran
    and the backward raised; refused at the call now."""
    from lowp_ops.meta.split_sizes import set_split_size_checks

    inputs = make_inputs([16, 16], 32, 16, seed=0)
    x = torch.cat([inputs["x"], inputs["x"][:8]])
    probs = torch.cat([inputs["probs"], inputs["probs"][:8]])
    previous = set_split_size_checks("off")
    try:
        with pytest.raises(ValueError, match=r"token count .* divisible by 16, got 40"):
            lowp_ops.grouped_swiglu_mlp(
                x, inputs["fc1_weight"], inputs["fc2_weight"], inputs["split_sizes"], probs, recipe="nvfp4"
            )
    finally:
        set_split_size_checks(previous)


def test_module_checks_its_options_when_built():
    with pytest.raises(ValueError, match="glu_interleave_size must be None or 32"):
        lowp_ops.nn.GroupedSwiGLUMLP(2, 32, 16, glu_interleave_size=16)
    with pytest.raises(TypeError, match="fc1_dy_amax_from_dglu must be a bool"):
        lowp_ops.nn.GroupedSwiGLUMLP(2, 32, 16, recipe="nvfp4", fc1_dy_amax_from_dglu="yes")
    with pytest.raises(ValueError, match=r"dtype must be torch\.bfloat16"):
        lowp_ops.nn.GroupedSwiGLUMLP(2, 32, 16, dtype=torch.float32)
    # Shapes the first call would refuse (or, for ffn=0, a ZeroDivisionError in the initialization).
    for args, kwargs, match in (
        ((2, 32, 0), {}, "ffn must be positive"),
        ((0, 32, 16), {}, "num_experts must be positive"),
        ((2, 12, 16), {}, "multiples of 8"),
        ((2, 24, 16), {"recipe": "nvfp4"}, "hidden of 16 for recipe='nvfp4'"),
    ):
        with pytest.raises(ValueError, match=match):
            lowp_ops.nn.GroupedSwiGLUMLP(*args, **kwargs)
    assert lowp_ops.nn.GroupedSwiGLUMLP(2, 24, 16).fc2_weight.shape == (2, 24, 16)


_A, _B = torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 4, dtype=torch.bfloat16)
_ENDS = torch.tensor([4, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((_A[0], _B, _ENDS), "a must be 2-D"),
        ((_A, _B[0, 0], _ENDS), "b must be 2-D or 3-D"),
        ((_A.float(), _B, _ENDS), "a and b must be bfloat16"),
        ((_A, _B, _ENDS.float()), "offs must be a 1-D int32/int64"),
        ((_A, _B[:, :8], _ENDS), "share the contraction dim"),
        ((_A, _B, _ENDS[:1]), "one entry per group of b"),
        ((_A, _B, torch.tensor([6, 4], dtype=torch.int32)), "non-decreasing"),
    ],
)
def test_grouped_mm_bad_arguments_raise_naming_them(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.lowp.grouped_mm(*args)


# ------------------------------------------------------------------------------ interpreter and GPU


@pytest.mark.interp
def test_mlp_with_triton_kernels_matches_float64():
    """The SwiGLU/dGLU and MXFP8 Triton kernels inside the MLP (interpreter), small shapes."""
    inputs = make_inputs([32, 0, 64], 64, 32, seed=6)
    for recipe in ("bf16", "mxfp8"):
        assert_matches_float64(run_mlp(inputs, recipe), float64_mlp(inputs), recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("hidden", [128, 256])
def test_mlp_on_cuda_matches_float64_with_an_empty_expert(recipe, hidden):
    inputs = make_inputs([256, 0, 768, 512], hidden, hidden, seed=hidden, device="cuda")
    assert_matches_float64(run_mlp(inputs, recipe), float64_mlp(inputs), recipe)


@pytest.mark.gpu
def test_grouped_mm_on_cuda_matches_the_reference_loop():
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(1000, 256, generator=gen).bfloat16()
    b = torch.randn(4, 256, 512, generator=gen).bfloat16()
    g = torch.randn(1000, 512, generator=gen).bfloat16()
    offs = torch.tensor([300, 300, 808, 1000], dtype=torch.int32)
    for args in ((a, b, offs), (a.t(), g, offs), (g, b.transpose(1, 2), offs)):
        got = torch.ops.lowp.grouped_mm(*(t.cuda() for t in args)).cpu()
        expected = grouped_mm_ref.grouped_mm(*args)
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-2)


# ------------------------------------------------------------------ CUDA graphs (one process per test)
# Manual capture of the MLP's forward+backward replays bit-identically to eager when the tokens,
# probabilities and split sizes change (split sizes are data: never read on the host).


CAPTURE_EXPERTS, CAPTURE_HIDDEN, CAPTURE_FFN, CAPTURE_TOKENS = 8, 512, 256, 2048


def capture_step_inputs(seed: int):
    """CUDA inputs of one captured MLP step: (x, split sizes (multiples of 32), probs, dy)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cuts = torch.sort(
        torch.randint(0, CAPTURE_TOKENS // 32 + 1, (CAPTURE_EXPERTS - 1,), generator=gen, device="cuda")
    ).values
    bounds = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), CAPTURE_TOKENS // 32)]) * 32
    split_sizes = bounds.diff()  # multiples of 32, some experts empty
    x = (torch.randn(CAPTURE_TOKENS, CAPTURE_HIDDEN, generator=gen, device="cuda") * 0.5).bfloat16()
    probs = torch.rand(CAPTURE_TOKENS, generator=gen, device="cuda")
    dy = (torch.randn(CAPTURE_TOKENS, CAPTURE_HIDDEN, generator=gen, device="cuda") * 0.1).bfloat16()
    return x, split_sizes, probs, dy


@pytest.mark.cudagraph
@pytest.mark.parametrize("recipe", RECIPES)
def test_manual_capture_of_grouped_mlp_forward_backward_replays_like_eager(recipe):
    torch.manual_seed(0)
    mlp = lowp_ops.nn.GroupedSwiGLUMLP(
        CAPTURE_EXPERTS, CAPTURE_HIDDEN, CAPTURE_FFN, recipe=recipe, device="cuda"
    )
    static_x, static_splits, static_probs, static_dy = capture_step_inputs(0)
    static_x.requires_grad_()
    static_probs.requires_grad_()

    def step():
        y = mlp(static_x, static_splits, static_probs)
        y.backward(static_dy)
        return y

    warm_up(step)
    graph = torch.cuda.CUDAGraph()
    mlp.zero_grad(set_to_none=True)
    static_x.grad = static_probs.grad = None
    with torch.cuda.graph(graph):
        static_y = step()

    for seed in (1, 2, 3):
        x, split_sizes, probs, dy = capture_step_inputs(seed)
        with torch.no_grad():
            for static, new in (
                (static_x, x),
                (static_splits, split_sizes),
                (static_probs, probs),
                (static_dy, dy),
            ):
                static.copy_(new)
        graph.replay()
        captured = [static_y, static_x.grad, static_probs.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]
        captured = [t.detach().clone() for t in captured]
        eager_x, eager_probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
        fc1_grad, fc2_grad = mlp.fc1_weight.grad, mlp.fc2_weight.grad
        mlp.fc1_weight.grad = mlp.fc2_weight.grad = None
        eager_y = mlp(eager_x, split_sizes, eager_probs)
        eager_y.backward(dy)
        eager = [eager_y.detach(), eager_x.grad, eager_probs.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]
        mlp.fc1_weight.grad, mlp.fc2_weight.grad = fc1_grad, fc2_grad  # the graph's static buffers
        torch.cuda.synchronize()
        for name, got, want in zip(("y", "dx", "dprobs", "dW1", "dW2"), captured, eager, strict=True):
            assert same_bits(got, want), f"{name} differs at replay {seed}"
