"""Cross entropy on CPU: ``lowp_ops.cross_entropy`` and ``cross_entropy_with_mxfp8_grad`` against a float64
oracle written in this suite (ce_softmax_oracles.py) and against PyTorch, masked-logit safety, ported
TransformerEngine tests (docs/cross_entropy.md#tests-ported-from-transformerengine), the
MXFP8-gradient byte contract, argument errors, ``opcheck`` and ``torch.compile``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from ce_softmax_oracles import (
    assert_close_fp32,
    assert_within_ulps,
    bits,
    ce_grad_fp32_slack,
    ce_loss_fp32_atol,
    cross_entropy_oracle,
)
from cudagraph_checks import ce_inputs, same_bits, warm_up
from hypothesis import given, settings
from hypothesis import strategies as st
from partition_checks import lowp_ops_in_compiled_graphs
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import lowp_ops
from lowp_ops.reference.cross_entropy import cross_entropy_fwd as reference_fwd
from lowp_ops.reference.cross_entropy import cross_entropy_grad_fp32 as reference_grad_fp32

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("none", "mean", "sum")
LAYOUTS = ("contiguous", "transposed", "column_slice", "row_step", "3d", "3d_swapped")
NEG_INF = float("-inf")
ARG_ERRORS = (RuntimeError, ValueError, TypeError)


# ------------------------------------------------------------------------------------------ inputs


@dataclass
class Case:
    logits: torch.Tensor  # (..., V), any of LAYOUTS
    target: torch.Tensor  # logits.shape[:-1], int32 or int64
    grad_loss: torch.Tensor  # the loss's shape: 0-d for mean/sum
    label_smoothing: float
    ignore_index: int
    reduction: str

    def kwargs(self) -> dict:
        return {
            "label_smoothing": self.label_smoothing,
            "ignore_index": self.ignore_index,
            "reduction": self.reduction,
        }


def lay_out(values: torch.Tensor, lead: tuple[int, ...], layout: str) -> torch.Tensor:
    """The (N, V) ``values`` as a (lead..., V) tensor with the memory layout ``layout`` (same values)."""
    n_rows, n_cols = values.shape
    if layout == "transposed":  # column-major: stride(-1) != 1
        return values.t().contiguous().t()
    if layout == "column_slice":  # rows padded on both sides: stride(0) = V + 3
        base = torch.full((n_rows, n_cols + 3), 7.0, dtype=values.dtype)
        base[:, 2 : n_cols + 2] = values
        return base[:, 2 : n_cols + 2]
    if layout == "row_step":  # every other row of a bigger buffer
        base = torch.full((2 * n_rows, n_cols), -7.0, dtype=values.dtype)
        base[::2] = values
        return base[::2]
    if layout == "3d":
        return values.view(*lead, n_cols)
    if layout == "3d_swapped":  # (B, S, V) view of (S, B, V) memory, as TE's swapped input
        return values.view(*lead, n_cols).transpose(0, 1).contiguous().transpose(0, 1)
    return values


def make_values(
    gen: torch.Generator,
    n_rows: int,
    n_cols: int,
    *,
    scale: float,
    mask_p: float,
    masked_row_p: float,
    mask_targets: bool,
    target: torch.Tensor,
) -> torch.Tensor:
    values = torch.randn(n_rows, n_cols, generator=gen) * scale
    values[torch.rand(n_rows, n_cols, generator=gen) < mask_p] = NEG_INF
    if not mask_targets:
        rows = torch.arange(n_rows)
        in_range = (target >= 0) & (target < n_cols)
        values[rows[in_range], target[in_range]] = torch.randn(int(in_range.sum()), generator=gen) * scale
    values[torch.rand(n_rows, generator=gen) < masked_row_p] = NEG_INF
    return values


@st.composite
def ce_cases(draw, max_rows: int = 64, max_cols: int = 700) -> Case:
    layout = draw(st.sampled_from(LAYOUTS))
    if layout.startswith("3d"):
        lead = (draw(st.integers(1, 4)), draw(st.integers(1, max_rows // 4)))
    else:
        lead = (draw(st.integers(1, max_rows)),)
    n_rows, n_cols = math.prod(lead), draw(st.integers(1, max_cols))
    dtype = draw(st.sampled_from(DTYPES))
    reduction = draw(st.sampled_from(REDUCTIONS))
    ignore_index = draw(st.sampled_from([-100, -1, 3]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))

    target = torch.randint(0, n_cols, (n_rows,), generator=gen)
    target[torch.rand(n_rows, generator=gen) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = ignore_index
    values = make_values(
        gen,
        n_rows,
        n_cols,
        scale=draw(st.sampled_from([0.5, 4.0, 20.0])),
        mask_p=draw(st.sampled_from([0.0, 0.0, 0.3, 0.97])),
        masked_row_p=draw(st.sampled_from([0.0, 0.0, 0.2])),
        mask_targets=draw(st.booleans()),
        target=target,
    )
    target_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    loss_shape = lead if reduction == "none" else ()
    return Case(
        logits=lay_out(values.to(dtype), lead, layout),
        target=target.view(lead).to(target_dtype),
        grad_loss=torch.randn(loss_shape, generator=gen) * draw(st.sampled_from([1.0, 1e-3, 300.0])),
        # Not below fp32's range: the op multiplies in fp32, where a tiny ls is 0 (and 0 * inf is NaN).
        label_smoothing=draw(st.one_of(st.just(0.0), st.just(0.1), st.just(1.0), st.floats(1e-6, 1.0))),
        ignore_index=ignore_index,
        reduction=reduction,
    )


def loss_and_grad(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of lowp_ops.cross_entropy and the logits' gradient for upstream ``case.grad_loss``."""
    logits = case.logits.detach().requires_grad_()
    loss = lowp_ops.cross_entropy(logits, case.target, **case.kwargs(), classes_last=True)
    (grad,) = torch.autograd.grad(loss, logits, grad_outputs=case.grad_loss)
    return loss.detach(), grad


