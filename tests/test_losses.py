"""The loss modules ``lowp_ops.nn.CrossEntropyLoss`` and ``lowp_ops.nn.LinearCrossEntropyLoss``: torch's
float64 cross entropy is the oracle; option wiring, argument order, buffers and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowp_ops
import lowp_ops.losses

VOCAB, HIDDEN, ROWS = 40, 16, 11


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(ROWS, VOCAB, generator=gen) * 2).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    target[::4] = -100
    return logits, target


def _oracle(logits, target, **options):
    """(loss, logits gradient) of torch's float64 cross entropy (gradient of the summed loss)."""
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x, target, **options)
    loss.sum().backward()
    return loss, x.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_cross_entropy_loss_matches_float64(reduction, label_smoothing):
    logits, target = _inputs()
    module = lowp_ops.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=label_smoothing)
    loss = module(logits, target)
    loss.sum().backward()
    want_loss, want_grad = _oracle(logits, target, reduction=reduction, label_smoothing=label_smoothing)
    assert loss.dtype == torch.float32 and loss.shape == want_loss.shape
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_cross_entropy_loss_ignore_index_and_bf16():
    logits, target = _inputs(torch.bfloat16)
    target[target == -100] = 7
    target[1] = 7
    loss = lowp_ops.nn.CrossEntropyLoss(ignore_index=7)(logits, target)
    loss.backward()
    want_loss, want_grad = _oracle(logits, target, ignore_index=7)
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), want_grad, rtol=1e-2, atol=1e-3)
    assert torch.all(logits.grad[target == 7] == 0)


def test_cross_entropy_loss_class_weights():
    logits, target = _inputs()
    weight = torch.rand(VOCAB, generator=torch.Generator().manual_seed(1)) + 0.5
    module = lowp_ops.nn.CrossEntropyLoss(weight)
    loss = module(logits, target)
    loss.backward()
    want_loss, want_grad = _oracle(logits, target, weight=weight.double())
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_class_weights_are_a_buffer():
    weight = torch.ones(VOCAB)
    try:
        module = lowp_ops.nn.CrossEntropyLoss(weight)
    except NotImplementedError:
        pytest.skip("cross_entropy does not take class weights yet")
    assert "weight" in module.state_dict()
    assert module.to(torch.float64).weight.dtype == torch.float64


def test_options_pass_through(monkeypatch):
    """process_group and options the module does not name reach the function unchanged."""
    seen = {}
    monkeypatch.setattr(lowp_ops.losses, "cross_entropy", lambda *args, **kwargs: seen.update(kwargs))
    group = object()
    lowp_ops.nn.CrossEntropyLoss(process_group=group, classes_last=True, future_option=3)(*_inputs())
    assert seen["process_group"] is group and seen["classes_last"] is True and seen["future_option"] == 3
    assert (seen["ignore_index"], seen["reduction"], seen["label_smoothing"]) == (-100, "mean", 0.0)


def test_unknown_option_is_rejected_by_the_function():
    with pytest.raises(TypeError, match="not_an_option"):
        lowp_ops.nn.CrossEntropyLoss(not_an_option=1)(*_inputs())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"reduction": "avg"}, ValueError, "reduction"),
        ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        ({"ignore_index": -100.0}, TypeError, "ignore_index must be an int"),
        ({"label_smoothing": torch.tensor(0.1)}, TypeError, "label_smoothing must be a float"),
        ({"size_average": False}, TypeError, "size_average .* is not taken"),
        ({"reduce": False}, TypeError, "reduce .* is not taken"),
    ],
)
@pytest.mark.parametrize("module", [lowp_ops.nn.CrossEntropyLoss, lowp_ops.nn.LinearCrossEntropyLoss])
def test_bad_options_are_named(module, kwargs, error, message):
    with pytest.raises(error, match=message):
        module(**kwargs)


def test_bad_class_weight_is_named():
    with pytest.raises(ValueError, match="weight must be a 1-D floating tensor"):
        lowp_ops.nn.CrossEntropyLoss(torch.ones(2, 3))
    with pytest.raises(ValueError, match="ce_weight must be a 1-D floating tensor"):
        lowp_ops.nn.LinearCrossEntropyLoss(torch.arange(3))


