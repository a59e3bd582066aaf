"""RMSNorm (``lowp_ops.rms_norm``, ``lowp_ops.nn.RMSNorm``) against float64 autograd and against
transformers' own formula, plus opcheck, one compiled graph and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from cudagraph_checks import same_bits, warm_up
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import lowp_ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return x.to(device), weight.to(device), grad.to(device)


def transformers_formula(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normalized: bool):
    """What transformers' Llama (round_normalized) and OLMo 2 RMSNorm modules compute, in torch ops."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if round_normalized:
        return weight * hidden.to(x.dtype)
    return (weight * hidden).to(x.dtype)


def float64_oracle(x, weight, grad, eps):
    """(y, dx, dweight) in float64 by autograd of the exact, unrounded RMSNorm."""
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    y = w64 * x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    dx, dw = torch.autograd.grad(y, (x64, w64), grad.double())
    return y.detach(), dx, dw


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(x.double().abs().clamp_min(tiny))) - mantissa)


@given(
    rows=st.integers(1, 24),
    hidden=st.sampled_from([1, 7, 40, 128, 257]),
    dtype=st.sampled_from(DTYPES),
    round_normalized=st.booleans(),
    seed=st.integers(0, 2**20),
)
def test_matches_float64_autograd(rows, hidden, dtype, round_normalized, seed):
    check_against_float64(rows, hidden, dtype, round_normalized, seed)