def assert_matches_oracle(case: Case, loss: torch.Tensor, grad: torch.Tensor) -> None:
    want_loss, want_grad, row_weight = cross_entropy_oracle(
        case.logits, case.target, case.grad_loss, **case.kwargs()
    )
    assert loss.dtype == torch.float32 and loss.shape == want_loss.shape
    row_atol = ce_loss_fp32_atol(case.logits)
    atol = row_atol * case.target.numel() if case.reduction == "sum" else row_atol
    assert_close_fp32(loss, want_loss, rtol=1e-5, atol=atol, what="loss")

    assert grad.dtype == case.logits.dtype and grad.shape == case.logits.shape
    slack = ce_grad_fp32_slack(case.logits, row_weight)
    if case.logits.dtype == torch.float32:
        assert_close_fp32(grad, want_grad, rtol=1e-5, atol=slack, what="grad")
    else:
        assert_within_ulps(grad, want_grad, ulps=1, slack=slack, what="grad")


# ----------------------------------------------------------------------------- property: the oracle


@settings(max_examples=300)
@given(case=ce_cases())
def test_loss_and_grad_match_float64_oracle(case):
    logits_bits = bits(case.logits).clone()
    loss, grad = loss_and_grad(case)
    assert torch.equal(bits(case.logits), logits_bits), "the logits were modified"
    assert_matches_oracle(case, loss, grad)


@settings(max_examples=60)
@given(case=ce_cases(max_rows=16, max_cols=64))
def test_finite_rows_match_torch_cross_entropy(case):
    """Where PyTorch is well defined (no all -inf non-ignored row), loss and gradient agree with it."""
    logits64 = case.logits.detach().double().reshape(-1, case.logits.shape[-1])
    target = case.target.reshape(-1).long()
    all_masked = (logits64 == NEG_INF).all(dim=1) | (target == case.ignore_index)
    logits64 = torch.where(all_masked.unsqueeze(1), 0.0, logits64).requires_grad_()
    clean = Case(
        logits64.detach().to(case.logits.dtype).view(case.logits.shape),
        case.target,
        case.grad_loss,
        case.label_smoothing,
        case.ignore_index,
        case.reduction,
    )
    loss, grad = loss_and_grad(clean)
    want = F.cross_entropy(logits64, target, **case.kwargs())
    want = want.view(case.target.shape) if case.reduction == "none" else want
    (want_grad,) = torch.autograd.grad(want, logits64, grad_outputs=case.grad_loss.double())
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-4, equal_nan=True)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[case.logits.dtype]
    scale = float(case.grad_loss.abs().max()) if case.grad_loss.numel() else 1.0
    torch.testing.assert_close(
        grad.double(), want_grad.view(grad.shape), rtol=tol, atol=tol * scale, equal_nan=True
    )


# ------------------------------------------------------------------------------------ masked logits


