"""Loss features of the cross-entropy family on CPU (references): z-loss (``z_loss``), final-logit
soft-capping (``softcap``), ``return_z_loss`` and ``return_lse``, in ``cross_entropy``,
``cross_entropy_with_mxfp8_grad``, ``linear_cross_entropy``, the vocabulary-parallel paths and the loss
modules, against the float64 oracle ``ce_softmax_oracles.features_oracle``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ce_softmax_oracles import bits, features_oracle
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import lowp_ops
from lowp_ops import library
from lowp_ops.formats import MXFP8Tensor

IGNORE = -100
NEG_INF = float("-inf")
# (z_loss, softcap, label_smoothing, class weights)
COMBOS = [
    (1e-3, None, 0.0, False),
    (0.0, 3.0, 0.0, False),
    (1e-2, 5.0, 0.0, False),
    (1e-2, 5.0, 0.1, False),
    (1e-2, 5.0, 0.1, True),
    (0.0, 2.0, 0.1, True),
    (1e-3, None, 0.2, True),
]


def inputs(rows=37, vocab=53, seed=0, dtype=torch.float32, masked=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4 + 2
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[::5] = IGNORE
    if masked:
        logits[:, :20] = NEG_INF  # a leading masked block in every row
        logits[3, 30] = NEG_INF
        target = torch.where(target == IGNORE, target, 20 + target % (vocab - 20))  # no -inf target
        target[3] = 31
    weight = torch.rand(vocab, generator=gen) + 0.5
    return logits.to(dtype), target, weight


def run(logits, target, grad_loss=None, **kwargs):
    """(loss, grad, z_loss, lse) of ``lowp_ops.cross_entropy`` with both extras."""
    leaf = logits.clone().requires_grad_()
    loss, z_value, lse = lowp_ops.cross_entropy(leaf, target, return_z_loss=True, return_lse=True, **kwargs)
    upstream = torch.ones_like(loss) if grad_loss is None else grad_loss
    (grad,) = torch.autograd.grad(loss, leaf, grad_outputs=upstream)
    return loss.detach(), grad, z_value, lse


def assert_features_match_oracle(logits, target, weight, grad_loss, reduction, z, cap, ls, rtol=2e-5):
    kwargs = dict(label_smoothing=ls, reduction=reduction, weight=weight, z_loss=z, softcap=cap)
    loss, grad, z_value, lse = run(logits, target, grad_loss, **kwargs)
    upstream = 1.0 if grad_loss is None else grad_loss
    want = features_oracle(logits, target, upstream, ignore_index=IGNORE, **kwargs)
    scale = want[1].abs().max().item()
    torch.testing.assert_close(loss.double(), want[0], rtol=rtol, atol=1e-5)
    torch.testing.assert_close(grad.double(), want[1], rtol=rtol, atol=rtol * scale)
    torch.testing.assert_close(z_value.double(), want[2], rtol=rtol, atol=1e-6)
    assert lse.dtype == torch.float32 and lse.shape == target.shape
    torch.testing.assert_close(lse.double(), want[3], rtol=1e-6, atol=1e-5)
    return loss, grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("z", "cap", "ls", "weighted"), COMBOS)
def test_reference_matches_float64_oracle(reduction, z, cap, ls, weighted):
    logits, target, weight = inputs(seed=len(reduction))
    grad_loss = torch.rand(target.shape) + 0.5 if reduction == "none" else torch.tensor(1.7)
    weight = weight if weighted else None
    assert_features_match_oracle(logits, target, weight, grad_loss, reduction, z, cap, ls)


def test_features_change_the_loss():
    """The oracle comparisons above could pass with a feature ignored only if it did not matter."""
    logits, target, _ = inputs()
    plain = lowp_ops.cross_entropy(logits, target)
    assert abs(float(lowp_ops.cross_entropy(logits, target, z_loss=1e-2) - plain)) > 1e-2
    assert abs(float(lowp_ops.cross_entropy(logits, target, softcap=3.0) - plain)) > 1e-2


@pytest.mark.parametrize(("z", "cap"), [(1e-2, 5.0), (0.0, 1.0)])
def test_masked_rows_with_softcap_stay_masked(z, cap):
    """-inf logits stay masked classes under the cap (not -c): zero probability and gradient, finite loss."""
    logits, target, _ = inputs(masked=True)
    loss, grad = assert_features_match_oracle(logits, target, None, None, "none", z, cap, 0.0)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert torch.equal(grad[:, :20], torch.zeros_like(grad[:, :20]))
    # Masked classes are absent: the loss of the logits without them (were -inf capped to -c, they
    # would carry probability and this would differ by about 20 e^-c / Σ).
    shifted_target = torch.where(target == IGNORE, target, target - 20)
    without = lowp_ops.cross_entropy(logits[:, 20:], shifted_target, reduction="none", softcap=cap, z_loss=z)
    torch.testing.assert_close(loss, without, rtol=1e-6, atol=1e-6)


def test_all_masked_row_is_nan_and_ignored_rows_are_zero():
    logits, target, _ = inputs()
    logits[0] = NEG_INF
    target[0] = 3
    logits[5] = NEG_INF  # row 5 is ignored (target[::5])
    loss, grad, z_value, _ = run(logits, target, None, reduction="none", z_loss=1e-2, softcap=4.0)
    assert loss[0].isnan() and grad[0].isnan().all()
    assert loss[5] == 0 and z_value[5] == 0 and torch.equal(grad[5], torch.zeros_like(grad[5]))


def test_bf16_per_token_grad_and_3d_layout():
    logits, target, _ = inputs(rows=24, dtype=torch.bfloat16)
    logits3, target3 = logits.view(4, 6, -1), target.view(4, 6)
    grad_loss = torch.rand(4, 6) + 0.5
    kwargs = dict(reduction="none", z_loss=1e-3, softcap=6.0, label_smoothing=0.1, classes_last=True)
    loss, grad, z_value, lse = run(logits3, target3, grad_loss, **kwargs)
    assert loss.shape == z_value.shape == lse.shape == (4, 6) and grad.dtype == torch.bfloat16
    kwargs.pop("classes_last")
    want = features_oracle(logits, target, grad_loss.reshape(-1), ignore_index=IGNORE, **kwargs)
    torch.testing.assert_close(loss.reshape(-1).double(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.reshape(24, -1).double(), want[1], rtol=1e-2, atol=1e-4)


def test_z_loss_value_is_reduced_like_the_loss():
    logits, target, weight = inputs()
    for reduction in ("mean", "sum", "none"):
        _, z_value = lowp_ops.cross_entropy(
            logits, target, weight=weight, reduction=reduction, z_loss=1e-2, return_z_loss=True
        )
        lse = torch.logsumexp(logits.double(), 1)
        valid = target != IGNORE
        rows = torch.where(valid, 1e-2 * lse**2, 0.0)
        want = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / weight.double()[target[valid]].sum()}
        torch.testing.assert_close(z_value.double(), want[reduction], rtol=1e-5, atol=1e-7)
        assert not z_value.requires_grad


def test_defaults_are_the_plain_loss_bit_for_bit():
    logits, target, _ = inputs(dtype=torch.bfloat16)
    loss, grad, _, lse = run(logits, target, None, label_smoothing=0.1)
    leaf = logits.clone().requires_grad_()
    plain = lowp_ops.cross_entropy(leaf, target, label_smoothing=0.1)
    (plain_grad,) = torch.autograd.grad(plain, leaf)
    assert torch.equal(bits(loss), bits(plain.detach())) and torch.equal(bits(grad), bits(plain_grad))
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"z_loss": -1e-3}, ValueError, "z_loss"),
        ({"z_loss": float("inf")}, ValueError, "z_loss"),
        ({"z_loss": "1e-3"}, TypeError, "z_loss"),
        ({"z_loss": True}, TypeError, "z_loss"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": -3.0}, ValueError, "softcap"),
        ({"softcap": "30"}, TypeError, "softcap"),
        ({"return_z_loss": 1}, TypeError, "return_z_loss"),
        ({"return_lse": None}, TypeError, "return_lse"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, name):
    logits, target, _ = inputs(rows=4, vocab=8)
    hidden, lm_weight = torch.randn(4, 16), torch.randn(8, 16)
    calls = (
        lambda: lowp_ops.cross_entropy(logits, target, **kwargs),
        lambda: lowp_ops.cross_entropy_with_mxfp8_grad(logits, target, **kwargs),
        lambda: lowp_ops.linear_cross_entropy(hidden, lm_weight, target, **kwargs),
    )
    for call in calls:
        with pytest.raises(error, match=name):
            call()
    if "z_loss" in kwargs or "softcap" in kwargs:
        with pytest.raises(error, match=name):
            lowp_ops.nn.CrossEntropyLoss(**kwargs)(logits, target)
    with pytest.raises(ValueError, match="z_loss"):
        library.cross_entropy_fwd(logits, target, 0.0, IGNORE, None, -1.0, 0.0)
    with pytest.raises(ValueError, match="softcap"):
        library.cross_entropy_fwd(logits, target, 0.0, IGNORE, None, 0.0, -1.0)


@pytest.mark.parametrize(("z", "cap"), [(1e-2, 5.0), (0.0, 3.0), (1e-3, 0.0)])
def test_mxfp8_grad_with_features_is_quantized_bf16_grad(z, cap):
    logits, target, weight = inputs(rows=40, vocab=96, dtype=torch.bfloat16)
    kwargs = dict(label_smoothing=0.1, weight=weight, z_loss=z, softcap=cap or None)
    loss, payload, z_value, lse = lowp_ops.cross_entropy_with_mxfp8_grad(
        logits, target, torch.tensor(2.0), return_z_loss=True, return_lse=True, **kwargs
    )
    assert isinstance(payload, MXFP8Tensor)
    want_loss, grad, want_z, want_lse = run(logits, target, torch.tensor(2.0), **kwargs)
    assert torch.equal(bits(loss), bits(want_loss)) and torch.equal(bits(z_value), bits(want_z))
    assert torch.equal(bits(lse), bits(want_lse))
    want = library.mxfp8_quantize(grad, "e4m3", True, True, "compact")
    got = (payload.row_data.view(torch.uint8), payload.row_scale, payload.col_data.view(torch.uint8))
    for g, w in zip(got, want[:3], strict=True):
        assert torch.equal(g, w)
    assert torch.equal(payload.col_scale, want[3])


FEATURE_ARGS = (1e-2, 4.0)


def test_opcheck_changed_ops():
    logits, target, weight = inputs(rows=8, vocab=40)
    stats = library.cross_entropy_fwd(logits, target, 0.1, IGNORE, weight, *FEATURE_ARGS)[1]
    rows = torch.rand(8)
    ops = torch.ops.lowp
    x = logits.detach()
    bwd = (x, target, stats, rows, 0.1, IGNORE)
    packet = library.vocab_parallel_ce_stats(x, target, 0, True, None, 4.0)
    h, w = torch.randn(8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    lm = (h.detach(), w.detach(), target)
    lm_config = (0.1, IGNORE, "none", "bf16", 4)
    cases = [
        (ops.cross_entropy_fwd, (logits.requires_grad_(), target, 0.1, IGNORE, weight, *FEATURE_ARGS)),
        (ops.cross_entropy_bwd, (*bwd, 0, 0, weight, *FEATURE_ARGS)),
        (ops.cross_entropy_bwd_mxfp8, (*bwd, "e4m3", True, True, "compact", 0, 0, None, *FEATURE_ARGS)),
        (ops.vocab_parallel_ce_stats, (x, target, 0, True, None, 4.0)),
        (ops.vocab_parallel_ce_merge, (packet, target, 40, 0.1, IGNORE, None, 1e-2)),
        (ops.linear_cross_entropy_fwd, (h, w, target, *lm_config, *FEATURE_ARGS)),
        (ops.linear_cross_entropy_bwd, (*lm, stats, rows, *lm_config, True, True, *FEATURE_ARGS)),
        (ops.linear_cross_entropy_fwd_bwd, (*lm, rows, *lm_config, True, True, *FEATURE_ARGS)),
        (ops.linear_vocab_parallel_ce_stats, (*lm, 0, True, 4, 4.0)),
        (ops.linear_vocab_parallel_ce_bwd, (*lm, stats, rows, *lm_config, True, True, 0, 40, *FEATURE_ARGS)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_compiled_fullgraph_with_features_has_no_graph_break():
    def loss_fn(logits, target):
        loss, z_value, lse = lowp_ops.cross_entropy(
            logits, target, label_smoothing=0.1, z_loss=1e-3, softcap=5.0, return_z_loss=True,
            return_lse=True, classes_last=True,
        )  # fmt: skip
        return loss + 0 * z_value + 0 * lse.sum()

    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)
    logits, target, _ = inputs(dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    loss = compiled(x, target)
    (grad,) = torch.autograd.grad(loss, x)
    want_loss, want_grad, _, _ = run(
        logits, target, None, label_smoothing=0.1, z_loss=1e-3, softcap=5.0, classes_last=True
    )
    assert torch.equal(bits(loss.detach()), bits(want_loss)) and torch.equal(bits(grad), bits(want_grad))
    assert backend.frame_count == 1 and not counters["graph_break"]


# -------------------------------------------------------------------------------------- the LM head


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("grad_format", [None, "mxfp8_e4m3"])
def test_linear_cross_entropy_features_match_the_unfused_loss(reduction, grad_format):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, 32, generator=gen).bfloat16()
    lm_weight = (torch.randn(96, 32, generator=gen) / 4).bfloat16()
    target = torch.randint(0, 96, (40,), generator=gen)
    target[::6] = IGNORE
    kwargs = dict(label_smoothing=0.1, reduction=reduction, z_loss=1e-2, softcap=3.0)
    h, w = hidden.clone().requires_grad_(), lm_weight.clone().requires_grad_()
    loss, z_value, lse = lowp_ops.linear_cross_entropy(
        h, w, target, grad_format=grad_format, chunk_size=16, return_z_loss=True, return_lse=True, **kwargs
    )
    upstream = torch.rand(40) + 0.5 if reduction == "none" else torch.tensor(1.3)
    dh, dw = torch.autograd.grad(loss, (h, w), grad_outputs=upstream)
    h2, w2 = hidden.clone().requires_grad_(), lm_weight.clone().requires_grad_()
    want, want_z, want_lse = lowp_ops.cross_entropy(
        F.linear(h2, w2), target, return_z_loss=True, return_lse=True, **kwargs
    )
    want_dh, want_dw = torch.autograd.grad(want, (h2, w2), grad_outputs=upstream)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z_value, want_z, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-5)
    # bf16 chunk roundings (and MXFP8 quantization) differ from the unfused loss's: relative to the largest.
    share = 0.06 if grad_format else 0.02
    for got, expected in ((dh, want_dh), (dw, want_dw)):
        atol = share * expected.abs().max().item()
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=atol)
    if grad_format is None and reduction == "none":  # the same chunks' bytes as the unfused bf16 backward
        assert torch.equal(bits(loss), bits(want.detach()))


# --------------------------------------------------------------------------------- the loss modules


def test_loss_modules_take_the_feature_arguments():
    logits, target, _ = inputs(dtype=torch.bfloat16)
    module = lowp_ops.nn.CrossEntropyLoss(z_loss=1e-3, softcap=5.0, return_z_loss=True)
    loss, z_value = module(logits, target)
    want, want_z = lowp_ops.cross_entropy(logits, target, z_loss=1e-3, softcap=5.0, return_z_loss=True)
    assert torch.equal(bits(loss), bits(want)) and torch.equal(bits(z_value), bits(want_z))
    liger_names = lowp_ops.nn.CrossEntropyLoss(lse_square_scale=1e-3, softcap=5.0)
    assert torch.equal(bits(liger_names(logits, target)), bits(want))
    hidden, lm_weight = torch.randn(37, 16).bfloat16(), torch.randn(53, 16).bfloat16()
    lm = lowp_ops.nn.LinearCrossEntropyLoss(z_loss=1e-3, softcap=5.0)
    want = lowp_ops.linear_cross_entropy(hidden, lm_weight, target, z_loss=1e-3, softcap=5.0)
    assert torch.equal(bits(lm(lm_weight, hidden, target)), bits(want))