@pytest.mark.interp
@pytest.mark.parametrize("round_normalized", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_interp_op_matches_float64_autograd(dtype, round_normalized):
    """The public function on the Triton kernels (interpreter): forward and backward."""
    for hidden, seed in ((1, 0), (40, 1), (257, 2)):
        check_against_float64(9, hidden, dtype, round_normalized, seed)


def check_against_float64(rows, hidden, dtype, round_normalized, seed):
    x, weight, grad = make((rows, hidden), dtype, seed)
    eps = 1e-6
    y_ref, dx_ref, dw_ref = float64_oracle(x, weight, grad, eps)
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = lowp_ops.rms_norm(xr, wr, eps, round_normalized=round_normalized)
    y.backward(grad)
    assert y.dtype == xr.grad.dtype == wr.grad.dtype == dtype
    # round_normalized: two roundings (n, then y); otherwise one; fp32 statistics add a few fp32 ulps.
    roundings = 2 if round_normalized and dtype != torch.float32 else 1
    assert ((y.double() - y_ref).abs() <= roundings * ulp(y_ref, dtype) + 1e-6 * y_ref.abs()).all()
    # dx: fp32 math rounded once; its fp32 error is bounded by the magnitude of the terms it adds.
    x64, g64, w64 = x.double(), grad.double(), weight.double()
    rstd = torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    xhat, dn = x64 * rstd, g64 * w64
    terms = rstd * (dn.abs() + xhat.abs() * (dn * xhat).abs().mean(-1, keepdim=True))
    assert ((xr.grad.double() - dx_ref).abs() <= ulp(dx_ref, dtype) + 1e-5 * terms).all()
    # dweight: the rounding of n (when round_normalized) moves each term by at most half an ulp of n.
    relative = 2.0**-8 if round_normalized and dtype != torch.float32 else 1e-5
    bound = ulp(dw_ref, dtype) + relative * (g64 * xhat).abs().sum(0)
    assert ((wr.grad.double() - dw_ref).abs() <= bound).all()


@pytest.mark.parametrize("round_normalized", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_transformers_own_formula(dtype, round_normalized):
    """Each element equals the module's own output, or is one ulp from it (the fp32 sum of squares is
    added up in another order, which can move rstd by an fp32 ulp)."""
    x, weight, _ = make((64, 96), dtype, seed=1)
    got = lowp_ops.rms_norm(x, weight, 1e-5, round_normalized=round_normalized)
    want = transformers_formula(x, weight, 1e-5, round_normalized)
    assert got.dtype == want.dtype
    assert ((got.double() - want.double()).abs() <= ulp(want, dtype)).all()
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_weight_is_gemmas_unit_offset_norm(dtype):
    """An fp32 weight with low-precision rows, as Gemma's and Qwen 3.5's ``1 + weight`` formed in fp32:
    each element equals the module's own ``(norm(x.float()) * (1.0 + w.float())).type_as(x)`` or is one
    ulp from it, and w's gradient, through the fp32 sum, is float64 autograd's within its roundings."""
    x, _, grad = make((64, 96), dtype, seed=2)
    w = (0.3 * torch.randn(96, generator=torch.Generator().manual_seed(3))).to(dtype).requires_grad_()
    got = lowp_ops.rms_norm(x, 1.0 + w.float(), 1e-6, round_normalized=False)
    hidden = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    want = (hidden * (1.0 + w.detach().float())).type_as(x)
    assert got.dtype == dtype
    assert ((got.double() - want.double()).abs() <= ulp(want, dtype)).all()
    assert (got != want).float().mean() < 0.01
    got.backward(grad)
    w64 = w.detach().double().requires_grad_()
    x64 = x.double()
    y64 = (1 + w64) * x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
    (dw64,) = torch.autograd.grad(y64, w64, grad.double())
    xhat = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
    assert w.grad.dtype == dtype
    bound = ulp(dw64, dtype) + 1e-5 * (grad.double() * xhat).abs().sum(0)
    assert ((w.grad.double() - dw64).abs() <= bound).all()


def test_any_leading_shape_and_the_module():
    x, weight, grad = make((2, 3, 5, 48), torch.bfloat16, seed=2)
    norm = lowp_ops.nn.RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(weight)
    xr = x.clone().requires_grad_()
    y = norm(xr)
    y.backward(grad)
    flat = x.reshape(-1, 48).clone().requires_grad_()
    y_flat = lowp_ops.rms_norm(flat, weight, 1e-5)
    y_flat.backward(grad.reshape(-1, 48))
    assert y.shape == x.shape and torch.equal(y.reshape(-1, 48), y_flat)
    assert torch.equal(xr.grad.reshape(-1, 48), flat.grad)
    assert "hidden=48, eps=1e-05" in repr(norm)


def test_zero_rows_give_an_empty_output_and_a_zero_weight_gradient():
    x = torch.empty(0, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(16, dtype=torch.bfloat16, requires_grad=True)
    y = lowp_ops.rms_norm(x, weight)
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(weight.grad, torch.zeros(16, dtype=torch.bfloat16))


def test_only_x_weight_and_rstd_are_saved():
    x, weight, _ = make((32, 64), torch.bfloat16, seed=3)
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lowp_ops.rms_norm(xr, wr)
    assert sorted(t.numel() for t in saved) == [32, 64, 32 * 64]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"weight": torch.ones(5)}, ValueError, r"weight must have shape \(8,\)"),
        ({"weight": torch.ones(8, dtype=torch.bfloat16)}, ValueError, "weight must have x's dtype"),
        ({"eps": "small"}, TypeError, "eps must be a float"),
        ({"eps": -1.0}, ValueError, "eps must be >= 0"),
        ({"round_normalized": 1}, TypeError, "round_normalized must be a bool"),
        ({"input": torch.ones(4, 8, dtype=torch.int32)}, ValueError, "x must be float32"),
        ({"input": torch.ones(2, 16385), "weight": torch.ones(16385)}, ValueError, "hidden size must be"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    arguments = {"input": torch.ones(4, 8), "weight": torch.ones(8), **kwargs}
    with pytest.raises(error, match=match):
        lowp_ops.rms_norm(**arguments)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("round_normalized", [True, False])
def test_opcheck(round_normalized, weight_dtype):
    x, weight, grad = make((12, 40), torch.bfloat16, seed=4)
    weight = weight.to(weight_dtype)
    x = x.t().contiguous().t()  # a column-major input is read through its strides
    torch.library.opcheck(
        torch.ops.lowp.rms_norm_fwd.default,
        (x.requires_grad_(), weight.requires_grad_(), 1e-6, round_normalized),
    )
    _, rstd = lowp_ops.library.rms_norm_fwd(x.detach(), weight.detach(), 1e-6, round_normalized)
    torch.library.opcheck(
        torch.ops.lowp.rms_norm_bwd.default, (grad, x.detach(), weight.detach(), rstd, round_normalized)
    )


def test_compiled_forward_and_backward_is_one_graph_with_the_eager_bytes():
    counters.clear()
    x, weight, grad = make((4, 6, 64), torch.bfloat16, seed=5)

    def step(x, weight):
        return lowp_ops.rms_norm(x, weight, 1e-6)

    results = []
    for function in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = function(xr, wr)
        y.backward(grad)
        results.append((y, xr.grad, wr.grad))
    assert not counters["graph_break"]
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.cudagraph
def test_manual_capture_of_forward_backward_replays_like_eager():
    rows, hidden = 4096, 2048

    def inputs(seed):
        x, weight, grad = make((rows, hidden), torch.bfloat16, seed, "cuda")
        return x.requires_grad_(), weight.requires_grad_(), grad

    def step(x, weight, grad):
        x.grad = weight.grad = None
        y = lowp_ops.rms_norm(x, weight, 1e-5)
        y.backward(grad)
        return y, x.grad, weight.grad

    static = inputs(0)
    warm_up(step, *static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(*static)
    for seed in (1, 2):
        fresh = inputs(seed)
        with torch.no_grad():
            for target, source in zip(static, fresh, strict=True):
                target.copy_(source)
        graph.replay()
        eager = step(*fresh)
        for got, want in zip(static_out, eager, strict=True):
            assert same_bits(got, want)


def test_compiled_transformers_formula_saves_what_the_op_saves():
    """``apply_lowp_ops``'s default ``rms_norm="eager"`` (compiled norms left to Inductor) rests on this:
    under Inductor's min-cut partitioner, transformers' RMSNorm between a residual add and a projection
    hands the backward the same tensors as ``lowp_ops.rms_norm`` (bf16 x, fp32 rstd per row, the bf16
    output for the projection's weight gradient, the weights), so leaving the norms to Inductor costs no
    activation memory."""
    from partition_checks import bytes_saved_by_compiled_forward

    x, weight, _ = make((64, 256), torch.bfloat16, seed=4)
    projection = torch.randn(256, 256).bfloat16()
    xr = x.clone().requires_grad_()

    def layer(norm):
        return lambda v: torch.nn.functional.linear(norm(v * 2), projection)

    theirs = bytes_saved_by_compiled_forward(layer(lambda v: transformers_formula(v, weight, 1e-6, True)), xr)
    ours = bytes_saved_by_compiled_forward(layer(lambda v: lowp_ops.rms_norm(v, weight, 1e-6)), xr)
    # weight (bf16), rstd (fp32), x (bf16), the projection (bf16)
    assert theirs == ours == sorted([2 * 256, 4 * 64, 2 * 64 * 256, 2 * 256 * 256])


def test_module_reset_parameters_initializes_a_deferred_weight():
    """Deferred initialization (FSDP2 style): built on meta, to_empty, reset_parameters -> ones."""
    with torch.device("meta"):
        norm = lowp_ops.nn.RMSNorm(64)
    norm = norm.to_empty(device="cpu")
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(64, dtype=torch.bfloat16))