@pytest.mark.parametrize("prefix", [4096, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_with_all_minus_inf_leading_columns_are_exact(prefix, dtype):
    gen = torch.Generator().manual_seed(prefix)
    n_cols = prefix + 37
    values = torch.randn(4, n_cols, generator=gen) * 3
    values[0, :prefix] = NEG_INF  # the whole first block(s) masked
    values[1, : prefix + 36] = NEG_INF  # only the last column is finite
    values[2, 1 : prefix + 1] = NEG_INF
    target = torch.tensor([prefix + 5, prefix + 36, 0, 17])
    for reduction in ("none", "mean"):
        grad_loss = torch.rand(4, generator=gen) if reduction == "none" else torch.tensor(1.7)
        case = Case(values.to(dtype), target, grad_loss, 0.0, -100, reduction)
        loss, grad = loss_and_grad(case)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        assert_matches_oracle(case, loss, grad)
        # The same rows restricted to their finite columns give the same loss.
        if reduction == "none":
            tail = lowp_ops.cross_entropy(
                values[:2, prefix:].to(dtype), target[:2] - prefix, reduction="none", classes_last=True
            )
            torch.testing.assert_close(loss[:2], tail, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_minus_inf_at_target_gives_inf_loss_and_finite_grad(label_smoothing):
    values = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([4, 9, 0])
    values[0, 4] = NEG_INF
    case = Case(values, target, torch.tensor([0.5, -1.0, 2.0]), label_smoothing, -100, "none")
    loss, grad = loss_and_grad(case)
    assert loss[0] == float("inf") and torch.isfinite(loss[1:]).all()
    assert torch.isfinite(grad).all()
    assert_matches_oracle(case, loss, grad)
    torch.testing.assert_close(
        loss, F.cross_entropy(values, target, reduction="none", label_smoothing=label_smoothing)
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_masked_row_gives_nan_like_torch(reduction):
    values = torch.randn(4, 33, generator=torch.Generator().manual_seed(2))
    values[1] = NEG_INF
    target = torch.tensor([3, 5, 7, 32])
    ours = values.clone().requires_grad_()
    theirs = values.clone().requires_grad_()
    loss = lowp_ops.cross_entropy(ours, target, reduction=reduction, classes_last=True)
    want = F.cross_entropy(theirs, target, reduction=reduction)
    torch.testing.assert_close(loss, want, equal_nan=True)
    assert loss.isnan().any()
    loss.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, equal_nan=True)
    assert ours.grad[1].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignored_all_masked_row_has_zero_loss_and_exactly_zero_grad(dtype, reduction):
    """PyTorch gives a NaN gradient for this row; the contract is 0 loss and an exact 0 gradient."""
    values = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    values[1] = NEG_INF
    target = torch.tensor([3, -100, 39])
    grad_loss = torch.tensor([1.0, 5.0, -2.0]) if reduction == "none" else torch.tensor(3.0)
    case = Case(values.to(dtype), target, grad_loss, 0.1, -100, reduction)
    loss, grad = loss_and_grad(case)
    assert torch.isfinite(loss).all()
    if reduction == "none":
        assert loss[1].item() == 0.0
    assert torch.equal(bits(grad[1]), torch.zeros_like(bits(grad[1]))), "not an exact +0 gradient"
    assert torch.isfinite(grad).all()
    assert_matches_oracle(case, loss, grad)


def test_all_rows_ignored_mean_is_nan_like_torch_with_zero_grad():
    values = torch.randn(5, 20, generator=torch.Generator().manual_seed(4))
    target = torch.full((5,), -100)
    case = Case(values, target, torch.tensor(1.0), 0.0, -100, "mean")
    loss, grad = loss_and_grad(case)
    assert loss.isnan() and F.cross_entropy(values, target).isnan()
    assert torch.equal(grad, torch.zeros_like(grad))


def test_out_of_range_target_gives_nan_loss_and_nan_grad_row():
    """Documented: a target outside [0, V) that is not ignore_index makes that row's loss and gradient
    NaN (checked on device, without a host sync); the other rows are unaffected."""
    values = torch.randn(4, 10, generator=torch.Generator().manual_seed(5))
    target = torch.tensor([10, 2, -3, -100])
    case = Case(values, target, torch.ones(4), 0.0, -100, "none")
    loss, grad = loss_and_grad(case)
    assert loss[0].isnan() and loss[2].isnan() and loss[3] == 0.0
    assert grad[0].isnan().all() and grad[2].isnan().all() and torch.equal(grad[3], torch.zeros(10))
    good = Case(values[1:2], target[1:2], torch.ones(1), 0.0, -100, "none")
    assert_matches_oracle(good, loss[1:2], grad[1:2])
    assert lowp_ops.cross_entropy(values, target, classes_last=True).isnan()


# --------------------------------------------------------------------------- memory: what is saved


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_backward_saves_only_logits_target_and_row_stats(reduction):
    n_rows, n_cols = 15, 301
    logits = torch.randn(3, 5, n_cols).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, n_cols, (3, 5))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = lowp_ops.cross_entropy(
            logits, target, reduction=reduction, label_smoothing=0.1, classes_last=True
        )
    big = [t for t in saved if t.numel() >= n_rows * n_cols]
    assert len(big) == 1, f"expected only the logits to be saved at full size, got {[t.shape for t in big]}"
    assert big[0].dtype == torch.bfloat16 and big[0].data_ptr() == logits.data_ptr(), "logits copied"
    assert any(t.dtype == torch.float32 and tuple(t.shape) == (2, n_rows) for t in saved), "no fp32 row stats"
    assert any(t.dtype == torch.int64 and t.numel() == n_rows for t in saved), "target not saved"
    small = [t for t in saved if t.numel() < n_rows * n_cols]
    assert sum(t.numel() * t.element_size() for t in small) <= n_rows * (8 + 8) + 64
    loss.sum().backward()


# ----------------------------------------------------------------- TransformerEngine tests

TE_TOLS = {torch.float32: {"rtol": 1.3e-6, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5}}


def run_te_case(dtype, *, swapped, label_smoothing, reduce_loss, ignore, seed):
    """TE's harness at CPU sizes: rand logits, squared loss, PyTorch float64 reference
    (docs/cross_entropy.md#tests-ported-from-transformerengine)."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq = (1, 2)[seed % 2], (8, 16)[seed // 2 % 2]
    vocab = (2048, 4099)[seed % 2]
    shape = (seq, batch, vocab) if swapped else (batch, seq, vocab)
    logits = torch.rand(shape, generator=gen).to(dtype)
    target = torch.randint(0, vocab, shape[:2], generator=gen)
    if ignore:
        positions = torch.randperm(seq - 1, generator=gen)[:5]
        if swapped:
            target[positions, 0] = -100
        else:
            target[0, positions] = -100
    reduction = "mean" if reduce_loss else "none"

    ours = logits.clone().requires_grad_()
    loss = lowp_ops.cross_entropy(
        ours, target, label_smoothing=label_smoothing, reduction=reduction, classes_last=True
    )
    torch.square(loss).sum().backward()

    ref_logits = logits.double().reshape(-1, vocab).requires_grad_()
    ref = torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing, reduction=reduction)(
        ref_logits, target.reshape(-1)
    )
    ref = ref.view(target.shape) if reduction == "none" else ref
    torch.square(ref).sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), **TE_TOLS[dtype])
    torch.testing.assert_close(ours.grad.double(), ref_logits.grad.view(shape), **TE_TOLS[dtype])
    assert torch.equal(logits, ours.detach()), "the logits were modified"


@pytest.mark.parametrize("seed", range(2))
def test_te_float32_input(seed):
    run_te_case(torch.float32, swapped=False, label_smoothing=0.0, reduce_loss=True, ignore=False, seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_te_bfloat16_input(seed):
    run_te_case(torch.bfloat16, swapped=False, label_smoothing=0.0, reduce_loss=True, ignore=False, seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_te_swapped_input(seed):
    run_te_case(torch.float32, swapped=True, label_smoothing=0.0, reduce_loss=True, ignore=False, seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_te_label_smoothing(seed):
    run_te_case(torch.float32, swapped=False, label_smoothing=0.1, reduce_loss=True, ignore=False, seed=seed)


def test_te_non_reduced_loss():
    run_te_case(torch.float32, swapped=False, label_smoothing=0.0, reduce_loss=False, ignore=False, seed=0)


@pytest.mark.parametrize("seed", range(4))
def test_te_ignore_idx(seed):
    run_te_case(
        torch.float32, swapped=bool(seed % 2), label_smoothing=0.0, reduce_loss=False, ignore=True, seed=seed
    )


@pytest.mark.parametrize("seed", range(4))
def test_te_ignore_idx_reduced_loss(seed):
    run_te_case(
        torch.float32, swapped=bool(seed % 2), label_smoothing=0.0, reduce_loss=True, ignore=True, seed=seed
    )


def test_te_non_contiguous_transposed_input():
    s, b, v = 4, 2, 8
    logits = torch.randn(s, b, v, generator=torch.Generator().manual_seed(6)).transpose(0, 1)
    assert not logits.is_contiguous() and logits.stride(-2) != v
    target = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(7))
    strided = logits.clone(memory_format=torch.preserve_format).requires_grad_()
    dense = logits.contiguous().requires_grad_()
    loss_strided = lowp_ops.cross_entropy(strided, target, classes_last=True)
    loss_dense = lowp_ops.cross_entropy(dense, target, classes_last=True)
    torch.testing.assert_close(loss_strided, loss_dense)
    loss_strided.backward()
    loss_dense.backward()
    torch.testing.assert_close(strided.grad, dense.grad)


def test_te_bfloat16_unreduced_external_grad_is_rounded_once():
    """bf16 zero logits, one ignored row, a per-token upstream gradient: the bf16 gradient is exactly
    bf16(fp32 gradient with the upstream gradient applied), i.e. rounded once
    (docs/cross_entropy.md#loss-and-gradient)."""
    logits = torch.zeros(2, 2, 3, dtype=torch.bfloat16, requires_grad=True)
    target = torch.tensor([[0, 1], [2, -100]])
    external = torch.tensor([[0.01, 0.03], [0.1, 0.7]])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = lowp_ops.cross_entropy(logits, target, reduction="none", classes_last=True)
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= logits.numel()]
    loss.backward(external)
    assert torch.equal(logits.detach(), torch.zeros_like(logits)), "the logits were modified"

    logits2d, target1d = logits.detach().view(4, 3), target.view(4)
    _, lse = reference_fwd(logits2d, target1d, 0.0, -100)
    grad_fp32 = reference_grad_fp32(logits2d, target1d, lse, external.view(4), 0.0, -100)
    assert torch.equal(bits(logits.grad), bits(grad_fp32.to(torch.bfloat16).view(2, 2, 3)))
    _, oracle_grad, _ = cross_entropy_oracle(
        logits, target, external, label_smoothing=0.0, ignore_index=-100, reduction="none"
    )
    assert torch.equal(bits(logits.grad), bits(oracle_grad.to(torch.bfloat16)))


def test_te_bfloat16_loss_matches_float32_input():
    logits = torch.randn(1, 64, 4096, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    target = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(9))
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(
        lowp_ops.cross_entropy(logits, target, classes_last=True),
        lowp_ops.cross_entropy(logits.float(), target, classes_last=True),
        rtol=2 * eps,
        atol=2 * eps,
    )


# ----------------------------------------------------------------------- the MXFP8 gradient contract

PAYLOAD_FIELDS = ("row_data", "row_scale", "col_data", "col_scale")
COPIES = [(True, True), (True, False), (False, True)]


def quantized_autograd_grad(case: Case, fp8_dtype, rowwise, columnwise, scale_layout):
    """(loss, mxfp8_quantize(<the gradient cross_entropy's backward returns for case.grad_loss>))."""
    loss, grad = loss_and_grad(case)
    return loss, lowp_ops.mxfp8_quantize(grad, fp8_dtype, rowwise, columnwise, scale_layout)


def assert_same_payload(got, want) -> None:
    assert (got.fp8_dtype, got.scale_layout, tuple(got.shape)) == (
        want.fp8_dtype,
        want.scale_layout,
        tuple(want.shape),
    )
    for field in PAYLOAD_FIELDS:
        got_t, want_t = getattr(got, field), getattr(want, field)
        assert (got_t is None) == (want_t is None), field
        if want_t is not None:
            assert got_t.dtype == want_t.dtype and got_t.shape == want_t.shape, field
            assert torch.equal(got_t.view(torch.uint8), want_t.view(torch.uint8)), f"{field} bytes differ"


def assert_fused_equals_quantized_grad(
    case: Case, fp8_dtype, rowwise, columnwise, scale_layout, pass_grad_loss=True
) -> None:
    logits_bits = bits(case.logits).clone()
    loss, payload = lowp_ops.cross_entropy_with_mxfp8_grad(
        case.logits,
        case.target,
        case.grad_loss if pass_grad_loss else None,
        fp8_dtype=fp8_dtype,
        rowwise=rowwise,
        columnwise=columnwise,
        scale_layout=scale_layout,
        **case.kwargs(),
    )
    assert torch.equal(bits(case.logits), logits_bits), "the logits were modified"
    if not pass_grad_loss:
        case = Case(
            case.logits,
            case.target,
            torch.ones_like(case.grad_loss),
            case.label_smoothing,
            case.ignore_index,
            case.reduction,
        )
    want_loss, want = quantized_autograd_grad(case, fp8_dtype, rowwise, columnwise, scale_layout)
    assert not loss.requires_grad
    assert torch.equal(bits(loss), bits(want_loss)), "loss differs from cross_entropy's"
    assert_same_payload(payload, want)


def fixed_mxfp8_case(dtype=torch.bfloat16, reduction="none", label_smoothing=0.1) -> Case:
    """(3, 23, 301) logits (odd N = 69 and V), ignored rows, an all -inf ignored row, -inf masks."""
    gen = torch.Generator().manual_seed(10)
    n_rows, n_cols = 69, 301
    target = torch.randint(0, n_cols, (n_rows,), generator=gen)
    target[::7] = -100
    values = make_values(
        gen, n_rows, n_cols, scale=4.0, mask_p=0.2, masked_row_p=0.0, mask_targets=False, target=target
    )
    values[7] = NEG_INF
    values[8, :200] = NEG_INF
    shape = (n_rows,) if reduction == "none" else ()
    return Case(
        values.to(dtype).view(3, 23, n_cols),
        target.view(3, 23),
        (torch.rand(shape, generator=gen) - 0.3).view(3, 23) if shape else torch.tensor(0.37),
        label_smoothing,
        -100,
        reduction,
    )


@pytest.mark.parametrize("scale_layout", ["compact", "swizzled"])
@pytest.mark.parametrize("fp8_dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize(("rowwise", "columnwise"), COPIES)
def test_mxfp8_grad_is_bytes_of_quantized_grad(fp8_dtype, scale_layout, rowwise, columnwise):
    for reduction in REDUCTIONS:
        case = fixed_mxfp8_case(reduction=reduction)
        assert_fused_equals_quantized_grad(case, fp8_dtype, rowwise, columnwise, scale_layout)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_mxfp8_grad_default_grad_loss_is_ones(reduction):
    case = fixed_mxfp8_case(reduction=reduction, label_smoothing=0.0)
    assert_fused_equals_quantized_grad(case, "e4m3", True, True, "compact", pass_grad_loss=False)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_mxfp8_grad_returns_a_detached_loss_of_the_same_bytes(reduction):
    """Logits and ``grad_loss`` that require grad record no graph (the loss has no ``grad_fn``) and give
    the bytes of the same call on detached inputs."""
    case = fixed_mxfp8_case(reduction=reduction)
    logits, grad_loss = case.logits.clone().requires_grad_(), case.grad_loss.clone().requires_grad_()
    loss, payload = lowp_ops.cross_entropy_with_mxfp8_grad(logits, case.target, grad_loss, **case.kwargs())
    want_loss, want = lowp_ops.cross_entropy_with_mxfp8_grad(
        case.logits, case.target, case.grad_loss, **case.kwargs()
    )
    assert loss.grad_fn is None and not loss.requires_grad
    assert torch.equal(loss.view(torch.int32), want_loss.view(torch.int32))
    for field in ("row_data", "row_scale", "col_data", "col_scale"):
        got, expected = getattr(payload, field), getattr(want, field)
        assert not got.requires_grad and torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", ["e4m3", "e5m2"])
def test_mxfp8_grad_dequantizes_close_to_the_oracle_gradient(fp8_dtype):
    """Independent of the byte contract: the row-wise copy is the oracle gradient within FP8 precision."""
    case = fixed_mxfp8_case(dtype=torch.float32)
    _, payload = lowp_ops.cross_entropy_with_mxfp8_grad(
        case.logits, case.target, case.grad_loss, fp8_dtype=fp8_dtype, **case.kwargs()
    )
    _, want, _ = cross_entropy_oracle(case.logits, case.target, case.grad_loss, **case.kwargs())
    fp8_max, mantissa_bits, min_exp = {"e4m3": (448.0, 3, -9), "e5m2": (57344.0, 2, -16)}[fp8_dtype]
    for use in ("rowwise", "columnwise"):
        got = lowp_ops.mxfp8_dequantize(payload, torch.float32, use=use).double()
        # Per row: relative half-ulp of the format, plus the absolute floor of the largest block scale.
        row_amax = want.abs().amax(dim=-1, keepdim=True) if use == "rowwise" else want.abs().amax()
        floor = 2 * row_amax / fp8_max * 2.0**min_exp
        assert ((got - want).abs() <= 2.0 ** -(mantissa_bits + 1) * want.abs() * 1.01 + floor).all(), use


@settings(max_examples=100)
@given(
    case=ce_cases(max_rows=80, max_cols=300),
    fp8_dtype=st.sampled_from(["e4m3", "e5m2"]),
    scale_layout=st.sampled_from(["compact", "swizzled"]),
    copies=st.sampled_from(COPIES),
)
def test_mxfp8_grad_is_bytes_of_quantized_grad_property(case, fp8_dtype, scale_layout, copies):
    assert_fused_equals_quantized_grad(case, fp8_dtype, *copies, scale_layout)


@pytest.mark.parametrize(("reduction", "bad_shape"), [("mean", (69,)), ("none", ()), ("none", (69,))])
def test_mxfp8_grad_rejects_grad_loss_of_wrong_shape(reduction, bad_shape):
    case = fixed_mxfp8_case(reduction=reduction)
    with pytest.raises(ARG_ERRORS, match="grad_loss"):
        lowp_ops.cross_entropy_with_mxfp8_grad(
            case.logits, case.target, torch.ones(bad_shape), reduction=reduction
        )


# ----------------------------------------------------------------------------------- bad arguments

BAD_CALLS = {
    "float target": (
        lambda x, t: lowp_ops.cross_entropy(x, t.float(), classes_last=True),
        "class probabilities",
    ),
    "wrong target shape": (
        lambda x, t: lowp_ops.cross_entropy(x, t[:-1], classes_last=True),
        "target must have shape",
    ),
    "target of logits' shape": (
        lambda x, t: lowp_ops.cross_entropy(x, x.long(), classes_last=True),
        "target",
    ),
    "int logits": (lambda x, t: lowp_ops.cross_entropy(x.long(), t, classes_last=True), "logits"),
    "label_smoothing 1.5": (
        lambda x, t: lowp_ops.cross_entropy(x, t, label_smoothing=1.5, classes_last=True),
        "label_smoothing",
    ),
    "label_smoothing -0.1": (
        lambda x, t: lowp_ops.cross_entropy(x, t, label_smoothing=-0.1, classes_last=True),
        "label_smoothing",
    ),
    "reduction avg": (
        lambda x, t: lowp_ops.cross_entropy(x, t, reduction="avg", classes_last=True),
        "reduction",
    ),
    "process_group": (
        lambda x, t: lowp_ops.cross_entropy(x, t, process_group=object(), classes_last=True),
        "process_group",
    ),
    "mxfp8 float target": (lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t.float()), "target"),
    "mxfp8 label_smoothing": (
        lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t, label_smoothing=1.5),
        "label_smoothing",
    ),
    "mxfp8 reduction": (
        lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t, reduction="avg"),
        "reduction",
    ),
    "fp8_dtype e2m1": (
        lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t, fp8_dtype="e2m1"),
        "fp8_dtype",
    ),
    "scale_layout": (
        lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t, scale_layout="tiled"),
        "scale_layout",
    ),
    "no copy": (
        lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t, rowwise=False, columnwise=False),
        "rowwise",
    ),
    # A truthy non-bool would be taken as True (a string "False" included): refused instead.
    "classes_last str": (
        lambda x, t: lowp_ops.cross_entropy(x, t, classes_last="False"),
        "classes_last must be a bool",
    ),
    "mxfp8 rowwise str": (
        lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t, rowwise="no"),
        "rowwise must be a bool",
    ),
    "mxfp8 columnwise int": (
        lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t, columnwise=0),
        "columnwise must be a bool",
    ),
}


