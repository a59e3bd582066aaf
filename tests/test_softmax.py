"""Masked-safe softmax, log_softmax and logsumexp on CPU against PyTorch's float64 implementations (forward
and autograd), ``masked_rows`` semantics, ``opcheck`` and ``torch.compile``.

Tolerances: one ulp of the output dtype around the rounded float64 value, plus the absolute error of the
fp32 math inside (and, for gradients, of using the output rounded to its dtype, as PyTorch also does).
"""

from __future__ import annotations

import math

import pytest
import torch
from ce_softmax_oracles import FP32_UNIT, MANTISSA_BITS, assert_within_ulps, bits, ulp
from cudagraph_checks import same_bits, warm_up
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import lowp_ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NEG_INF = float("-inf")
FUNCTIONS = ("softmax", "log_softmax", "logsumexp")


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x.abs(), 0.0)


def call(name: str, x: torch.Tensor, dim: int, masked_rows: str) -> torch.Tensor:
    if name == "logsumexp":
        return lowp_ops.logsumexp(x, dim)
    return getattr(lowp_ops, name)(x, dim, masked_rows=masked_rows)


def expected_forward(name: str, x64: torch.Tensor, dim: int, masked_rows: str) -> torch.Tensor:
    """PyTorch float64, with ``masked_rows="zero"`` applied to slices that are all -inf."""
    want = getattr(torch, name)(x64, dim)
    if masked_rows == "zero" and name != "logsumexp":
        all_masked = (x64 == NEG_INF).all(dim=dim, keepdim=True)
        want = torch.where(all_masked, NEG_INF if name == "log_softmax" else 0.0, want)
    return want


