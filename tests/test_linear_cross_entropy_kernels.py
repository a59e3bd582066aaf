"""The LM head's in-gradient schedule (``N <= H``, bf16 gradient, automatic chunk): the logits live in
``dweight``'s storage. Checked: the cross entropy over transposed logits against the row kernels, the
schedule's loss and gradients against float64 and against the chunk schedule, that it allocates no
logits-sized tensor besides ``dweight``, and its peak memory on the GPU. Its CUDA-graph capture and
``reduce-overhead`` runs are cases of test_linear_cross_entropy's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_linear_cross_entropy import float64_loss_and_grads, make_inputs, relative_error

import lowp_ops
from lowp_ops.kernels import cross_entropy as ce_kernels
from lowp_ops.kernels import cross_entropy_columns as columns
from lowp_ops.kernels import linear_cross_entropy as lce_kernels
from lowp_ops.meta import linear_cross_entropy as lce_meta

IGNORE = -100
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def masked_logits(n_tokens, vocab, dtype, seed, device):
    """Logits ``(N, V)`` with a row whose first 1000 entries are -inf, a row whose target is -inf, every
    7th row ignored (where N reaches those rows); targets ``(N,)``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, vocab, generator=gen) * 3
    target = torch.randint(0, vocab, (n_tokens,), generator=gen)
    target[::7] = IGNORE
    if n_tokens > 5:
        logits[3, : min(1000, vocab)] = float("-inf")
        target[5] = 0
        logits[5, 0] = float("-inf")
    return logits.to(dtype).to(device), target.to(device)


def check_columns_match_rows(device, n_tokens, vocab, split, label_smoothing, dtype, seed=None):
    seed = n_tokens + vocab if seed is None else seed
    logits, target = masked_logits(n_tokens, vocab, dtype, seed=seed, device=device)
    transposed = logits.t().contiguous()
    pieces = [transposed[:split].clone(), transposed[split:].clone()]
    loss, lse = columns.column_cross_entropy_fwd(pieces, target, label_smoothing, IGNORE)
    want_loss, want_lse = ce_kernels.launch_cross_entropy_fwd(logits, target, label_smoothing, IGNORE)
    # Same math, differently ordered fp32 sums.
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=2e-6, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=2e-6, equal_nan=True)
    if n_tokens > 5 and vocab > 1:  # (at V = 1 row 5 is all -inf: lse and loss are NaN, as the rows')
        assert loss[5].isinf() and loss[0] == 0

    grad_rows = torch.rand(n_tokens, generator=torch.Generator().manual_seed(1)).to(device)
    columns.column_cross_entropy_bwd_in_place(pieces, target, lse, grad_rows, label_smoothing, IGNORE)
    want = ce_kernels.launch_cross_entropy_bwd(logits, target, want_lse, grad_rows, label_smoothing, IGNORE)
    got = torch.cat(pieces).t()
    assert torch.equal(got[::7], torch.zeros_like(got[::7]))
    # Given equal lse the element formula is the row kernels'; an lse one fp32 step off moves a stored
    # value by at most one step of the logits' dtype.
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-7, equal_nan=True)
    if dtype != torch.float32:
        differ = (got.contiguous().view(BITS[dtype]) != want.view(BITS[dtype])).float().mean().item()
        assert differ < 1e-3, differ


COLUMN_CASES = [
    (40, 5000, 3000, 0.1, torch.bfloat16),
    (300, 700, 0, 0.0, torch.bfloat16),  # one piece: the first is empty
    (33, 2100, 2100, 0.0, torch.float32),  # one piece: the second is empty
    (7, 300, 100, 0.2, torch.float16),
]


@pytest.mark.interp
@pytest.mark.parametrize(("n_tokens", "vocab", "split", "label_smoothing", "dtype"), COLUMN_CASES)
def test_columns_match_row_kernels_interp(n_tokens, vocab, split, label_smoothing, dtype):
    check_columns_match_rows("cpu", n_tokens, vocab, split, label_smoothing, dtype)