def test_a_rank_outside_the_process_group_is_told_so():
    """``new_group`` returns ``GroupMember.NON_GROUP_MEMBER`` (an int) on the ranks it leaves out."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match="this process is not a member of the group"):
        lowp_ops.cross_entropy(
            torch.randn(4, 8),
            torch.zeros(4, dtype=torch.int64),
            process_group=dist.GroupMember.NON_GROUP_MEMBER,
        )


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_naming_the_argument(name):
    call, message = BAD_CALLS[name]
    logits = torch.randn(6, 10)
    target = torch.randint(0, 10, (6,))
    with pytest.raises(NotImplementedError if name == "process_group" else ARG_ERRORS, match=message):
        call(logits, target)


# ------------------------------------------------------------------------------------------ opcheck


def opcheck_inputs(dtype, layout, seed=11):
    gen = torch.Generator().manual_seed(seed)
    n_rows, n_cols = 37, 75
    target = torch.randint(0, n_cols, (n_rows,), generator=gen)
    target[::5] = -100
    values = make_values(
        gen, n_rows, n_cols, scale=3.0, mask_p=0.1, masked_row_p=0.0, mask_targets=False, target=target
    )
    values[5] = NEG_INF  # ignored (target[5] = -100) and fully masked
    logits = values.to(dtype)
    if layout == "permuted":
        logits = logits.t().contiguous().t()
    return logits, target


def grad_rows_for(kind, n_rows):
    if kind == "expanded":  # a stride-0 view, as autograd hands in for sum/mean
        return torch.tensor(0.25).expand(n_rows)
    return torch.rand(n_rows, generator=torch.Generator().manual_seed(12)) - 0.5


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_opcheck_cross_entropy_fwd(requires_grad, layout, dtype, label_smoothing):
    logits, target = opcheck_inputs(dtype, layout)
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_fwd.default,
        (logits.requires_grad_(requires_grad), target, label_smoothing, -100),
    )


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_cross_entropy_reduced(mean, layout, dtype):
    logits, target = opcheck_inputs(dtype, layout)
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_reduced.default,
        (logits.requires_grad_(), target, 0.1, -100, mean, None, 1e-3, 0.0),
    )


def test_compiled_loss_is_one_op_each_way():
    """A compiled mean cross entropy calls ``cross_entropy_reduced`` in its forward and ``cross_entropy_bwd``
    in its backward: one opaque call each (docs/dispatch.md)."""
    logits, target = opcheck_inputs(torch.bfloat16, "contiguous")
    compiled, ops = lowp_ops_in_compiled_graphs(lambda x, t: lowp_ops.cross_entropy(x, t))
    compiled(logits.requires_grad_(), target).backward()
    assert ops == [["lowp.cross_entropy_reduced.default"], ["lowp.cross_entropy_bwd.default"]]


@pytest.mark.parametrize("grad_rows_kind", ["dense", "expanded"])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_cross_entropy_bwd(grad_rows_kind, layout, dtype):
    logits, target = opcheck_inputs(dtype, layout)
    _, lse = torch.ops.lowp.cross_entropy_fwd(logits, target, 0.1, -100)
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_bwd.default,
        (logits, target, lse, grad_rows_for(grad_rows_kind, logits.shape[0]), 0.1, -100),
    )


@pytest.mark.parametrize(("rowwise", "columnwise"), COPIES)
@pytest.mark.parametrize("scale_layout", ["compact", "swizzled"])
@pytest.mark.parametrize("fp8_dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize(("layout", "grad_rows_kind"), [("contiguous", "dense"), ("permuted", "expanded")])
def test_opcheck_cross_entropy_bwd_mxfp8(
    rowwise, columnwise, scale_layout, fp8_dtype, layout, grad_rows_kind
):
    logits, target = opcheck_inputs(torch.bfloat16, layout)
    _, lse = torch.ops.lowp.cross_entropy_fwd(logits, target, 0.1, -100)
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_bwd_mxfp8.default,
        (
            logits,
            target,
            lse,
            grad_rows_for(grad_rows_kind, logits.shape[0]),
            0.1,
            -100,
            fp8_dtype,
            rowwise,
            columnwise,
            scale_layout,
        ),
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("with_grad_loss", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_opcheck_cross_entropy_mxfp8_grad(reduction, with_grad_loss, layout):
    logits, target = opcheck_inputs(torch.bfloat16, layout)
    grad_loss = None
    if with_grad_loss:
        grad_loss = torch.full((logits.shape[0],) if reduction == "none" else (), 0.75)
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_mxfp8_grad.default,
        (logits, target, grad_loss, 0.1, -100, reduction, "e4m3", True, True, "swizzled"),
    )


def mxfp8_grad_op_equals_its_three_ops(device: str) -> None:
    """``lowp::cross_entropy_mxfp8_grad`` gives the bytes of ``cross_entropy_fwd``, ``cross_entropy_reduce``
    and ``cross_entropy_bwd_mxfp8`` called in turn (the public function's path before it was one op),
    for each reduction, with and without ``grad_loss``, class weights, E5M2, one copy."""
    from lowp_ops import library

    logits, target = (t.to(device) for t in opcheck_inputs(torch.bfloat16, "contiguous"))
    rows, cols = logits.shape
    weight = torch.rand(cols, generator=torch.Generator().manual_seed(5)).to(device) + 0.5
    for reduction, grad_loss, fp8, copies, class_weight in (
        ("mean", None, "e4m3", (True, True), None),
        ("sum", torch.tensor(0.3), "e5m2", (True, False), None),
        ("none", torch.linspace(-1, 2, rows), "e4m3", (False, True), None),
        ("mean", torch.tensor(2.5), "e4m3", (True, True), weight),
    ):
        grad_loss = None if grad_loss is None else grad_loss.to(device)
        options = (0.1, -100)
        loss_rows, stats = library.cross_entropy_fwd(logits, target, *options, class_weight)
        if reduction == "none":
            loss, grad_rows = loss_rows, grad_loss.float()
        else:
            loss, scale = library.cross_entropy_reduce(
                loss_rows, target, -100, reduction == "mean", class_weight
            )
            grad_rows = (scale if grad_loss is None else grad_loss.float() * scale).expand(rows)
        want = (loss, stats, *library.cross_entropy_bwd_mxfp8(
            logits, target, stats, grad_rows, *options, fp8, *copies, "compact", 0, 0, class_weight
        ))  # fmt: skip
        got = library.cross_entropy_mxfp8_grad(
            logits, target, grad_loss, *options, reduction, fp8, *copies, "compact", class_weight
        )
        names = ("loss", "stats", "row_data", "row_scale", "col_data", "col_scale")
        for name, a, b in zip(names, got, want, strict=True):
            assert a.shape == b.shape and torch.equal(a, b), (reduction, name)


def test_mxfp8_grad_op_equals_its_three_ops():
    mxfp8_grad_op_equals_its_three_ops("cpu")


@pytest.mark.interp
def test_interp_mxfp8_grad_op_equals_its_three_ops():
    mxfp8_grad_op_equals_its_three_ops("cpu")


@pytest.mark.gpu
def test_gpu_mxfp8_grad_op_equals_its_three_ops():
    mxfp8_grad_op_equals_its_three_ops("cuda")


# ----------------------------------------------------------------------------------- torch.compile

COMPILE_SHAPES = {"2d": [(8, 50), (13, 77), (32, 129)], "3d": [(2, 4, 50), (3, 5, 77), (4, 8, 129)]}


def compile_inputs(shape, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=gen) * 3).to(dtype)
    logits.view(-1, shape[-1])[0, :10] = NEG_INF
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    target.view(-1)[1] = -100
    return logits, target


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("rank", ["2d", "3d"])
def test_compiled_forward_backward_is_one_graph_without_recompiles(reduction, rank):
    def loss_fn(logits, target):
        return lowp_ops.cross_entropy(
            logits, target, label_smoothing=0.1, reduction=reduction, classes_last=True
        )

    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True, dynamic=True)
    for step, shape in enumerate(COMPILE_SHAPES[rank]):
        logits, target = compile_inputs(shape, seed=step)
        grad_loss = torch.rand(shape[:-1] if reduction == "none" else ())
        case = Case(logits, target, grad_loss, 0.1, -100, reduction)
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            x = logits.clone().requires_grad_()
            loss = compiled(x, target)
            (grad,) = torch.autograd.grad(loss, x, grad_outputs=grad_loss)
        want_loss, want_grad = loss_and_grad(case)
        assert torch.equal(bits(loss.detach()), bits(want_loss))
        assert torch.equal(bits(grad), bits(want_grad))
    assert backend.frame_count == 1
    assert not counters["graph_break"]


DEFAULT_ARGUMENT_CALLS = {
    "cross_entropy": lambda x, t: lowp_ops.cross_entropy(x, t),
    "cross_entropy_with_mxfp8_grad": lambda x, t: lowp_ops.cross_entropy_with_mxfp8_grad(x, t)[0],
    "linear_cross_entropy": lambda x, t: lowp_ops.linear_cross_entropy(x, torch.ones(8, 16), t),
    "nn.CrossEntropyLoss": lowp_ops.nn.CrossEntropyLoss(),
}


@pytest.mark.parametrize("name", sorted(DEFAULT_ARGUMENT_CALLS))
def test_default_arguments_compile_once_with_dynamic_shapes(name):
    """A float default (``label_smoothing=0.0``) became a symbolic float under ``dynamic=True`` and the
    op's ``float`` argument made Dynamo restart: the backend compiled the one graph twice."""
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(DEFAULT_ARGUMENT_CALLS[name], backend=backend, fullgraph=True, dynamic=True)
    logits, target = compile_inputs((6, 16), seed=0)
    target = target.clamp(min=0, max=7)
    compiled(logits.float(), target)
    assert backend.frame_count == 1


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_compiled_mxfp8_grad_is_one_graph_without_recompiles(reduction):
    def loss_and_payload(logits, target, grad_loss):
        return lowp_ops.cross_entropy_with_mxfp8_grad(
            logits, target, grad_loss, label_smoothing=0.1, reduction=reduction, scale_layout="swizzled"
        )

    counters.clear()
    compiled = torch.compile(loss_and_payload, backend="aot_eager", fullgraph=True, dynamic=True)
    for step, shape in enumerate(COMPILE_SHAPES["2d"]):
        logits, target = compile_inputs(shape, seed=step)
        grad_loss = torch.rand(shape[:-1] if reduction == "none" else ())
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            loss, payload = compiled(logits, target, grad_loss)
        want_loss, want = loss_and_payload(logits, target, grad_loss)
        assert torch.equal(bits(loss), bits(want_loss))
        assert_same_payload(payload, want)
    assert not counters["graph_break"]


@pytest.mark.slow
def test_inductor_compiled_forward_backward_matches_eager():
    def loss_fn(logits, target):
        return lowp_ops.cross_entropy(logits, target, label_smoothing=0.1, classes_last=True)

    counters.clear()
    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=True)
    for step, shape in enumerate(COMPILE_SHAPES["2d"]):
        logits, target = compile_inputs(shape, seed=step, dtype=torch.float32)
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            x = logits.clone().requires_grad_()
            loss = compiled(x, target)
            loss.backward()
        want_loss, want_grad = loss_and_grad(Case(logits, target, torch.tensor(1.0), 0.1, -100, "mean"))
        torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, want_grad, rtol=1e-6, atol=1e-7)
    assert not counters["graph_break"]


