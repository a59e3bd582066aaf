"""Class weights (``ce_weight=``, ``F.cross_entropy``'s ``weight=``) in ``lowp_ops.linear_cross_entropy``:
loss and gradients against float64 ``F.cross_entropy(F.linear(h, w), t, weight=)`` for every reduction,
label smoothing, ignored rows, bf16 and MXFP8 gradients and z-loss / soft-capping; the MXFP8 payload the
GEMMs consume byte for byte ``cross_entropy_with_mxfp8_grad``'s; the in-gradient schedule routing; opcheck;
compile without graph breaks; argument checks. Vocabulary-parallel: ``linear_vocab_parallel_checks``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_linear_cross_entropy import GRAD_RTOL, IGNORE, make_inputs, relative_error
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import lowp_ops
from lowp_ops.kernels import linear_cross_entropy as lce_kernels
from lowp_ops.reference import linear_cross_entropy as lce_ref

REDUCTIONS = ("mean", "sum", "none")


def class_weights(vocab: int, seed: int = 5, device="cpu") -> torch.Tensor:
    """fp32 (V,) weights in [0, 2) with some exact zeros (a zero-weight target adds nothing to the mean)."""
    weights = torch.rand(vocab, generator=torch.Generator().manual_seed(seed)) * 2
    weights[::9] = 0.0
    return weights.to(device)


def float64_oracle(h, w, target, ce_weight, grad_loss, reduction, label_smoothing, z_loss=0.0, softcap=None):
    """Float64 ``F.cross_entropy(F.linear(h64, w64), t, weight=w64c)`` (plus an unweighted ``z · lse²`` per
    non-ignored row divided by the same mean denominator, on ``c · tanh(x / c)`` logits with ``softcap``):
    (loss, dhidden, dweight)."""
    h64, w64 = h.cpu().double().requires_grad_(), w.cpu().double().requires_grad_()
    logits = F.linear(h64, w64).reshape(-1, w.shape[0])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    target, cw = target.cpu().reshape(-1), ce_weight.cpu().double()
    options = dict(weight=cw, ignore_index=IGNORE, label_smoothing=label_smoothing)
    rows = F.cross_entropy(logits, target, reduction="none", **options)
    rows = rows + z_loss * torch.logsumexp(logits, dim=1) ** 2 * (target != IGNORE)
    if reduction == "sum":
        loss = rows.sum()
    elif reduction == "mean":
        loss = rows.sum() / torch.where(target != IGNORE, cw[target.clamp(min=0)], 0.0).sum()
        if z_loss == 0.0:  # the definition itself, as a check of the oracle's denominator
            want = F.cross_entropy(logits, target, reduction="mean", **options)
            torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    else:
        loss = rows.view(h.shape[:-1])
    loss.backward(grad_loss.cpu().double())
    return loss.detach(), h64.grad, w64.grad


def ours(h, w, target, grad_loss, **kwargs):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = lowp_ops.linear_cross_entropy(h, w, target, **kwargs)
    loss.backward(grad_loss)
    return loss.detach(), h.grad, w.grad


def upstream(target, reduction, device="cpu"):
    shape = target.shape if reduction == "none" else ()
    return (torch.rand(shape, generator=torch.Generator().manual_seed(3)) + 0.5).to(device)


def check_against_float64(device, shape, dtype, reduction, grad_format, label_smoothing, chunk, **features):
    n_rows, hidden, vocab = shape
    h, w, target = make_inputs(n_rows=n_rows, hidden=hidden, vocab=vocab, dtype=dtype, device=device)
    ce_weight = class_weights(vocab, device=device)
    grad_loss = upstream(target, reduction, device)
    want_loss, want_dh, want_dw = float64_oracle(
        h, w, target, ce_weight, grad_loss, reduction, label_smoothing, **features
    )
    loss, dh, dw = ours(
        h, w, target, grad_loss, ce_weight=ce_weight, reduction=reduction, grad_format=grad_format,
        label_smoothing=label_smoothing, chunk_size=chunk, **features,
    )  # fmt: skip
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == dtype
    low = dtype != torch.float32
    # bf16 logits: each row's lse and target logit are rounded (~2^-9 relative to |logit| ~ 3).
    tolerance = dict(rtol=2e-3, atol=2e-2) if low else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.cpu().double(), want_loss, **tolerance)
    rtol = GRAD_RTOL[grad_format] if low or grad_format else 1e-5
    assert relative_error(dh.cpu(), want_dh) < rtol
    assert relative_error(dw.cpu(), want_dw) < rtol


# ------------------------------------------------------------------------------ reference (CPU ops)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("grad_format", [None, "mxfp8_e4m3", "mxfp8_e5m2"])
def test_loss_and_grads_match_float64(reduction, label_smoothing, grad_format):
    check_against_float64("cpu", (70, 48, 96), torch.bfloat16, reduction, grad_format, label_smoothing, 32)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_fp32_loss_and_grads_match_float64_tightly(reduction, label_smoothing):
    """fp32 inputs: the weighted loss and gradients to fp32 precision (a missing or misplaced weight,
    or the mean divided by the row count instead of Σ w_y, is far outside it)."""
    check_against_float64("cpu", (45, 24, 60), torch.float32, reduction, None, label_smoothing, 16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_z_loss_and_softcap_with_class_weights_match_float64(reduction):
    """The z-loss is not weighted, but the mean divides it by Σ w_y like the loss; soft-capped logits."""
    features = dict(z_loss=1e-2, softcap=4.0)
    check_against_float64("cpu", (45, 24, 60), torch.float32, reduction, None, 0.1, 16, **features)
    h, w, target = make_inputs(n_rows=45, hidden=24, vocab=60, dtype=torch.float32)
    ce_weight = class_weights(60)
    kwargs = dict(ce_weight=ce_weight, reduction=reduction, **features)
    _, z_part = lowp_ops.linear_cross_entropy(h, w, target, return_z_loss=True, **kwargs)
    logits = F.linear(h.double(), w.double())
    rows = features["z_loss"] * torch.logsumexp(4.0 * torch.tanh(logits / 4.0), dim=1) ** 2
    rows = rows * (target != IGNORE)
    want = rows if reduction == "none" else rows.sum() / ce_weight.double()[target[target != IGNORE]].sum()
    torch.testing.assert_close(z_part.double(), want, rtol=1e-5, atol=1e-7)


def test_fused_and_recomputed_schedules_agree_and_unit_weights_change_nothing():
    """mean with a gradient (gradients in the forward) against the recompute schedule (reduction none,
    then the mean by hand), and all-ones weights give the unweighted bytes."""
    h, w, target = make_inputs(n_rows=40, hidden=32, vocab=50, dtype=torch.float32)
    ce_weight = class_weights(50)
    fused, dh, dw = ours(h, w, target, torch.tensor(1.0), ce_weight=ce_weight, chunk_size=16)
    rows, dh2, dw2 = ours(
        h, w, target, torch.ones(40) / ce_weight[target[target != IGNORE]].sum(), ce_weight=ce_weight,
        reduction="none", chunk_size=16,
    )  # fmt: skip
    torch.testing.assert_close(fused, rows.sum() / ce_weight[target[target != IGNORE]].sum())
    torch.testing.assert_close(dh, dh2, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dw, dw2, rtol=1e-5, atol=1e-7)
    ones = ours(h, w, target, torch.tensor(1.0), ce_weight=torch.ones(50), chunk_size=16)
    plain = ours(h, w, target, torch.tensor(1.0), chunk_size=16)
    for a, b in zip(ones, plain, strict=True):
        assert torch.equal(a, b)


def test_all_targets_of_weight_zero_make_the_mean_nan_like_torch():
    h, w, target = make_inputs(n_rows=20, hidden=16, vocab=30, dtype=torch.float32)
    ce_weight = torch.ones(30)
    ce_weight[target[target != IGNORE]] = 0.0
    loss = lowp_ops.linear_cross_entropy(h, w, target, ce_weight=ce_weight)
    want = F.cross_entropy(F.linear(h, w), target, weight=ce_weight, ignore_index=IGNORE)
    assert loss.isnan() and want.isnan()


def record_payloads(steps, h, w, target, ce_weight, fp8_dtype, chunk_size, recompute):
    """Each chunk's MXFP8 dlogits payload of the sum-reduced weighted loss (per-row gradient 1)."""
    seen = []
    args = (h, w, target)
    ones = torch.ones(h.shape[0], device=h.device)
    rest = (0.1, IGNORE, f"mxfp8_{fp8_dtype}", "bf16", chunk_size, True, True, 0.0, 0.0, ce_weight)
    record = dict(steps=steps, on_dlogits=lambda start, end, payload: seen.append((start, end, payload)))
    if recompute:
        _, stats = steps.ce_fwd(steps.logits(h, w), target, 0.1, IGNORE, ce_weight)
        lce_ref.backward_chunks(*args, stats, ones, *rest, **record)
    else:
        lce_ref.fwd_bwd_chunks(*args, ones, *rest, **record)
    return seen