# ------------------------------------------------------------------------------ linear cross entropy


def _head_inputs(dtype=torch.float32, seed=0, shape=(ROWS,)):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / 4).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, shape, generator=gen)
    target.view(-1)[::3] = -100
    return hidden, weight, target


def _head_oracle(hidden, lin_weight, target, **options):
    h = hidden.detach().double().requires_grad_()
    w = lin_weight.detach().double().requires_grad_()
    loss = F.cross_entropy((h @ w.T).reshape(-1, VOCAB), target.reshape(-1), **options)
    loss.sum().backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_loss_takes_ligers_argument_order(reduction):
    hidden, weight, target = _head_inputs(shape=(2, 6))
    module = lowp_ops.nn.LinearCrossEntropyLoss(reduction=reduction, label_smoothing=0.1)
    loss = module(weight, hidden, target)
    loss.sum().backward()
    want, want_dh, want_dw = _head_oracle(hidden, weight, target, reduction=reduction, label_smoothing=0.1)
    assert loss.shape == (target.shape if reduction == "none" else ())
    torch.testing.assert_close(loss.double().reshape(-1), want.reshape(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), want_dh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), want_dw, rtol=1e-4, atol=1e-5)


def test_linear_cross_entropy_loss_mxfp8_grad_format():
    """The MXFP8 gradient moves the gradients by at most a few percent (E4M3 has 3 mantissa bits), the
    loss not at all."""
    hidden, weight, target = _head_inputs(torch.bfloat16)
    module = lowp_ops.nn.LinearCrossEntropyLoss(grad_format="mxfp8_e4m3", chunk_size=256)
    loss = module(weight, hidden, target)
    loss.backward()
    want, want_dh, want_dw = _head_oracle(hidden, weight, target)
    torch.testing.assert_close(loss.double(), want, rtol=1e-2, atol=1e-2)
    for got, expected in ((hidden.grad, want_dh), (weight.grad, want_dw)):
        assert (got.double() - expected).norm() / expected.norm() < 0.1


def test_linear_cross_entropy_loss_rejects_a_bias():
    hidden, weight, target = _head_inputs()
    with pytest.raises(NotImplementedError, match="bias"):
        lowp_ops.nn.LinearCrossEntropyLoss()(weight, hidden, target, torch.zeros(VOCAB))


def test_linear_cross_entropy_loss_class_weights():
    hidden, weight, target = _head_inputs()
    ce_weight = torch.rand(VOCAB, generator=torch.Generator().manual_seed(1)) + 0.5
    loss = lowp_ops.nn.LinearCrossEntropyLoss(ce_weight)(weight, hidden, target)
    loss.backward()
    want, want_dh, want_dw = _head_oracle(hidden, weight, target, weight=ce_weight.double())
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), want_dh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), want_dw, rtol=1e-4, atol=1e-5)


def test_modules_compile_in_one_graph():
    ce = lowp_ops.nn.CrossEntropyLoss(label_smoothing=0.1)
    head = lowp_ops.nn.LinearCrossEntropyLoss()
    logits, target = _inputs()
    hidden, weight, head_target = _head_inputs()

    def step(logits, target, hidden, weight, head_target):
        return ce(logits, target) + head(weight, hidden, head_target)

    eager = step(logits, target, hidden, weight, head_target)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(logits, target, hidden, weight, head_target), eager)


@pytest.mark.interp
def test_interp_modules_run_the_kernels():
    logits, target = _inputs(torch.bfloat16)
    loss = lowp_ops.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, target)
    want, _ = _oracle(logits, target, label_smoothing=0.1)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    hidden, weight, head_target = _head_inputs(torch.bfloat16)
    loss = lowp_ops.nn.LinearCrossEntropyLoss()(weight, hidden, head_target)
    want, _, _ = _head_oracle(hidden, weight, head_target)
    torch.testing.assert_close(loss.double(), want, rtol=2e-2, atol=2e-2)
