"""Ops whose kernels compiled graphs launch themselves (``inline_kernels`` in ``library.py``): under
``torch.compile`` with static shapes the graph holds their Triton kernels, not the ops, and gives the
eager bytes; dynamic shapes, other devices and the ops not marked keep each op as one node."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import aot_function

import lowp_ops
from lowp_ops import library

INLINED = ("softmax_fwd", "softmax_bwd")

CALLS = {
    "softmax": lambda x, t: lowp_ops.softmax(x, -1),
    "log_softmax zero rows": lambda x, t: lowp_ops.log_softmax(x, -1, masked_rows="zero"),
}

# Not marked: with Inductor launching their kernels a GPU run took 2.0x the host time of compiled
# F.cross_entropy (2.4-2.8x as opaque ops), but the byte test failed (docs/registration.md).
OPAQUE_CALLS = {
    "cross_entropy mean": lambda x, t: lowp_ops.cross_entropy(x, t, label_smoothing=0.1),
    "logsumexp": lambda x, t: lowp_ops.logsumexp(x, -1),
}


def _inputs(device: str, rows: int = 24, cols: int = 300, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(rows * cols)
    logits = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
    logits[0, :40] = float("-inf")
    logits[1] = float("-inf")  # a fully masked row
    target = torch.randint(0, cols, (rows,), generator=gen)
    target[2] = -100
    return logits.to(device), target.to(device)


class _Captured(Exception):
    """Raised by the capturing backend once it holds the joint graph (nothing is run)."""


def _joint_graph_code(fn, *args, dynamic: bool) -> str:
    """The code of AOTAutograd's joint forward + backward graph of ``fn(*args)`` (not compiled, not run).
    Traced by ``aot_function`` without Dynamo: a Dynamo compile aborted from its backend left later
    tests' frames holding their locals (``test_grouped_mlp``'s freeing checks)."""
    code = []

    def partition(joint, joint_inputs, **kwargs):
        code.append(joint.code)
        raise _Captured

    traced = aot_function(fn, fw_compiler=lambda gm, inputs: gm, partition_fn=partition, dynamic=dynamic)
    with pytest.raises(_Captured):
        traced(*args)
    return code[0]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_static_graph_holds_the_kernels_not_the_ops(name, monkeypatch):
    # CPU tensors stand in for CUDA ones: only the tracing is checked here (the GPU test runs the graph).
    monkeypatch.setattr(library, "INLINE_DEVICE_TYPES", {"cuda", "cpu"})
    logits, target = _inputs("cpu")
    code = _joint_graph_code(CALLS[name], logits.requires_grad_(), target, dynamic=False)
    assert "triton_kernel_wrapper" in code
    assert "torch.ops.lowp" not in code


def test_dynamic_shapes_keep_the_ops(monkeypatch):
    monkeypatch.setattr(library, "INLINE_DEVICE_TYPES", {"cuda", "cpu"})
    logits, target = _inputs("cpu")
    code = _joint_graph_code(CALLS["softmax"], logits.requires_grad_(), target, dynamic=True)
    assert "triton_kernel_wrapper" not in code
    assert "torch.ops.lowp.softmax_fwd" in code and "torch.ops.lowp.softmax_bwd" in code


@pytest.mark.parametrize("name", sorted(OPAQUE_CALLS))
def test_unmarked_ops_stay_one_node(name, monkeypatch):
    monkeypatch.setattr(library, "INLINE_DEVICE_TYPES", {"cuda", "cpu"})
    logits, target = _inputs("cpu")
    code = _joint_graph_code(OPAQUE_CALLS[name], logits.requires_grad_(), target, dynamic=False)
    assert "triton_kernel_wrapper" not in code and "torch.ops.lowp" in code


def test_cpu_graphs_keep_the_ops():
    logits, target = _inputs("cpu")
    code = _joint_graph_code(CALLS["softmax"], logits.requires_grad_(), target, dynamic=False)
    assert "triton_kernel_wrapper" not in code and "torch.ops.lowp.softmax_fwd" in code


def test_exactly_the_listed_ops_inline():
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    inlined = {
        name
        for name in dir(library)
        if isinstance(getattr(library, name), library.LowpOp)
        and FunctionalTensorMode in getattr(library, name).custom_op._torch_dispatch_fns
    }
    assert inlined == set(INLINED)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("shape", [(24, 300), (512, 32000), (64, 8191)])
def test_inductor_launches_the_kernels_with_the_eager_bytes(name, shape):
    from torch._inductor.utils import run_and_get_code

    fn = CALLS[name]
    logits, target = _inputs("cuda", *shape)
    eager_leaf = logits.clone().requires_grad_()
    want = fn(eager_leaf, target)
    gen = torch.Generator("cuda").manual_seed(0)
    dy = torch.randn(want.shape, device="cuda", generator=gen).to(want.dtype)
    (want_grad,) = torch.autograd.grad(want, eager_leaf, grad_outputs=dy)
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True)

    def forward_backward():
        leaf = logits.clone().requires_grad_()
        out = compiled(leaf, target)
        return out.detach(), torch.autograd.grad(out, leaf, grad_outputs=dy)[0]

    (out, dlogits), code = run_and_get_code(forward_backward)
    assert _same_bits(out, want.detach())
    assert _same_bits(dlogits, want_grad)
    assert len(code) == 2, "the forward and the backward graph"
    assert "torch.ops.lowp" not in "\n".join(code), "an op was left in a compiled graph"
    assert not counters["graph_break"]


@pytest.mark.cudagraph
def test_reduce_overhead_replays_the_inlined_kernels_with_the_eager_bytes():
    """Under ``mode="reduce-overhead"`` the kernels Inductor launches for the softmax ops are captured
    (no cudagraph skip) and each replay with new inputs gives the eager bytes."""
    fn = CALLS["log_softmax zero rows"]
    counters.clear()
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        for seed in range(4):
            logits, target = _inputs("cuda", 64, 8191)
            logits = logits * (seed + 1)  # new values, the same shape: one graph, replayed
            gen = torch.Generator("cuda").manual_seed(seed)
            dy = torch.randn(logits.shape, device="cuda", generator=gen).to(logits.dtype)
            torch.compiler.cudagraph_mark_step_begin()
            leaf = logits.clone().requires_grad_()
            out = compiled(leaf, target)
            (grad,) = torch.autograd.grad(out, leaf, grad_outputs=dy)
            out, grad = out.detach().clone(), grad.clone()  # cudagraph outputs are reused next step
            eager_leaf = logits.clone().requires_grad_()
            want = fn(eager_leaf, target)
            (want_grad,) = torch.autograd.grad(want, eager_leaf, grad_outputs=dy)
            assert _same_bits(out, want.detach()), f"output differs at step {seed}"
            assert _same_bits(grad, want_grad), f"gradient differs at step {seed}"
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert not counters["graph_break"]
