"""Per-rank checks of the vocabulary-parallel LM head + cross entropy
(``lowp_ops.linear_cross_entropy(..., process_group=pg)``), run in the process groups that
:func:`vocab_parallel_checks.run_group` spawns (that module imports this one, so the spawned ranks know
these checks). Every rank builds the full ``hidden`` and ``weight`` from the same seed and compares its
result with the single-process one: the single-rank op given the same lse (byte for byte), the public
single-rank function and float64 (within the roundings the contract allows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import vocab_parallel_checks as checks
from ce_softmax_oracles import assert_close_fp32, bits, ce_loss_fp32_atol, cross_entropy_oracle
from cudagraph_checks import capture
from vocab_parallel_checks import IGNORE, SHARD, Rank, assert_same_on_every_rank

import lowp_ops
from lowp_ops.distributed import linear_vocab_parallel_cross_entropy_stats

ROWS = 67  # not a multiple of 32: partial column-wise scale blocks; two chunks of CHUNK
HIDDEN = 64
CHUNK = 32
GRAD_FORMATS = (None, "mxfp8_e4m3", "mxfp8_e5m2")
# Relative (Frobenius) error of the gradients vs float64, as tests/test_linear_cross_entropy.py.
GRAD_RTOL = {None: 0.01, "mxfp8_e4m3": 0.05, "mxfp8_e5m2": 0.1}
LM_HEAD_CHECKS: list[str] = []


def lm_check(fn):
    LM_HEAD_CHECKS.append(fn.__name__)
    return checks.check(fn)


def lm_inputs(r: Rank, seed: int, rows: int = ROWS):
    """(hidden (rows, H), full weight (W*SHARD, H), global targets), equal on every rank. hidden[:, 0] = 1
    and weight[v, 0] = 2 (rank of v + 1): every shard's logit sum is far from 0, so a smoothing term
    summed over the local shard only would show in the loss (as in vocab_parallel_checks)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = r.world * SHARD
    hidden = torch.randn(rows, HIDDEN, generator=gen)
    weight = torch.randn(vocab, HIDDEN, generator=gen) * (3 / HIDDEN**0.5)
    hidden[:, 0] = 1.0
    weight[:, 0] = 2 * (torch.arange(vocab).div(SHARD, rounding_mode="floor").float() + 1)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[::7] = IGNORE
    to = dict(device=r.device)
    return hidden.bfloat16().to(**to), weight.bfloat16().to(**to), target.to(**to)