def error_scales(x64: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, |lse| per slice, fp32 relative error of exp(x - lse) per element) for slack formulas."""
    lse = torch.logsumexp(x64, dim, keepdim=True)
    p = torch.where(torch.isfinite(lse), torch.exp(x64 - lse), 0.0).nan_to_num(0.0)
    magnitude = finite_abs(x64) + finite_abs(lse)
    return p, finite_abs(lse), 8 * FP32_UNIT * (2 + magnitude)


def forward_slack(name: str, x64: torch.Tensor, dim: int) -> torch.Tensor:
    p, lse_abs, rel = error_scales(x64, dim)
    if name == "softmax":
        return p * rel
    if name == "log_softmax":
        return rel
    return 8 * FP32_UNIT * (2 + lse_abs + finite_abs(x64).amax(dim=dim, keepdim=True)).squeeze(dim)


def backward_slack(name: str, x64: torch.Tensor, dy64: torch.Tensor, dim: int, dtype) -> torch.Tensor:
    """Error bound of the gradient from the output rounded to ``dtype`` and fp32 math (see module doc)."""
    p, _, rel = error_scales(x64, dim)
    n = x64.shape[dim] if x64.dim() else 1
    log_n = 2 + math.log2(max(n, 1))
    if name == "logsumexp":
        return p * rel * dy64.abs().unsqueeze(dim)
    if name == "softmax":
        # dx = y (dy - s), s = Σ dy y; y carries its rounding to dtype plus the fp32 error.
        y_rel = 2.0 ** -(MANTISSA_BITS[dtype] + 1) + rel.amax(dim=dim, keepdim=True)
        s = (dy64 * p).sum(dim, keepdim=True)
        weighted = (dy64.abs() * p).sum(dim, keepdim=True)
        return y_rel * p * ((dy64 - s).abs() + weighted) + 4 * FP32_UNIT * p * (
            dy64.abs() + s.abs() + log_n * weighted
        )
    # log_softmax: dx = dy - exp(y) Σ dy; exp of the rounded log-probability.
    log_p = torch.log(p)
    y_err = ulp(torch.where(p > 0, log_p, 0.0), dtype) + rel + 4 * FP32_UNIT
    total = dy64.sum(dim, keepdim=True).abs()
    total_abs = dy64.abs().sum(dim, keepdim=True)
    return p * total * y_err + 4 * FP32_UNIT * (dy64.abs() + p * log_n * total_abs)


def check_against_torch(
    name: str, x: torch.Tensor, dim: int, masked_rows: str = "nan", dy: torch.Tensor | None = None
) -> None:
    """Forward and gradient of ``lowp_ops.<name>`` vs PyTorch float64, with masked_rows semantics."""
    x_bits = bits(x).clone()
    leaf = x.detach().requires_grad_()
    out = call(name, leaf, dim, masked_rows)
    x64 = x.detach().double().requires_grad_()
    want = expected_forward(name, x64, dim, masked_rows)
    assert out.dtype == x.dtype and out.shape == want.shape
    assert_within_ulps(
        out.detach(), want.detach(), slack=forward_slack(name, x64.detach(), dim), what="forward"
    )

    if dy is None:
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(x.dtype)
    (grad,) = torch.autograd.grad(out, leaf, grad_outputs=dy)
    (want_grad,) = torch.autograd.grad(want, x64, grad_outputs=dy.double())
    if masked_rows == "zero" and name != "logsumexp":
        all_masked = (x64.detach() == NEG_INF).all(dim=dim, keepdim=True)
        want_grad = torch.where(all_masked, 0.0, want_grad)
        assert (torch.where(all_masked, grad, 0.0) == 0).all(), "masked slices must get a zero gradient"
    assert grad.dtype == x.dtype and grad.shape == x.shape
    slack = backward_slack(name, x64.detach(), dy.double(), dim, x.dtype)
    assert_within_ulps(grad, want_grad, slack=slack, what="grad")
    assert torch.equal(bits(x), x_bits), "the input was modified"


# --------------------------------------------------------------------------------------- property


@st.composite
def softmax_inputs(draw):
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 6)) for _ in range(ndim)]
    shape[dim] = draw(st.integers(1, 600))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    values = torch.randn(shape, generator=gen) * draw(st.sampled_from([0.3, 3.0, 15.0]))
    values[torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.3, 0.95]))] = NEG_INF
    slice_shape = list(shape)
    slice_shape[dim] = 1
    masked_slices = torch.rand(slice_shape, generator=gen) < draw(st.sampled_from([0.0, 0.3]))
    values = torch.where(masked_slices, NEG_INF, values).to(dtype)
    if draw(st.booleans()) and ndim > 1:  # a non-contiguous input with the same values
        perm = list(range(ndim))[::-1]
        values = values.permute(perm).contiguous().permute(perm)
    dy_shape = shape.copy()
    return values, dim, gen, dy_shape


@settings(max_examples=150)
@given(
    data=softmax_inputs(),
    name=st.sampled_from(["softmax", "log_softmax"]),
    masked_rows=st.sampled_from(["nan", "zero"]),
)
def test_softmax_and_log_softmax_match_torch_float64(data, name, masked_rows):
    x, dim, gen, shape = data
    check_against_torch(name, x, dim, masked_rows, dy=torch.randn(shape, generator=gen).to(x.dtype))


@settings(max_examples=80)
@given(data=softmax_inputs(), keepdim=st.booleans())
def test_logsumexp_matches_torch_float64(data, keepdim):
    x, dim, _, _ = data
    out = lowp_ops.logsumexp(x, dim, keepdim=keepdim)
    want = torch.logsumexp(x.double(), dim, keepdim=keepdim)
    assert out.dtype == x.dtype and out.shape == want.shape
    slack = forward_slack("logsumexp", x.double(), dim)
    assert_within_ulps(out, want, slack=slack.unsqueeze(dim) if keepdim else slack, what="logsumexp")
    check_against_torch("logsumexp", x, dim)


# --------------------------------------------------------------------------------- masked slices


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_with_leading_minus_inf_blocks_are_exact(name, dtype):
    gen = torch.Generator().manual_seed(1)
    short = torch.randn(3, 4096 + 50, generator=gen) * 4
    short[0, :4096] = NEG_INF  # one whole leading block masked
    short[1, : 4096 + 49] = NEG_INF  # one finite element
    check_against_torch(name, short.to(dtype), -1)
    long = torch.randn(2, 3 * 4096 + 7, generator=gen) * 4
    long[0, : 2 * 4096] = NEG_INF
    check_against_torch(name, long.to(dtype), -1)
    check_against_torch(name, long.t().contiguous().to(dtype), 0)  # the same along dim 0


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_rows_zero_gives_zero_probabilities_and_zero_grad(name, dtype):
    x = (torch.randn(4, 37, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    x[1] = NEG_INF
    x[2, :30] = NEG_INF
    out = call(name, x, -1, "zero")
    fill = NEG_INF if name == "log_softmax" else 0.0
    assert torch.equal(out[1], torch.full((37,), fill, dtype=dtype))
    # The other rows are exactly the default mode's.
    assert torch.equal(bits(out[[0, 2, 3]]), bits(call(name, x, -1, "nan")[[0, 2, 3]]))
    check_against_torch(name, x, -1, "zero")
    check_against_torch(name, x.t().contiguous(), 0, "zero")


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_default_all_masked_row_gives_nan_like_torch(name):
    x = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    x[0] = NEG_INF
    out = call(name, x, -1, "nan")
    torch.testing.assert_close(out, getattr(torch, name)(x, -1), equal_nan=True)
    assert out[0].isnan().all() and not out[1:].isnan().any()
    check_against_torch(name, x, -1, "nan")


def test_logsumexp_of_all_masked_row_is_minus_inf_like_torch():
    x = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    x[2] = NEG_INF
    torch.testing.assert_close(lowp_ops.logsumexp(x), torch.logsumexp(x, -1))
    assert lowp_ops.logsumexp(x)[2] == NEG_INF


@pytest.mark.parametrize(
    ("dim", "error", "match"),
    [
        (2, IndexError, "dim out of range"),
        (-3, IndexError, "dim out of range"),
        ((0, 2), IndexError, "dim out of range"),
        ((0, -2), ValueError, "must not name a dimension twice"),
        (1.0, TypeError, "dim must be an int"),
        (None, TypeError, "dim must be an int"),
    ],
)
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
def test_bad_dim_raises_as_torch_would(name, dim, error, match):
    """A dim outside [-ndim, ndim) or named twice raises (it once wrapped around modulo ndim)."""
    if name != "logsumexp" and isinstance(dim, tuple):
        return  # softmax takes one dim
    x = torch.randn(3, 4)
    with pytest.raises(error, match=match):
        getattr(lowp_ops, name)(x, dim)
    if not isinstance(dim, float) and dim is not None:  # torch raises too (it accepts neither as its own)
        with pytest.raises((IndexError, RuntimeError)):
            getattr(torch, name)(x, dim)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_bad_masked_rows_raises_naming_it(name):
    with pytest.raises((RuntimeError, ValueError), match="masked_rows"):
        call(name, torch.randn(2, 3), -1, "ignore")


# ------------------------------------------------------------------------------------------ opcheck


def opcheck_input(layout: str, dtype=torch.float32, masked_row: bool = False) -> torch.Tensor:
    x = (torch.randn(37, 75, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    x[3, :40] = NEG_INF
    if masked_row:
        x[4] = NEG_INF
    return x.t().contiguous().t() if layout == "permuted" else x


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
@pytest.mark.parametrize("masked_rows", ["nan", "zero"])
@pytest.mark.parametrize("log", [False, True])
def test_opcheck_softmax_fwd(requires_grad, layout, masked_rows, log):
    # An all -inf row only where it has finite outputs and gradients (masked_rows="zero").
    x = opcheck_input(layout, masked_row=masked_rows == "zero")
    torch.library.opcheck(
        torch.ops.lowp.softmax_fwd.default, (x.requires_grad_(requires_grad), log, masked_rows)
    )


@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("log", [False, True])
def test_opcheck_softmax_bwd(layout, dtype, log):
    out = torch.ops.lowp.softmax_fwd(opcheck_input("contiguous", dtype, masked_row=True), log, "zero")
    grad = opcheck_input(layout, dtype).nan_to_num(neginf=-1.0)
    if layout == "permuted":
        out = out.t().contiguous().t()
    torch.library.opcheck(torch.ops.lowp.softmax_bwd.default, (out, grad, log))


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_logsumexp(requires_grad, layout, dtype):
    torch.library.opcheck(
        torch.ops.lowp.logsumexp.default, (opcheck_input(layout, dtype).requires_grad_(requires_grad),)
    )


# ----------------------------------------------------------------------------------- torch.compile

COMPILED_CALLS = {
    "softmax": lambda x: lowp_ops.softmax(x, -1),
    "log_softmax_dim0_zero": lambda x: lowp_ops.log_softmax(x, 0, masked_rows="zero"),
    "softmax_dim1_zero": lambda x: lowp_ops.softmax(x, 1, masked_rows="zero"),
    "logsumexp_keepdim": lambda x: lowp_ops.logsumexp(x, 1, keepdim=True),
}


@pytest.mark.parametrize("name", list(COMPILED_CALLS))
def test_compiled_forward_backward_is_one_graph_without_recompiles(name):
    fn = COMPILED_CALLS[name]
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)
    for step, shape in enumerate([(3, 6, 50), (5, 7, 77), (9, 4, 129)]):
        gen = torch.Generator().manual_seed(step)
        x = (torch.randn(shape, generator=gen) * 3).to(torch.bfloat16)
        x[0, 0] = NEG_INF
        x[1, :, :10] = NEG_INF
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            leaf = x.clone().requires_grad_()
            out = compiled(leaf)
            dy = torch.randn(out.shape, generator=gen).to(out.dtype)
            (grad,) = torch.autograd.grad(out, leaf, grad_outputs=dy)
        eager_leaf = x.clone().requires_grad_()
        want = fn(eager_leaf)
        (want_grad,) = torch.autograd.grad(want, eager_leaf, grad_outputs=dy)
        assert torch.equal(bits(out.detach()), bits(want.detach()))
        assert torch.equal(bits(grad), bits(want_grad))
    assert backend.frame_count == 1
    assert not counters["graph_break"]


# ------------------------------------------------------------------ CUDA graphs (one process per test)


@pytest.mark.cudagraph
def test_manual_capture_of_softmax_forward_backward_with_masked_rows_replays_like_eager():
    n_rows, n_cols = 256, 5000  # two 4096-wide blocks per row

    def inputs(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(n_rows, n_cols, generator=gen, device="cuda") * 3).to(torch.bfloat16)
        x[seed] = NEG_INF  # an all -inf row
        x[seed + 1, :4096] = NEG_INF  # a masked first block
        dy = torch.randn(n_rows, n_cols, generator=gen, device="cuda").to(torch.bfloat16)
        return x, dy

    def step(x, dy):
        x.grad = None
        probs = lowp_ops.softmax(x, masked_rows="zero")
        log_probs = lowp_ops.log_softmax(x, masked_rows="zero")
        torch.autograd.backward([probs, log_probs], [dy, dy])
        return probs, log_probs

    static_x, static_dy = inputs(0)
    static_x.requires_grad_()
    warm_up(step, static_x, static_dy)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_probs, static_log_probs = step(static_x, static_dy)

    for seed in (1, 2, 3):
        x, dy = inputs(seed)
        with torch.no_grad():
            static_x.copy_(x)
            static_dy.copy_(dy)
        graph.replay()
        eager_x = x.clone().requires_grad_()
        probs, log_probs = step(eager_x, dy)
        torch.cuda.synchronize()
        assert same_bits(static_probs.detach(), probs.detach()), f"softmax differs at replay {seed}"
        assert same_bits(static_log_probs.detach(), log_probs.detach()), (
            f"log_softmax differs at replay {seed}"
        )
        assert same_bits(static_x.grad, eager_x.grad), f"gradient differs at replay {seed}"
        assert (static_x.grad[seed] == 0).all() and (static_probs[seed] == 0).all()
