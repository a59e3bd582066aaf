"""CUDA graphs: manual capture of forward+backward replays bit-identically to eager with new inputs, and
``torch.compile(mode="reduce-overhead")`` never skips cudagraphs (``triton.cudagraph_or_error``).

A failed capture poisons its process (docs/registration.md#cuda-graph-tests): run each test alone::

    for t in $(pytest --collect-only -q -m cudagraph tests/test_cudagraphs.py | grep ::); do
        pytest -q "$t"
    done

Every test is self-contained: its own inputs, warm-up, capture and eager comparison.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import lowp_ops

NEG_INF = float("-inf")
IGNORE = -100
PAYLOAD_FIELDS = ("row_data", "row_scale", "col_data", "col_scale")


def ce_inputs(seed: int, n_rows: int = 512, n_cols: int = 32000):
    """bf16 logits with a masked leading block in one row, every 5th row ignored."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(n_rows, n_cols, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    logits[seed % n_rows, :5000] = NEG_INF
    target = torch.randint(0, n_cols, (n_rows,), generator=gen, device="cuda")
    target[seed % 5 :: 5] = IGNORE
    return logits, target


def warm_up(step, *args, iterations: int = 3):
    """Run ``step`` on a side stream (compiles the Triton kernels, fills the allocator) before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    )


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
def test_manual_capture_of_cross_entropy_with_mxfp8_grad_replays_like_eager():
    def step(logits, target, grad_loss):
        return lowp_ops.cross_entropy_with_mxfp8_grad(
            logits,
            target,
            grad_loss,
            label_smoothing=0.1,
            reduction="none",
            fp8_dtype="e4m3",
            scale_layout="swizzled",
        )

    static_logits, static_target = ce_inputs(0)
    static_grad_loss = torch.rand(static_target.shape, device="cuda")
    warm_up(step, static_logits, static_target, static_grad_loss)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_payload = step(static_logits, static_target, static_grad_loss)

    for seed in (1, 2, 3):
        logits, target = ce_inputs(seed)
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


@pytest.mark.cudagraph
def test_reduce_overhead_mxfp8_quantize_and_mxfp8_grad_never_skip_cudagraphs():
    def quantize(x):
        return lowp_ops.mxfp8_quantize(x, "e4m3", True, True, "swizzled")

    def loss_and_payload(logits, target, grad_loss):
        # reduction="sum": the per-row gradient is grad_loss itself, so the payload bytes must match eager.
        return lowp_ops.cross_entropy_with_mxfp8_grad(
            logits, target, grad_loss, label_smoothing=0.1, reduction="sum", fp8_dtype="e5m2"
        )

    counters.clear()
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        compiled_quantize = torch.compile(quantize, mode="reduce-overhead", fullgraph=True)
        compiled_ce = torch.compile(loss_and_payload, mode="reduce-overhead", fullgraph=True)
        for seed in range(3):
            logits, target = ce_inputs(seed)
            grad_loss = torch.rand((), device="cuda") + 0.5
            torch.compiler.cudagraph_mark_step_begin()
            payload = compiled_quantize(logits)
            got_q = [getattr(payload, field).view(torch.uint8).clone() for field in PAYLOAD_FIELDS]
            torch.compiler.cudagraph_mark_step_begin()
            loss, ce_payload = compiled_ce(logits, target, grad_loss)
            loss = loss.clone()
            got_ce = [getattr(ce_payload, field).view(torch.uint8).clone() for field in PAYLOAD_FIELDS]

            want_q = quantize(logits)
            want_loss, want_ce = loss_and_payload(logits, target, grad_loss)
            for field, got, want_data in zip(
                PAYLOAD_FIELDS, got_q, [getattr(want_q, f) for f in PAYLOAD_FIELDS], strict=True
            ):
                assert torch.equal(got, want_data.view(torch.uint8)), (
                    f"quantize {field} differs at step {seed}"
                )
            for field, got, want_data in zip(
                PAYLOAD_FIELDS, got_ce, [getattr(want_ce, f) for f in PAYLOAD_FIELDS], strict=True
            ):
                assert torch.equal(got, want_data.view(torch.uint8)), (
                    f"mxfp8 grad {field} differs at step {seed}"
                )
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    assert counters["inductor"]["cudagraph_skips"] == 0
