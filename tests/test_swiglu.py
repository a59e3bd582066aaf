"""SwiGLU x probs forward and the fused dGLU backward for grouped experts, against float64 autograd."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowp_ops


def float64_oracle(c: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor):
    """(h, dc, dprobs) in float64 by autograd of silu(gate) * linear * p, gate = first half."""
    c64 = c.double().requires_grad_()
    p64 = probs.double().requires_grad_()
    gate, linear = c64.chunk(2, dim=1)
    h = torch.nn.functional.silu(gate) * linear * p64[:, None]
    dc, dp = torch.autograd.grad(h, (c64, p64), grad.double())
    return h.detach(), dc, dp


def interleave_32(t: torch.Tensor) -> torch.Tensor:
    """[gate | linear] columns -> alternating 32-wide gate and linear blocks."""
    tokens, width = t.shape
    gate, linear = t.view(tokens, 2, width // 64, 32).unbind(1)
    return torch.stack((gate, linear), dim=2).reshape(tokens, width)


def make(tokens: int, ffn: int, seed: int, probs_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    c = (torch.randn(tokens, 2 * ffn, generator=gen) * 2).bfloat16()
    probs = torch.rand(tokens, generator=gen).to(probs_dtype)
    grad = torch.randn(tokens, ffn, generator=gen)
    return c, probs, grad


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2**-126))) - 7)


@given(tokens=st.integers(1, 40), ffn=st.sampled_from([1, 3, 32, 64]), seed=st.integers(0, 2**20))
def test_dglu_matches_float64_autograd(tokens, ffn, seed):
    c, probs, grad = make(tokens, ffn, seed)
    _, dc_ref, dp_ref = float64_oracle(c, probs, grad)
    dc, dprobs, _ = lowp_ops.dglu(grad, c, probs, torch.tensor([tokens]))
    assert dc.dtype == torch.bfloat16 and dprobs.dtype == torch.float32
    # dc: fp32 math rounded once to bf16 -> within one bf16 ulp of the exact value.
    assert ((dc.double() - dc_ref).abs() <= bf16_ulp(dc_ref) + 1e-30).all()
    # dprobs: fp32 accumulation, far below a bf16 ulp.
    assert ((dprobs.double() - dp_ref).abs() <= 1e-5 * (1 + dp_ref.abs())).all()


def test_swiglu_forward_is_rounded_once_from_fp32():
    c, probs, _ = make(16, 64, seed=1)
    h_ref, _, _ = float64_oracle(c, probs, torch.zeros(16, 64))
    h = lowp_ops.swiglu(c, probs)
    assert h.dtype == torch.bfloat16
    assert ((h.double() - h_ref).abs() <= bf16_ulp(h_ref) + 1e-30).all()


@pytest.mark.parametrize("interleave", [None, 32])
def test_no_tokens_give_empty_outputs(interleave):
    """0 tokens: the shapes the fake promises, also with interleaved blocks (a reshape to -1 failed)."""
    c = torch.zeros(0, 64, dtype=torch.bfloat16)
    assert lowp_ops.swiglu(c, glu_interleave_size=interleave).shape == (0, 32)
    dc, dprobs, amax = lowp_ops.dglu(
        torch.zeros(0, 32, dtype=torch.bfloat16), c, torch.zeros(0), torch.tensor([0, 0]),
        glu_interleave_size=interleave,
    )  # fmt: skip
    assert (dc.shape, dprobs.shape) == ((0, 64), (0,)) and torch.equal(amax, torch.zeros(2))


def test_per_expert_amax_rounds_to_the_max_of_dc_exactly_and_empty_experts_are_zero():
    c, probs, grad = make(48, 64, seed=2)
    split_sizes = torch.tensor([0, 10, 0, 30, 8, 0])
    dc, _, amax = lowp_ops.dglu(grad, c, probs, split_sizes)
    start = 0
    for expert, size in enumerate(split_sizes.tolist()):
        rows = dc[start : start + size]
        expected = rows.float().abs().max() if size else torch.tensor(0.0)
        assert amax[expert].to(torch.bfloat16).float() == expected, expert
        start += size


def test_rows_past_the_last_expert_belong_to_no_expert_and_get_zero_gradients():
    c, probs, grad = make(20, 32, seed=3)
    # What an unwritten GEMM output or an unrouted row may hold there: large values and NaN.
    grad[12:] *= 1000
    grad[15], c[16], probs[17] = float("nan"), float("nan"), float("inf")
    dc, dprobs, amax = lowp_ops.dglu(grad, c, probs, torch.tensor([4, 8]))
    dc_first, dprobs_first, amax_first = lowp_ops.dglu(grad[:12], c[:12], probs[:12], torch.tensor([4, 8]))
    assert torch.equal(amax, amax_first)
    assert torch.equal(dc[:12], dc_first) and torch.equal(dprobs[:12], dprobs_first)
    assert torch.equal(dc[12:], torch.zeros_like(dc[12:]))
    assert torch.equal(dprobs[12:], torch.zeros_like(dprobs[12:]))


def test_interleaved_layout_is_the_concatenated_one_permuted():
    c, probs, grad = make(8, 64, seed=4)
    h = lowp_ops.swiglu(c, probs)
    h_interleaved = lowp_ops.swiglu(interleave_32(c), probs, glu_interleave_size=32)
    assert torch.equal(h, h_interleaved)
    dc, dprobs, amax = lowp_ops.dglu(grad, c, probs, torch.tensor([8]))
    dc_i, dprobs_i, amax_i = lowp_ops.dglu(
        grad, interleave_32(c), probs, torch.tensor([8]), glu_interleave_size=32
    )
    assert torch.equal(dc_i, interleave_32(dc))
    assert torch.equal(dprobs_i, dprobs) and torch.equal(amax_i, amax)


def test_fp32_probs_get_the_fp32_gradient_and_bf16_probs_its_single_rounding():
    c, probs, grad = make(12, 32, seed=5)
    grad = grad.bfloat16()  # the gradient of a bf16 output is bf16
    _, _, dp_ref = float64_oracle(c, probs, grad)
    p32 = probs.clone().requires_grad_()
    lowp_ops.swiglu(c, p32).backward(grad)
    assert p32.grad.dtype == torch.float32
    # Not rounded to bf16: its error against float64 is far below a bf16 ulp.
    assert ((p32.grad.double() - dp_ref).abs() < 0.01 * bf16_ulp(dp_ref)).all()
    p16 = probs.bfloat16().requires_grad_()
    lowp_ops.swiglu(c, p16).backward(grad)
    _, dprobs16, _ = lowp_ops.dglu(grad, c, probs.bfloat16(), torch.tensor([12]))
    assert torch.equal(p16.grad, dprobs16.bfloat16())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: lowp_ops.swiglu(torch.ones(4, 7), torch.ones(4)), "even, non-zero last dim"),
        (lambda: lowp_ops.swiglu(torch.ones(2, 4, 8), torch.ones(2)), "c must be 2-D"),
        (
            lambda: lowp_ops.swiglu(torch.ones(4, 8, dtype=torch.int32), torch.ones(4)),
            "c must be bfloat16, float16 or float32",
        ),
        (
            lambda: lowp_ops.swiglu(torch.ones(4, 8), torch.ones(4, dtype=torch.float16)),
            "float32 or bfloat16",
        ),
        (lambda: lowp_ops.swiglu(torch.ones(4, 8), torch.ones(5)), "probs must have shape"),
        (lambda: lowp_ops.swiglu(torch.ones(4, 8), torch.ones(4), glu_interleave_size=16), "None or 32"),
        (
            lambda: lowp_ops.swiglu(torch.ones(4, 96), torch.ones(4), glu_interleave_size=32),
            "divisible by 32",
        ),
        (
            lambda: lowp_ops.dglu(torch.ones(4, 3), torch.ones(4, 8), torch.ones(4), torch.tensor([4])),
            "grad must",
        ),
        (lambda: lowp_ops.dglu(torch.ones(4, 4), torch.ones(4, 8), torch.ones(4), torch.ones(2)), "integer"),
        # Another device (meta stands in on a CPU-only machine): the reference would return unwritten memory.
        (
            lambda: lowp_ops.dglu(
                torch.ones(4, 4, device="meta"), torch.ones(4, 8), torch.ones(4), torch.tensor([4])
            ),
            "grad must be on c's device",
        ),
        (lambda: lowp_ops.swiglu(torch.ones(4, 8), torch.ones(4, device="meta")), "probs must be on"),
    ],
)
def test_bad_arguments_raise_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_probs_that_are_not_a_tensor_raise_naming_them():
    with pytest.raises(TypeError, match="probs must be a Tensor, got list"):
        lowp_ops.swiglu(torch.ones(4, 8), [1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("interleave", [0, 32])
def test_opcheck(interleave):
    c, probs, grad = make(8, 64, seed=6)
    c = c.t().contiguous().t()
    torch.library.opcheck(torch.ops.lowp.swiglu_fwd.default, (c.requires_grad_(), probs, interleave))
    ends = torch.tensor([3, 3, 5], dtype=torch.int32)  # rows 5..7 of no expert: +0, no gradient
    torch.library.opcheck(
        torch.ops.lowp.swiglu_fwd.default, (c, probs.detach().requires_grad_(), interleave, ends)
    )
    torch.library.opcheck(
        torch.ops.lowp.dglu.default, (grad, c.detach(), probs, torch.tensor([3, 0, 5]), interleave)
    )


def test_compiled_backward_with_changing_split_sizes_does_not_recompile():
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(lowp_ops.dglu, fullgraph=True, dynamic=True, backend="aot_eager")
    c, probs, grad = make(24, 32, seed=7)
    for index, splits in enumerate(([24], [10, 14], [0, 24], [12, 0, 12])):
        split_sizes = torch.tensor(splits + [0] * (3 - len(splits)))
        if index == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(grad, c, probs, split_sizes)
        finally:
            if index:
                torch.compiler.set_stance("default")
        expected = lowp_ops.dglu(grad, c, probs, split_sizes)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert not counters["graph_break"]


def test_dense_swiglu_without_probs_is_probs_of_one():
    gen = torch.Generator().manual_seed(6)
    c = torch.randn(10, 64, generator=gen).bfloat16()
    grad = torch.randn(10, 32, generator=gen).bfloat16()
    dense, with_ones = c.clone().requires_grad_(), c.clone().requires_grad_()
    y = lowp_ops.swiglu(dense)
    y.backward(grad)
    y_ones = lowp_ops.swiglu(with_ones, torch.ones(10))
    y_ones.backward(grad)
    assert torch.equal(y, y_ones) and torch.equal(dense.grad, with_ones.grad)