# ----------------------------------------------------------------------------- the loss reduction op


def reduce_inputs(n_rows, n_ignored, seed=21):
    gen = torch.Generator().manual_seed(seed)
    loss_rows = torch.rand(n_rows, generator=gen) * 10
    target = torch.randint(0, 100, (n_rows,), generator=gen)
    target[torch.randperm(n_rows, generator=gen)[:n_ignored]] = -100
    loss_rows[target == -100] = 0.0  # as the forward writes them
    return loss_rows, target


@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize(("n_rows", "n_ignored"), [(40, 0), (40, 7), (40, 40), (0, 0), (1, 0)])
def test_cross_entropy_reduce_against_float64(mean, n_rows, n_ignored):
    loss_rows, target = reduce_inputs(n_rows, n_ignored)
    loss, grad_scale = torch.ops.lowp.cross_entropy_reduce(loss_rows, target, -100, mean)
    assert loss.shape == () and grad_scale.shape == () and loss.dtype == grad_scale.dtype == torch.float32
    count = n_rows - n_ignored
    if not mean:
        torch.testing.assert_close(loss.double(), loss_rows.double().sum(), rtol=1e-6, atol=0.0)
        assert grad_scale.item() == 1.0
    elif count == 0:  # PyTorch's mean over no rows
        assert math.isnan(loss.item()) and grad_scale.item() == math.inf
    else:
        torch.testing.assert_close(loss.double(), loss_rows.double().sum() / count, rtol=1e-6, atol=0.0)
        assert grad_scale.item() == torch.tensor(1.0 / count, dtype=torch.float32).item()