def my_rows(r: Rank, weight: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the full weight (its vocabulary shard)."""
    return weight[r.columns].contiguous()


def loss_and_grads(hidden, weight, target, grad_loss=None, **kwargs):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = lowp_ops.linear_cross_entropy(h, w, target, **kwargs)
    grad_loss = torch.ones_like(loss) if grad_loss is None else grad_loss
    dh, dw = torch.autograd.grad(loss, (h, w), grad_outputs=grad_loss)
    return loss.detach(), dh, dw


def float64_loss_and_grads(hidden, weight, target, grad_loss, reduction, label_smoothing):
    h64 = hidden.cpu().double().requires_grad_()
    w64 = weight.cpu().double().requires_grad_()
    loss = F.cross_entropy(
        F.linear(h64, w64),
        target.cpu(),
        ignore_index=IGNORE,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    grad_loss = torch.ones_like(loss) if grad_loss is None else grad_loss.cpu().double()
    dh, dw = torch.autograd.grad(loss, (h64, w64), grad_outputs=grad_loss)
    return loss.detach(), dh, dw


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.cpu().double() - want).norm() / want.norm()).item()


def upstream_rows(target, grad_loss, reduction) -> torch.Tensor:
    """dloss per row (N,) fp32, as the public function hands it to the backward op."""
    rows = grad_loss if grad_loss is not None else torch.ones_like(target, dtype=torch.float32)
    if reduction == "mean":
        rows = rows / (target != IGNORE).sum()
    return rows.float().expand(target.shape).contiguous()


@lm_check
def lm_head_loss_is_identical_on_every_rank_and_matches_single_rank(r: Rank):
    for reduction in ("mean", "sum", "none"):
        for ls in (0.0, 0.1):
            hidden, weight, target = lm_inputs(r, 1)
            kwargs = dict(label_smoothing=ls, reduction=reduction, chunk_size=CHUNK)
            loss, _, _ = loss_and_grads(hidden, my_rows(r, weight), target, process_group=r.group, **kwargs)
            what = f"loss {reduction} ls={ls}"
            assert_same_on_every_rank(r, loss, what)
            with torch.no_grad():
                single = lowp_ops.linear_cross_entropy(hidden, weight, target, **kwargs)
            # The same bf16 logits; the lse is merged in another order (fp32 rounding).
            logits = (hidden.float() @ weight.float().t()).bfloat16().cpu()
            atol = ce_loss_fp32_atol(logits)
            assert_close_fp32(loss.cpu(), single.cpu().double(), rtol=1e-5, atol=atol, what=what)
            want, _, _ = cross_entropy_oracle(
                logits, target.cpu(), 1.0, label_smoothing=ls, ignore_index=IGNORE, reduction=reduction
            )
            assert_close_fp32(loss.cpu(), want, rtol=1e-5, atol=atol, what=what + " vs float64")


def check_gradients(r: Rank, grad_format, reduction, ls, other_operand="bf16"):
    hidden, weight, target = lm_inputs(r, 2)
    grad_loss = r.row_weights(20) if reduction == "none" else None
    kwargs = dict(grad_format=grad_format, label_smoothing=ls, reduction=reduction, chunk_size=CHUNK)
    kwargs.update(other_operand=other_operand)
    my_weight = my_rows(r, weight)
    _, dh, dw = loss_and_grads(hidden, my_weight, target, grad_loss, process_group=r.group, **kwargs)
    what = f"{grad_format} {reduction} ls={ls} other={other_operand}"
    assert dh.dtype == dw.dtype == torch.bfloat16 and dw.shape == my_weight.shape, what
    assert_same_on_every_rank(r, dh, f"{what}: hidden gradient")
    # Byte for byte: this rank's rows of the single-rank backward op given the same (merged) lse.
    _, lse = linear_vocab_parallel_cross_entropy_stats(hidden, my_weight, target, ls, IGNORE, CHUNK, r.group)
    single_dh, single_dw = torch.ops.lowp.linear_cross_entropy_bwd(
        hidden,
        weight,
        target,
        lse,
        upstream_rows(target, grad_loss, reduction),
        ls,
        IGNORE,
        grad_format or "none",
        other_operand,
        CHUNK,
        True,
        True,
    )
    assert torch.equal(bits(dw), bits(single_dw[r.columns])), f"{what}: weight gradient is not the rows"
    # hidden: the sum of the ranks' bf16 partials (fp32 all-reduce) vs one bf16 rounding of the full sum.
    scale = single_dh.abs().max().item()
    torch.testing.assert_close(dh, single_dh, rtol=1.6e-2, atol=4e-3 * scale, msg=f"{what}: hidden gradient")
    _, want_dh, want_dw = float64_loss_and_grads(hidden, weight, target, grad_loss, reduction, ls)
    rtol = GRAD_RTOL[grad_format] * (1.5 if other_operand == "mxfp8" else 1.0)
    assert relative_error(dh, want_dh) < rtol, f"{what}: hidden gradient vs float64"
    assert relative_error(dw, want_dw[r.columns]) < rtol, f"{what}: weight gradient vs float64"


@lm_check
def lm_head_gradients_are_the_shard_of_the_single_rank_gradients(r: Rank):
    for grad_format, reduction, ls in ((None, "mean", 0.0), (None, "none", 0.1), ("mxfp8_e4m3", "sum", 0.1)):
        check_gradients(r, grad_format, reduction, ls)
    check_gradients(r, "mxfp8_e5m2", "mean", 0.1, other_operand="mxfp8")


@lm_check
def lm_head_hidden_gradient_partial_without_reduction(r: Rank):
    """reduce_hidden_grad=False: each rank's hidden gradient is its shard's partial (the backward op's
    bytes), and the partials sum to the reduced gradient."""
    hidden, weight, target = lm_inputs(r, 3)
    my_weight = my_rows(r, weight)
    kwargs = dict(label_smoothing=0.1, chunk_size=CHUNK, process_group=r.group)
    _, partial, dw = loss_and_grads(hidden, my_weight, target, reduce_hidden_grad=False, **kwargs)
    _, reduced, dw_reduced = loss_and_grads(hidden, my_weight, target, **kwargs)
    assert torch.equal(bits(dw), bits(dw_reduced))
    _, lse = linear_vocab_parallel_cross_entropy_stats(hidden, my_weight, target, 0.1, IGNORE, CHUNK, r.group)
    rows = upstream_rows(target, None, "mean")
    shard = (r.rank * SHARD, r.world * SHARD)
    want, _ = torch.ops.lowp.linear_vocab_parallel_ce_bwd(
        hidden, my_weight, target, lse, rows, 0.1, IGNORE, "none", "bf16", CHUNK, True, False, *shard
    )
    assert torch.equal(bits(partial), bits(want)), "partial hidden gradient"
    total = sum(part.view(partial.dtype).view(partial.shape).float() for part in r.gather_bytes(partial))
    if r.world == 2:  # a sum of two fp32 values does not depend on the order
        assert torch.equal(bits(total.to(partial.dtype)), bits(reduced)), (
            "the reduced gradient is the fp32 sum"
        )
    else:
        torch.testing.assert_close(reduced, total.to(partial.dtype), rtol=2**-7, atol=0)


@lm_check
def lm_head_ignored_rows_give_zero_loss_and_gradient(r: Rank):
    hidden, weight, target = lm_inputs(r, 4)
    my_weight = my_rows(r, weight)
    target[: ROWS // 2] = IGNORE
    kwargs = dict(chunk_size=CHUNK, process_group=r.group)
    loss, dh, _ = loss_and_grads(hidden, my_weight, target, reduction="none", **kwargs)
    ignored = target == IGNORE
    assert torch.all(loss[ignored] == 0) and torch.all(loss[~ignored] > 0)
    assert torch.all(dh[ignored] == 0)
    target[:] = IGNORE
    loss, dh, dw = loss_and_grads(hidden, my_weight, target, grad_format="mxfp8_e4m3", **kwargs)
    assert torch.isnan(loss), "mean over no rows is NaN, like PyTorch"
    assert torch.all(dh == 0) and torch.all(dw == 0)


@lm_check
def lm_head_masked_shard_forward_is_exact(r: Rank):
    """Rank 0's weight rows are -inf and hidden is positive: its whole shard of logits is -inf on every row
    (the forward's masked path; the gradient through an infinite weight is NaN by the chain rule, so the
    masked backward is covered by the cross-entropy checks on the same merge). The target of row 1 sits in
    the masked shard: loss +inf."""
    hidden, weight, target = lm_inputs(r, 5)
    hidden = hidden.abs() + 0.1
    weight[:SHARD] = float("-inf")
    target = torch.where(target == IGNORE, IGNORE, target.clamp(min=SHARD))
    target[1] = 3
    with torch.no_grad():
        loss = lowp_ops.linear_cross_entropy(
            hidden, my_rows(r, weight), target, reduction="none", chunk_size=CHUNK, process_group=r.group
        )
    logits = (hidden.float() @ weight.float().t()).bfloat16().cpu()
    assert torch.all(logits[:, :SHARD] == float("-inf"))
    want, _, _ = cross_entropy_oracle(
        logits, target.cpu(), 1.0, label_smoothing=0.0, ignore_index=IGNORE, reduction="none"
    )
    assert_close_fp32(loss.cpu(), want, rtol=1e-5, atol=ce_loss_fp32_atol(logits[:, SHARD:]), what="loss")
    assert loss[1] == float("inf")
    assert_same_on_every_rank(r, loss, "loss")


@lm_check
def lm_head_unequal_shards_give_nan_on_every_rank(r: Rank):
    hidden, _, target = lm_inputs(r, 6)
    width = SHARD + (32 if r.rank == 0 else 0)
    weight = torch.randn(width, HIDDEN, device=r.device).bfloat16()
    loss = lowp_ops.linear_cross_entropy(
        hidden, weight, target.clamp(max=SHARD - 1), reduction="none", process_group=r.group
    )
    assert torch.isnan(loss).all(), "unequal shard widths must poison the loss"


@lm_check
def lm_head_compiled_fullgraph_matches_eager(r: Rank):
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = "inductor" if r.device.startswith("cuda") else "aot_eager"
    counter = CompileCounterWithBackend(backend)

    def step(hidden, weight, target):
        return lowp_ops.linear_cross_entropy(
            hidden,
            weight,
            target,
            grad_format="mxfp8_e4m3",
            label_smoothing=0.1,
            chunk_size=CHUNK,
            process_group=r.group,
        )

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for seed in (7, 8):
        hidden, weight, target = lm_inputs(r, seed)
        my_weight = my_rows(r, weight)
        want = loss_and_grads_of(step, hidden, my_weight, target)
        got = loss_and_grads_of(compiled, hidden, my_weight, target)
        for name, a, b in zip(("loss", "hidden gradient", "weight gradient"), got, want, strict=True):
            if backend == "aot_eager":
                assert torch.equal(bits(a), bits(b)), f"compiled {name} differs from eager"
            else:
                # Inductor may fuse the mean and the casts differently (see vocab_parallel_checks).
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5, msg=f"compiled {name}")
        assert_same_on_every_rank(r, got[0], "compiled loss")
    assert counter.frame_count == 1, f"{counter.frame_count} graphs (want one, no recompile)"


@lm_check
def lm_head_loss_features_match_the_single_rank_loss(r: Rank):
    """z-loss and soft-capping (with smoothing) through the vocabulary-parallel LM head: the loss equal
    on every rank and at fp32 precision of the single-rank loss; the gradients those of the single rank
    (this rank's weight rows) within bf16 rounding."""
    for kwargs in ({"z_loss": 1e-3}, {"softcap": 5.0, "label_smoothing": 0.1, "z_loss": 1e-3}):
        hidden, weight, target = lm_inputs(r, 6)
        kwargs = dict(kwargs, chunk_size=CHUNK)
        loss, dh, dw = loss_and_grads(hidden, my_rows(r, weight), target, process_group=r.group, **kwargs)
        what = f"{kwargs}"
        assert_same_on_every_rank(r, loss, what)
        want_loss, want_dh, want_dw = loss_and_grads(hidden, weight, target, **kwargs)
        torch.testing.assert_close(loss.float(), want_loss.float(), rtol=1e-5, atol=1e-5, msg=what)
        assert relative_error(dh, want_dh.double().cpu()) < 1e-2, what
        assert relative_error(dw, my_rows(r, want_dw).double().cpu()) < 1e-2, what


def float64_weighted(hidden, weight, target, ce_weight, reduction, label_smoothing):
    """Float64 ``F.cross_entropy(logits, t, weight=ce_weight)``: (loss of the bf16 logits the op computes,
    dhidden and dweight of ``F.linear(h, w)``)."""
    h64 = hidden.cpu().double().requires_grad_()
    w64 = weight.cpu().double().requires_grad_()
    options = dict(
        target=target.cpu(), weight=ce_weight.cpu().double(), ignore_index=IGNORE, reduction=reduction,
        label_smoothing=label_smoothing,
    )  # fmt: skip
    loss = F.cross_entropy(F.linear(h64, w64), **options)
    dh, dw = torch.autograd.grad(loss, (h64, w64), grad_outputs=torch.ones_like(loss))
    bf16_logits = (hidden.float() @ weight.float().t()).bfloat16().cpu().double()
    return F.cross_entropy(bf16_logits, **options), dh, dw


@lm_check
def lm_head_class_weights_match_float64_and_the_single_rank(r: Rank):
    """ce_weight (the whole vocabulary's, on every rank): the loss equal on every rank, at fp32 precision
    of the single-rank weighted loss and near float64 ``F.cross_entropy(weight=)``; the gradients this
    rank's rows of the single-rank ones; with MXFP8 too."""
    hidden, weight, target = lm_inputs(r, 7)
    gen = torch.Generator().manual_seed(8)
    ce_weight = (torch.rand(weight.shape[0], generator=gen) * 2).to(r.device)
    for reduction, ls, grad_format in (("mean", 0.1, None), ("sum", 0.0, "mxfp8_e4m3"), ("none", 0.1, None)):
        kwargs = dict(reduction=reduction, label_smoothing=ls, chunk_size=CHUNK, grad_format=grad_format)
        what = f"ce_weight {kwargs}"
        loss, dh, dw = loss_and_grads(
            hidden, my_rows(r, weight), target, process_group=r.group, ce_weight=ce_weight, **kwargs
        )
        assert_same_on_every_rank(r, loss, what)
        assert_same_on_every_rank(r, dh, what + ": hidden gradient")
        want_loss, want_dh, want_dw = loss_and_grads(hidden, weight, target, ce_weight=ce_weight, **kwargs)
        torch.testing.assert_close(loss.float(), want_loss.float(), rtol=1e-5, atol=1e-5, msg=what)
        rtol = GRAD_RTOL[grad_format]
        assert relative_error(dh, want_dh.double().cpu()) < rtol / 2, what
        assert relative_error(dw, my_rows(r, want_dw).double().cpu()) < rtol / 2, what
        f64_loss, f64_dh, f64_dw = float64_weighted(hidden, weight, target, ce_weight, reduction, ls)
        torch.testing.assert_close(loss.cpu().double(), f64_loss, rtol=1e-5, atol=1e-4, msg=what)
        assert relative_error(dh, f64_dh) < rtol, what + " vs float64"
        assert relative_error(dw, f64_dw[r.columns]) < rtol, what + " vs float64"


def loss_and_grads_of(fn, hidden, weight, target):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, target)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), dh, dw