def check_payload_bytes(steps, device, n_rows=64, vocab=70, chunk_size=32):
    """The MXFP8 payload each chunk hands to the GEMMs is ``cross_entropy_with_mxfp8_grad(weight=)`` of
    the full logits (i.e. mxfp8_quantize of the bf16 weighted logits gradient), sliced at the chunk."""
    h, w, target = make_inputs(n_rows=n_rows, vocab=vocab, device=device)
    ce_weight = class_weights(vocab, device=device)
    logits = steps.logits(h, w)
    for fp8_dtype in ("e4m3", "e5m2"):
        _, full = lowp_ops.cross_entropy_with_mxfp8_grad(
            logits, target, weight=ce_weight, label_smoothing=0.1, ignore_index=IGNORE, fp8_dtype=fp8_dtype,
            reduction="sum",
        )  # fmt: skip
        for recompute in (False, True):
            seen = record_payloads(steps, h, w, target, ce_weight, fp8_dtype, chunk_size, recompute)
            assert len(seen) == n_rows // chunk_size
            for start, end, (row_data, row_scale, col_data, col_scale) in seen:
                assert torch.equal(row_data.view(torch.uint8), full.row_data[start:end].view(torch.uint8))
                assert torch.equal(col_data.view(torch.uint8), full.col_data[start:end].view(torch.uint8))
                assert torch.equal(row_scale[: end - start], full.row_scale[start:end])
                assert torch.equal(col_scale[: (end - start) // 32], full.col_scale[start // 32 : end // 32])


def test_mxfp8_dlogits_are_bytes_of_weighted_cross_entropy_with_mxfp8_grad():
    check_payload_bytes(lce_ref.REFERENCE_STEPS, "cpu")


def test_in_gradient_schedule_is_not_taken_with_class_weights():
    h = torch.empty(8, 16)
    assert lce_kernels.in_gradient_buffer_applies(h, 4, "none", 0, True, (0.0, 0.0, None))
    assert not lce_kernels.in_gradient_buffer_applies(h, 4, "none", 0, True, (0.0, 0.0, torch.ones(4)))


def test_module_holds_ce_weight_as_a_buffer_and_passes_it():
    h, w, target = make_inputs(n_rows=20, hidden=16, vocab=30, dtype=torch.float32)
    ce_weight = class_weights(30)
    module = lowp_ops.nn.LinearCrossEntropyLoss(ce_weight)
    assert "ce_weight" in module.state_dict()
    got = module(w, h, target)
    want = lowp_ops.linear_cross_entropy(h, w, target, ce_weight=ce_weight)
    assert torch.equal(got, want)
    assert not torch.equal(got, lowp_ops.linear_cross_entropy(h, w, target))


BAD_CE_WEIGHTS = {
    "not a tensor": ([1.0] * 30, TypeError, "ce_weight must be a Tensor"),
    "integer": (torch.ones(30, dtype=torch.int64), ValueError, "ce_weight must be float32, bfloat16 or"),
    "2-D": (torch.ones(1, 30), ValueError, r"ce_weight must have shape \(30,\)"),
    "wrong length": (torch.ones(31), ValueError, r"ce_weight must have shape \(30,\)"),
    "other device": (torch.ones(30, device="meta"), ValueError, "ce_weight must be on hidden's device"),
    "requires grad": (torch.ones(30, requires_grad=True), ValueError, "ce_weight must not require grad"),
}


@pytest.mark.parametrize("name", BAD_CE_WEIGHTS)
def test_bad_ce_weight_raises_naming_it(name):
    bad, error, message = BAD_CE_WEIGHTS[name]
    h, w, target = make_inputs(n_rows=10, hidden=16, vocab=30)
    with pytest.raises(error, match=message):
        lowp_ops.linear_cross_entropy(h, w, target, ce_weight=bad)


def test_float64_ce_weight_is_read_as_fp32():
    h, w, target = make_inputs(n_rows=20, hidden=16, vocab=30, dtype=torch.float32)
    ce_weight = class_weights(30)
    got = lowp_ops.linear_cross_entropy(h, w, target, ce_weight=ce_weight.double())
    assert torch.equal(got, lowp_ops.linear_cross_entropy(h, w, target, ce_weight=ce_weight))


def test_opcheck_with_class_weights():
    h, w, target = make_inputs(n_rows=37, hidden=24, vocab=75)
    ce_weight = class_weights(75)
    fwd = (h, w, target, 0.1, IGNORE, "mxfp8_e4m3", "bf16", 16, 1e-3, 0.0, ce_weight)
    torch.library.opcheck(torch.ops.lowp.linear_cross_entropy_fwd.default, fwd)
    grad_args = (h.clone().requires_grad_(), w.clone().requires_grad_(), *fwd[2:])
    torch.library.opcheck(torch.ops.lowp.linear_cross_entropy_fwd.default, grad_args)
    _, stats = torch.ops.lowp.linear_cross_entropy_fwd(*fwd)
    config = (0.1, IGNORE, "none", "bf16", 16, True, True, 0.0, 0.0, ce_weight)
    torch.library.opcheck(
        torch.ops.lowp.linear_cross_entropy_bwd.default, (h, w, target, stats, torch.rand(37), *config)
    )
    row_weight = torch.tensor(0.25).expand(37)
    torch.library.opcheck(
        torch.ops.lowp.linear_cross_entropy_fwd_bwd.default, (h, w, target, row_weight, *config)
    )
    shard = w[25:50].contiguous()
    torch.library.opcheck(
        torch.ops.lowp.linear_vocab_parallel_ce_stats.default,
        (h, shard, target, 25, True, 16, 0.0, ce_weight),
    )
    torch.library.opcheck(
        torch.ops.lowp.linear_vocab_parallel_ce_bwd.default,
        (h, shard, target, stats, torch.rand(37), *config[:7], 25, 75, 0.0, 0.0, ce_weight),
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("grad_format", [None, "mxfp8_e4m3"])
def test_compiled_fullgraph_with_class_weights_has_no_graph_break(reduction, grad_format):
    ce_weight = class_weights(40)

    def loss_fn(h, w, target):
        return lowp_ops.linear_cross_entropy(
            h, w, target, ce_weight=ce_weight, grad_format=grad_format, reduction=reduction,
            label_smoothing=0.1,
        )  # fmt: skip

    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True, dynamic=True)
    for step, (batch, seq) in enumerate([(2, 5), (3, 7)]):
        h, w, target = make_inputs(n_rows=seq, hidden=16, vocab=40, seed=step, lead=(batch,))
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
            loss = compiled(hc, wc, target)
            loss.sum().backward()
        kwargs = dict(grad_format=grad_format, reduction=reduction, label_smoothing=0.1)
        want = ours(h, w, target, torch.ones_like(loss), ce_weight=ce_weight, **kwargs)
        assert torch.equal(loss.detach(), want[0])
        assert torch.equal(hc.grad, want[1]) and torch.equal(wc.grad, want[2])
    assert backend.frame_count == 1
    assert not counters["graph_break"]


# ------------------------------------------------------------------------------------ interpreter


@pytest.mark.interp
@pytest.mark.parametrize(
    ("reduction", "grad_format", "label_smoothing"),
    [("mean", None, 0.1), ("none", "mxfp8_e4m3", 0.1), ("sum", "mxfp8_e5m2", 0.0)],
)
def test_kernels_match_float64_interp(reduction, grad_format, label_smoothing):
    check_against_float64("cpu", (40, 32, 70), torch.bfloat16, reduction, grad_format, label_smoothing, 32)


@pytest.mark.interp
def test_kernel_mxfp8_dlogits_are_bytes_of_weighted_cross_entropy_with_mxfp8_grad_interp():
    check_payload_bytes(lce_kernels.KERNEL_STEPS, "cpu", n_rows=32, vocab=40)


def spy_in_gradient_schedule(monkeypatch) -> list:
    calls = []
    original = lce_kernels.fwd_bwd_in_gradient_buffer
    monkeypatch.setattr(lce_kernels, "fwd_bwd_in_gradient_buffer", lambda *a: calls.append(1) or original(*a))
    return calls


def check_weighted_call_takes_the_chunks(device, shape, monkeypatch):
    """N <= H, automatic chunk, bf16 gradient: the in-gradient schedule's case, but with class weights the
    chunk schedule serves it (the column kernels take none) and matches float64."""
    calls = spy_in_gradient_schedule(monkeypatch)
    n_rows, hidden, vocab = shape
    h, w, target = make_inputs(n_rows=n_rows, hidden=hidden, vocab=vocab, device=device)
    ours(h, w, target, torch.tensor(1.0, device=device))
    assert calls == [1]  # the unweighted call takes it
    check_against_float64(device, shape, torch.bfloat16, "mean", None, 0.1, None)
    assert calls == [1]


@pytest.mark.interp
def test_weighted_in_gradient_case_takes_the_chunk_schedule_interp(monkeypatch):
    check_weighted_call_takes_the_chunks("cpu", (24, 32, 50), monkeypatch)


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("grad_format", [None, "mxfp8_e4m3", "mxfp8_e5m2"])
def test_gpu_loss_and_grads_match_float64(reduction, grad_format):
    check_against_float64("cuda", (1000, 256, 5000), torch.bfloat16, reduction, grad_format, 0.1, 256)


@pytest.mark.gpu
def test_gpu_z_loss_and_softcap_with_class_weights_match_float64():
    features = dict(z_loss=1e-3, softcap=5.0)
    check_against_float64("cuda", (512, 128, 3000), torch.bfloat16, "mean", None, 0.1, 256, **features)


@pytest.mark.gpu
def test_gpu_mxfp8_dlogits_are_bytes_of_weighted_cross_entropy_with_mxfp8_grad():
    check_payload_bytes(lce_kernels.KERNEL_STEPS, "cuda", n_rows=1024, vocab=5000, chunk_size=256)


@pytest.mark.gpu
def test_gpu_weighted_in_gradient_case_takes_the_chunk_schedule(monkeypatch):
    check_weighted_call_takes_the_chunks("cuda", (256, 512, 5000), monkeypatch)