@pytest.mark.parametrize("mean", [True, False])
def test_opcheck_cross_entropy_reduce(mean):
    loss_rows, target = reduce_inputs(37, 5)
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_reduce.default, (loss_rows.requires_grad_(), target.int(), -100, mean)
    )


def test_cross_entropy_reduce_gradient_is_the_scale_per_row():
    loss_rows, target = reduce_inputs(37, 5)
    leaf = loss_rows.clone().requires_grad_()
    loss, _ = torch.ops.lowp.cross_entropy_reduce(leaf, target, -100, True)
    (grad,) = torch.autograd.grad(loss, leaf, grad_outputs=torch.tensor(3.0))
    assert torch.equal(grad, torch.full((37,), 3.0 * torch.tensor(1.0 / 32, dtype=torch.float32).item()))


@pytest.mark.parametrize(
    ("loss_rows", "target", "message"),
    [
        (torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.int64), "loss_rows must be"),
        (torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64), "loss_rows must be"),
        (torch.zeros(4), torch.zeros(4), "target must be int64 or int32"),
        (torch.zeros(4), torch.zeros(5, dtype=torch.int64), "target must have loss_rows' shape"),
    ],
)
def test_cross_entropy_reduce_rejects_bad_inputs(loss_rows, target, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.lowp.cross_entropy_reduce(loss_rows, target, -100, True)


# ------------------------------------------------------------------ CUDA graphs (one process per test)


@pytest.mark.cudagraph
def test_manual_capture_of_cross_entropy_forward_backward_replays_like_eager():
    def step(logits, target):
        logits.grad = None
        loss = lowp_ops.cross_entropy(
            logits, target, label_smoothing=0.1, classes_last=True
        )  # mean over non-ignored rows
        loss.backward()
        return loss

    static_logits, static_target = ce_inputs(0)
    static_logits.requires_grad_()
    warm_up(step, static_logits, static_target)
    graph = torch.cuda.CUDAGraph()
    static_logits.grad = None
    with torch.cuda.graph(graph):
        static_loss = step(static_logits, static_target)  # the gradient lands in static_logits.grad

    for seed in (1, 2, 3):
        logits, target = ce_inputs(seed)
        with torch.no_grad():
            static_logits.copy_(logits)
            static_target.copy_(target)
        graph.replay()
        eager_logits = logits.clone().requires_grad_()
        eager_loss = step(eager_logits, target)
        torch.cuda.synchronize()
        assert torch.isfinite(eager_loss)
        assert same_bits(static_loss.detach(), eager_loss.detach()), f"loss differs at replay {seed}"
        assert same_bits(static_logits.grad, eager_logits.grad), f"gradient differs at replay {seed}"


@pytest.mark.cudagraph
@pytest.mark.parametrize(
    ("n_cols", "scale_layout"),
    [(32000, "swizzled"), (50257, "compact")],  # the Triton kernel; the realigned Gluon one
)
def test_manual_capture_of_cross_entropy_with_mxfp8_grad_replays_like_eager(n_cols, scale_layout):
    def step(logits, target, grad_loss):
        return lowp_ops.cross_entropy_with_mxfp8_grad(
            logits,
            target,
            grad_loss,
            label_smoothing=0.1,
            reduction="none",
            fp8_dtype="e4m3",
            scale_layout=scale_layout,
        )

    static_logits, static_target = ce_inputs(0, n_cols=n_cols)
    static_grad_loss = torch.rand(static_target.shape, device="cuda")
    warm_up(step, static_logits, static_target, static_grad_loss)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_payload = step(static_logits, static_target, static_grad_loss)

    for seed in (1, 2, 3):
        logits, target = ce_inputs(seed, n_cols=n_cols)
        grad_loss = torch.rand(target.shape, device="cuda") - 0.5
        static_logits.copy_(logits)
        static_target.copy_(target)
        static_grad_loss.copy_(grad_loss)
        graph.replay()
        eager_loss, eager_payload = step(logits, target, grad_loss)
        torch.cuda.synchronize()
        assert same_bits(static_loss, eager_loss), f"loss differs at replay {seed}"
        for field in PAYLOAD_FIELDS:
            got, want = getattr(static_payload, field), getattr(eager_payload, field)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                f"{field} differs at replay {seed}"
            )


@pytest.mark.cudagraph
def test_reduce_overhead_cross_entropy_forward_backward_never_skips_cudagraphs():
    def loss_fn(logits, target):
        return lowp_ops.cross_entropy(logits, target, label_smoothing=0.1, classes_last=True)

    counters.clear()
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        compiled = torch.compile(loss_fn, mode="reduce-overhead", fullgraph=True)
        for seed in range(3):
            logits, target = ce_inputs(seed)
            torch.compiler.cudagraph_mark_step_begin()
            x = logits.clone().requires_grad_()
            loss = compiled(x, target)
            loss.backward()
            loss, grad = loss.detach().clone(), x.grad.clone()  # cudagraph outputs are reused next step
            eager_x = logits.clone().requires_grad_()
            eager_loss = loss_fn(eager_x, target)
            eager_loss.backward()
            torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grad, eager_x.grad)  # bf16 tolerances: the mean's division may differ
    assert counters["inductor"]["cudagraph_skips"] == 0