@checks.check
def lm_head_cuda_graph_replay_matches_eager(r: Rank):
    """NCCL all-gather (forward) and all-reduce (backward) inside one captured forward+backward: replay
    with new inputs equals eager."""
    hidden, weight, target = lm_inputs(r, 9)
    static_hidden = hidden.clone().requires_grad_()
    static_weight = my_rows(r, weight).requires_grad_()
    static_target = target.clone()
    kwargs = dict(grad_format="mxfp8_e4m3", label_smoothing=0.1, chunk_size=CHUNK, process_group=r.group)

    def step():
        loss = lowp_ops.linear_cross_entropy(static_hidden, static_weight, static_target, **kwargs)
        dh, dw = torch.autograd.grad(loss, (static_hidden, static_weight))
        return loss, dh, dw

    graph, static_out = capture(step)
    for seed in (10, 11):
        new_hidden, new_weight, new_target = lm_inputs(r, seed)
        with torch.no_grad():
            static_hidden.copy_(new_hidden)
            static_weight.copy_(my_rows(r, new_weight))
        static_target.copy_(new_target)
        graph.replay()
        torch.cuda.synchronize()
        want = loss_and_grads(new_hidden, my_rows(r, new_weight), new_target, **kwargs)
        for name, got, expected in zip(
            ("loss", "hidden gradient", "weight gradient"), static_out, want, strict=True
        ):
            assert torch.equal(bits(got), bits(expected)), f"seed {seed}: replayed {name}"
        assert_same_on_every_rank(r, static_out[0], "replayed loss")