@pytest.mark.interp
@settings(max_examples=8, deadline=None)
@given(
    n_tokens=st.integers(1, 300),
    vocab=st.integers(1, 600),
    split_fraction=st.floats(0.0, 1.0),
    label_smoothing=st.sampled_from([0.0, 0.1]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_columns_match_row_kernels_any_shape_interp(
    n_tokens, vocab, split_fraction, label_smoothing, dtype, seed
):
    """Token counts across the 256-token blocks, any vocabulary, any split into the two pieces."""
    split = round(split_fraction * vocab)
    check_columns_match_rows("cpu", n_tokens, vocab, split, label_smoothing, dtype, seed)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n_tokens", "vocab", "split", "label_smoothing", "dtype"),
    [*COLUMN_CASES, (1000, 33000, 30000, 0.1, torch.bfloat16), (513, 9000, 7000, 0.0, torch.bfloat16)],
)
def test_columns_match_row_kernels_gpu(n_tokens, vocab, split, label_smoothing, dtype):
    check_columns_match_rows("cuda", n_tokens, vocab, split, label_smoothing, dtype)


def check_schedule(
    device, n_tokens, hidden, vocab, dtype, reduction, label_smoothing, hidden_grad, outside_rows, monkeypatch
):
    monkeypatch.setattr(lce_kernels, "LOGITS_OUTSIDE_ROWS", outside_rows)
    calls = []
    original = lce_kernels.fwd_bwd_in_gradient_buffer
    monkeypatch.setattr(lce_kernels, "fwd_bwd_in_gradient_buffer", lambda *a: calls.append(1) or original(*a))
    h, w, target = make_inputs(n_tokens, hidden, vocab, dtype, device=device)
    h.requires_grad_(hidden_grad)
    w.requires_grad_()
    loss = lowp_ops.linear_cross_entropy(h, w, target, reduction=reduction, label_smoothing=label_smoothing)
    loss.backward()
    assert calls == [1]
    want_loss, want_dh, want_dw = float64_loss_and_grads(
        h.detach().cpu(), w.detach().cpu(), target.cpu(), torch.tensor(1.0), reduction, label_smoothing
    )
    rtol = 0.01 if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(
        loss.cpu().double(), want_loss, rtol=2e-3 if dtype != torch.float32 else 1e-6, atol=0
    )
    assert relative_error(w.grad.cpu(), want_dw) < rtol
    assert (h.grad is not None) == hidden_grad
    if hidden_grad:
        assert relative_error(h.grad.cpu(), want_dh) < rtol
    # The chunk schedule (explicit chunk) on the same inputs: same loss to fp32, gradients within bf16.
    h2, w2 = h.detach().clone().requires_grad_(hidden_grad), w.detach().clone().requires_grad_()
    chunked = lowp_ops.linear_cross_entropy(
        h2, w2, target, reduction=reduction, label_smoothing=label_smoothing, chunk_size=n_tokens
    )
    chunked.backward()
    assert calls == [1]
    torch.testing.assert_close(loss, chunked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        w.grad.float(), w2.grad.float(), rtol=2e-2, atol=2e-2 * w2.grad.abs().max().item()
    )


DEFAULT_OUTSIDE = lce_kernels.LOGITS_OUTSIDE_ROWS
SCHEDULE_CASES = [
    (40, 64, 5000, torch.bfloat16, "mean", 0.1, True, 1000),  # N < H, two pieces, 2 + 1 wgrad GEMMs
    (64, 64, 4100, torch.bfloat16, "sum", 0.0, True, 1000),  # N == H: the logits fill dweight exactly
    (64, 64, 4100, torch.bfloat16, "mean", 0.0, True, DEFAULT_OUTSIDE),
    (30, 64, 1000, torch.bfloat16, "mean", 0.0, False, DEFAULT_OUTSIDE),  # V <= R: nothing inside; no dhidden
    (33, 80, 2100, torch.float32, "mean", 0.2, True, 512),
]
SCHEDULE_ARGS = (
    "n_tokens",
    "hidden",
    "vocab",
    "dtype",
    "reduction",
    "label_smoothing",
    "hidden_grad",
    "outside",
)


@pytest.mark.interp
@pytest.mark.parametrize(SCHEDULE_ARGS, SCHEDULE_CASES)
def test_schedule_matches_float64_and_chunks_interp(
    n_tokens, hidden, vocab, dtype, reduction, label_smoothing, hidden_grad, outside, monkeypatch
):
    args = (n_tokens, hidden, vocab, dtype, reduction, label_smoothing, hidden_grad, outside)
    check_schedule("cpu", *args, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize(
    SCHEDULE_ARGS, [*SCHEDULE_CASES, (512, 512, 20000, torch.bfloat16, "mean", 0.1, True, DEFAULT_OUTSIDE)]
)
def test_schedule_matches_float64_and_chunks_gpu(
    n_tokens, hidden, vocab, dtype, reduction, label_smoothing, hidden_grad, outside, monkeypatch
):
    args = (n_tokens, hidden, vocab, dtype, reduction, label_smoothing, hidden_grad, outside)
    check_schedule("cuda", *args, monkeypatch)


@pytest.mark.interp
@pytest.mark.parametrize(
    ("n_tokens", "hidden", "vocab", "outside", "inside_pieces"),
    [
        (40, 64, 5000, 1000, [2500, 1500]),
        (64, 64, 4100, 1000, [1000, 1000, 1000, 100]),
        (32, 64, 900, 1000, []),
    ],
)
def test_weight_gradient_pieces_grow_when_tokens_are_fewer_than_hidden_interp(
    n_tokens, hidden, vocab, outside, inside_pieces, monkeypatch
):
    """The weight-gradient GEMMs over the logits inside ``dweight``: as large as the overlap rule allows
    (pieces of R rows only at N == H), then one for the last R rows; the result checked against float64
    by the schedule tests above."""
    monkeypatch.setattr(lce_kernels, "LOGITS_OUTSIDE_ROWS", outside)
    rows_per_mm = []
    real_mm = torch.mm

    h, w, target = make_inputs(n_tokens, hidden, vocab, torch.float32, device="cpu")

    def recording_mm(a, b, *, out=None):
        if b is h:  # a weight-gradient GEMM: dlogits rows @ hidden
            rows_per_mm.append(a.shape[0])
        return real_mm(a, b, out=out) if out is not None else real_mm(a, b)

    monkeypatch.setattr(torch, "mm", recording_mm)
    row_weight = torch.full((n_tokens,), 1.0 / n_tokens)
    lce_kernels.fwd_bwd_in_gradient_buffer(h, w, target, row_weight, 0.0, -100, True)
    assert rows_per_mm == [*inside_pieces, min(vocab, outside)]


def test_schedule_applies_only_where_the_logits_fit():
    h, _, _ = make_inputs(64, 64, 300, torch.bfloat16, device="cpu")
    assert lce_kernels.in_gradient_buffer_applies(h, 300, "none", 0, True)
    assert not lce_kernels.in_gradient_buffer_applies(h[:0], 300, "none", 0, True)  # no tokens
    assert not lce_kernels.in_gradient_buffer_applies(torch.cat([h, h[:1]]), 300, "none", 0, True)  # N > H
    assert not lce_kernels.in_gradient_buffer_applies(h, 300, "mxfp8_e4m3", 0, True)
    assert not lce_kernels.in_gradient_buffer_applies(h, 300, "none", 64, True)  # an explicit chunk
    assert not lce_kernels.in_gradient_buffer_applies(h, 300, "none", 0, False)  # no dweight to host them


def test_schedule_serves_only_calls_of_many_logits(real_in_gradient_threshold):
    """Outside this test the suite lowers the threshold to 0 (conftest), so that its small shapes run
    the schedule; here the library's own: 2^25 logits."""
    threshold = lce_meta.IN_GRADIENT_MIN_LOGITS
    assert threshold == 2**25
    for tokens, vocab in ((512, 32000), (1024, 32000), (128, 129280), (256, 129280)):
        h = torch.empty(tokens, 4096, device="meta", dtype=torch.bfloat16)
        assert lce_kernels.in_gradient_buffer_applies(h, vocab, "none", 0, True) == (
            tokens * vocab >= threshold
        )
    h = torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16)
    assert lce_kernels.in_gradient_buffer_applies(h, 129280, "none", 0, True)  # 4096 x 129280 logits


@pytest.mark.interp
def test_small_call_takes_one_chunk_with_the_chunk_schedules_bytes_interp(
    real_in_gradient_threshold, monkeypatch
):
    """Below the threshold an automatic-chunk call runs the chunk schedule in one chunk: the bytes of
    ``chunk_size=N``, and the in-gradient schedule is not called."""
    calls = []
    original = lce_kernels.fwd_bwd_in_gradient_buffer
    monkeypatch.setattr(lce_kernels, "fwd_bwd_in_gradient_buffer", lambda *a: calls.append(1) or original(*a))
    h, w, target = make_inputs(64, 128, 1000, torch.bfloat16, device="cpu")

    def grads(chunk_size):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = lowp_ops.linear_cross_entropy(hh, ww, target, chunk_size=chunk_size)
        loss.backward()
        return loss, hh.grad, ww.grad

    for auto, one_chunk in zip(grads(None), grads(64), strict=True):
        assert torch.equal(auto, one_chunk)
    assert calls == []
    monkeypatch.setattr(lce_meta, "IN_GRADIENT_MIN_LOGITS", 64 * 1000)  # now the call has enough logits
    grads(None)
    assert calls == [1]


@pytest.mark.interp
def test_schedule_allocates_no_logits_sized_tensor_besides_dweight_interp():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class RecordAllocations(TorchDispatchMode):
        def __init__(self, inputs):
            super().__init__()
            self.storages = {t.untyped_storage().data_ptr() for t in inputs}
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in self.storages:
                    self.storages.add(t.untyped_storage().data_ptr())
                    self.sizes.append(t.numel())
            return out

    n_tokens, hidden, vocab = 40, 64, 5000
    h, w, target = make_inputs(n_tokens, hidden, vocab, torch.bfloat16, device="cpu")
    row_weight = torch.full((), 1.0 / n_tokens).expand(n_tokens)
    with RecordAllocations((h, w, target, row_weight)) as recorder:
        _, dhidden, dweight, _ = lce_kernels.fwd_bwd_in_gradient_buffer(
            h, w, target, row_weight, 0.0, IGNORE, True
        )
    sizes = sorted(recorder.sizes, reverse=True)
    assert sizes[0] == dweight.numel() == vocab * hidden
    outside = lce_kernels.LOGITS_OUTSIDE_ROWS * n_tokens
    # Everything else is at most the R vocabulary rows outside dweight (the full logits: 200000).
    assert sizes[1] <= max(outside, dhidden.numel()) < vocab * n_tokens, sizes[:4]


@pytest.mark.gpu
def test_peak_memory_is_dweight_dhidden_and_the_rows_outside_gpu():
    n_tokens, hidden, vocab = 1024, 1024, 50000
    h, w, target = make_inputs(n_tokens, hidden, vocab, torch.bfloat16, device="cuda")
    h.requires_grad_()
    w.requires_grad_()
    lowp_ops.linear_cross_entropy(h, w, target).backward()  # warm up (kernels, cuBLAS workspace)
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    lowp_ops.linear_cross_entropy(h, w, target).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    gradients = (vocab + n_tokens) * hidden * 2
    outside = lce_kernels.LOGITS_OUTSIDE_ROWS * n_tokens * 2
    assert peak <= gradients + outside + 2**20, (peak, gradients, outside)
    logits = vocab * n_tokens * 2
    assert peak < gradients + logits // 4
