"""Class weights (``F.cross_entropy``'s ``weight=``) in the cross-entropy ops: the forward
(per-row loss), the backward (bf16/fp32 and the fused MXFP8 payload) and the reduction, against
``torch.nn.functional.cross_entropy`` in float64 (label smoothing, ``ignore_index``, every reduction,
gradients through the ops' autograd formulas), on the references (plain tests), the Triton kernels
(``interp``) and CUDA (``gpu``: the fused MXFP8 backward there is the Gluon kernel).

torch's definition (aten ``cross_entropy_loss_label_smoothing``): per row ``(1 - ls) w_y (-log p_y) +
(ls / C) Σ_c w_c (-log p_c)``; the mean divides both terms by ``Σ w_y`` over the non-ignored rows.
"""

from __future__ import annotations

import math

import process_groups
import pytest
import torch
import torch.nn.functional as F
from ce_softmax_oracles import FP32_UNIT, assert_same_nonfinite, assert_within_ulps
from hypothesis import given, settings
from hypothesis import strategies as st

import lowp_ops

IGNORE = -100
REDUCTIONS = ("none", "mean", "sum")
REFERENCE_SETTINGS = settings(max_examples=25, deadline=None)
INTERP_SETTINGS = settings(max_examples=8, deadline=None)


def class_weight_inputs(n_rows: int, n_cols: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """Logits (spread ~3, a -inf in every fourth row), targets with ignored rows, and class weights in
    [0.2, 2.2) with a few exact zeros (weights of any dtype; the ops compute in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_rows, n_cols, generator=gen) * 3
    logits[3::4, 0] = float("-inf")
    target = torch.randint(0, n_cols, (n_rows,), generator=gen)
    target[::5] = IGNORE
    weight = torch.rand(n_cols, generator=gen) * 2 + 0.2
    weight[torch.rand(n_cols, generator=gen) < 0.1] = 0.0
    return logits.to(dtype).to(device), target.to(device), weight.to(device)


def loss_through_ops(logits, target, weight, label_smoothing, reduction):
    """The loss as the public wrapper composes it: ``cross_entropy_fwd`` then, for mean/sum,
    ``cross_entropy_reduce``; differentiable through both ops' autograd formulas."""
    loss_rows, _ = torch.ops.lowp.cross_entropy_fwd(logits, target, label_smoothing, IGNORE, weight)
    if reduction == "none":
        return loss_rows
    return torch.ops.lowp.cross_entropy_reduce(loss_rows, target, IGNORE, reduction == "mean", weight)[0]


def torch_oracle(logits, target, weight, label_smoothing, reduction, grad_loss):
    """float64 loss and logits gradient of ``F.cross_entropy`` on the same values."""
    x64 = logits.detach().cpu().double().requires_grad_()
    loss = F.cross_entropy(
        x64,
        target.cpu(),
        weight=weight.cpu().double(),
        ignore_index=IGNORE,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    (grad,) = torch.autograd.grad(loss, x64, grad_outputs=grad_loss.cpu().double())
    return loss.detach(), grad


def grad_slack(logits, weight, label_smoothing, row_weight) -> torch.Tensor:
    """Absolute error bound of the fp32 gradient: a few roundoffs of ``p α`` (``|x - max|`` and log V
    large), of ``eps w_i`` and of ``(1 - ls) w_y``, times the row's upstream weight."""
    x = logits.detach().cpu().double()
    z = x - x.amax(dim=1, keepdim=True)
    log_sum = torch.exp(z).sum(dim=1, keepdim=True).log()
    p = torch.exp(z - log_sum).nan_to_num(0.0)
    spread = torch.where(torch.isfinite(z), z.abs(), 0.0) + log_sum.abs()
    w = weight.cpu().double()
    alpha = w.amax() * (1 + label_smoothing * len(w))
    return 16 * FP32_UNIT * (p * alpha * (4 + spread) + w.amax()) * row_weight.abs().unsqueeze(1)


def check_against_torch(logits, target, weight, label_smoothing, reduction) -> None:
    leaf = logits.clone().requires_grad_()
    loss = loss_through_ops(leaf, target, weight, label_smoothing, reduction)
    gen = torch.Generator().manual_seed(9)
    grad_loss = (torch.rand(loss.shape, generator=gen) + 0.5).to(logits.device)
    (grad,) = torch.autograd.grad(loss, leaf, grad_outputs=grad_loss)
    want_loss, want_grad = torch_oracle(logits, target, weight, label_smoothing, reduction, grad_loss)

    got = loss.detach().cpu().double()
    finite = assert_same_nonfinite(got, want_loss, "loss")
    spread = logits.detach().cpu().double().abs().nan_to_num(0.0, 0.0, 0.0).amax() + math.log(logits.shape[1])
    atol = 64 * FP32_UNIT * float(weight.cpu().double().abs().sum() + 1) * (4 + float(spread))
    error = torch.where(finite, (got - want_loss).abs(), 0.0)
    assert bool((error <= atol + 1e-5 * want_loss.abs().nan_to_num(0.0)).all()), (got, want_loss)

    if reduction == "none":
        row_weight = grad_loss.cpu().double()
    else:
        valid = target.cpu() != IGNORE
        denominator = (
            weight.cpu().double()[target.cpu().clamp(0)][valid].sum() if reduction == "mean" else 1.0
        )
        row_weight = (grad_loss.cpu().double() / denominator).expand(target.shape)
    slack = grad_slack(logits, weight, label_smoothing, row_weight)
    assert_within_ulps(
        grad.cpu(), want_grad, ulps=1, slack=slack, what=f"grad {reduction} ls={label_smoothing}"
    )
    assert (grad[target == IGNORE] == 0).all(), "ignored rows get an exact zero gradient"


@st.composite
def cases(draw, max_rows: int = 20, max_cols: int = 200):
    n_rows, n_cols = draw(st.integers(1, max_rows)), draw(st.integers(2, max_cols))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    logits, target, weight = class_weight_inputs(n_rows, n_cols, dtype, draw(st.integers(0, 2**31)))
    if (target == IGNORE).all():
        target[0] = 1
    weight[target[target != IGNORE][0]] = 1.0  # the mean's denominator is not 0 (see special values)
    weight = weight.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))
    return logits, target, weight, draw(st.sampled_from([0.0, 0.1, 0.7])), draw(st.sampled_from(REDUCTIONS))


@REFERENCE_SETTINGS
@given(cases())
def test_weighted_loss_and_grad_match_torch_float64(case):
    check_against_torch(*case)


@pytest.mark.interp
@INTERP_SETTINGS
@given(cases(max_rows=12, max_cols=90))
def test_interp_weighted_loss_and_grad_match_torch_float64(case):
    assert lowp_ops.library.cpu_runs_triton()
    check_against_torch(*case)


@pytest.mark.gpu
@settings(max_examples=40, deadline=None)
@given(cases(max_rows=300, max_cols=3000))
def test_gpu_weighted_loss_and_grad_match_torch_float64(case):
    logits, target, weight, label_smoothing, reduction = case
    check_against_torch(logits.cuda(), target.cuda(), weight.cuda(), label_smoothing, reduction)


# ------------------------------------------------------------------------------ special values


def check_special_values(device: str) -> None:
    """As torch: a zero-weight class at a -inf logit with smoothing gives NaN (0 * -inf) and a positive
    one +inf, while the gradient stays finite; a zero target weight gives loss 0; zero weights on every
    target make the mean NaN. A target outside [0, C) gives NaN (torch raises)."""
    x = torch.tensor([[1.0, float("-inf"), 2.0], [1.0, 2.0, 3.0], [0.5, 0.0, -1.0]], device=device)
    target = torch.tensor([0, 1, IGNORE], device=device)
    for weight in ([1.0, 0.0, 2.0], [1.0, 0.5, 2.0]):
        w = torch.tensor(weight, device=device)
        for label_smoothing in (0.0, 0.1):
            for reduction in REDUCTIONS:
                check_against_torch(x, target, w, label_smoothing, reduction)
    zero = torch.zeros(3, device=device)
    mean = loss_through_ops(x, target, zero, 0.0, "mean")
    assert torch.isnan(mean.cpu()), "no weight on any target: 0 / 0, as torch"
    bad = torch.tensor([0, 3, IGNORE], device=device)
    loss = loss_through_ops(x, bad, torch.ones(3, device=device), 0.1, "none")
    assert torch.isnan(loss[1].cpu()) and not torch.isnan(loss[0].cpu())


def test_special_values_follow_torch():
    check_special_values("cpu")


@pytest.mark.interp
def test_interp_special_values_follow_torch():
    check_special_values("cpu")


@pytest.mark.gpu
def test_gpu_special_values_follow_torch():
    check_special_values("cuda")


# ----------------------------------------------------------------------- the MXFP8 gradient


def check_mxfp8_contract(device: str, n_cols: int, gluon: bool | None = None) -> None:
    """With class weights the fused MXFP8 backward still equals quantizing the bf16 backward, byte for
    byte (row-/column-wise data and scales), also for a vocabulary shard with the full weights."""
    logits, target, weight = class_weight_inputs(70, n_cols, torch.bfloat16, seed=4, device=device)
    for label_smoothing in (0.0, 0.1):
        _, stats = torch.ops.lowp.cross_entropy_fwd(logits, target, label_smoothing, IGNORE, weight)
        grad_rows = (torch.rand(70, generator=torch.Generator().manual_seed(2)) + 0.5).to(device)
        for start, width, total in ((0, n_cols, 0), (128, n_cols - 128, n_cols)):
            shard = logits[:, start : start + width].contiguous()
            args = (shard, target, stats, grad_rows, label_smoothing, IGNORE)
            grad = torch.ops.lowp.cross_entropy_bwd(*args, start, total, weight)
            want = torch.ops.lowp.mxfp8_quantize(grad, "e4m3", True, True, "compact")
            if gluon is None:
                fused = torch.ops.lowp.cross_entropy_bwd_mxfp8(
                    *args, "e4m3", True, True, "compact", start, total, weight
                )
            else:
                from lowp_ops.kernels import cross_entropy as ce_kernels

                fused = ce_kernels.launch_cross_entropy_bwd_mxfp8(
                    *args, "e4m3", True, True, "compact", start, total, weight, gluon=gluon
                )
            for name, got, expected in zip(
                ("row_data", "row_scale", "col_data", "col_scale"), fused, want, strict=True
            ):
                assert torch.equal(got, expected), f"ls={label_smoothing} shard at {start}: {name} differs"


def test_mxfp8_gradient_with_class_weights_is_the_quantized_gradient():
    check_mxfp8_contract("cpu", 320)


@pytest.mark.interp
def test_interp_mxfp8_gradient_with_class_weights_is_the_quantized_gradient():
    check_mxfp8_contract("cpu", 320)


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize("n_cols", [320, 4096])
def test_gpu_mxfp8_gradient_with_class_weights_is_the_quantized_gradient(n_cols, gluon):
    check_mxfp8_contract("cuda", n_cols, gluon)


def check_shard_backward_is_the_slice(device: str) -> None:
    """A vocabulary shard's weighted backward (full weight vector, ``vocab_start``/``vocab_total``) is
    its columns of the whole backward, byte for byte."""
    logits, target, weight = class_weight_inputs(45, 192, torch.bfloat16, seed=5, device=device)
    _, stats = torch.ops.lowp.cross_entropy_fwd(logits, target, 0.1, IGNORE, weight)
    grad_rows = torch.ones(45, device=device)
    full = torch.ops.lowp.cross_entropy_bwd(logits, target, stats, grad_rows, 0.1, IGNORE, 0, 0, weight)
    for start in (0, 64, 128):
        got = torch.ops.lowp.cross_entropy_bwd(
            logits[:, start : start + 64].contiguous(),
            target,
            stats,
            grad_rows,
            0.1,
            IGNORE,
            start,
            192,
            weight,
        )
        assert torch.equal(got.view(torch.int16), full[:, start : start + 64].view(torch.int16)), start


def test_shard_backward_with_class_weights_is_the_slice():
    check_shard_backward_is_the_slice("cpu")


@pytest.mark.interp
def test_interp_shard_backward_with_class_weights_is_the_slice():
    check_shard_backward_is_the_slice("cpu")


# --------------------------------------------------------------------- arguments, tracing


@pytest.mark.parametrize(
    ("weight", "error", "message"),
    [
        (torch.ones(7), ValueError, r"weight must have shape \(5,\)"),
        (torch.ones(5, 1), ValueError, r"weight must have shape \(5,\)"),
        (torch.ones(5, dtype=torch.int64), ValueError, "weight must be float32, bfloat16 or float16"),
    ],
)
def test_bad_weights_raise_naming_the_argument(weight, error, message):
    logits, target, _ = class_weight_inputs(4, 5, torch.float32, seed=1)
    with pytest.raises(error, match=message):
        torch.ops.lowp.cross_entropy_fwd(logits, target, 0.0, IGNORE, weight)


def test_weight_requiring_grad_raises():
    logits, target, weight = class_weight_inputs(4, 5, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"weight \(class weights\) must not require grad"):
        torch.ops.lowp.cross_entropy_fwd(
            logits.requires_grad_(), target, 0.0, IGNORE, weight.requires_grad_()
        )


def test_opcheck_weighted_ops():
    logits, target, weight = class_weight_inputs(6, 40, torch.float32, seed=3)
    logits[3::4, 0] = 0.0  # finite: opcheck compares with NaN != NaN
    permuted = logits.t().contiguous().t()
    loss_rows, stats = torch.ops.lowp.cross_entropy_fwd(logits, target, 0.1, IGNORE, weight)
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_fwd.default, (permuted.requires_grad_(), target, 0.1, IGNORE, weight)
    )
    grad_rows = torch.rand(6) + 0.5
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_bwd.default,
        (permuted.detach(), target, stats, grad_rows, 0.1, IGNORE, 0, 0, weight),
    )
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_bwd_mxfp8.default,
        (
            permuted.detach(),
            target,
            stats,
            grad_rows,
            0.1,
            IGNORE,
            "e4m3",
            True,
            True,
            "compact",
            0,
            0,
            weight,
        ),
    )
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_reduce.default,
        (loss_rows.requires_grad_(), target, IGNORE, True, weight),
    )


def test_opcheck_weighted_vocab_parallel_ops():
    logits, target, weight = class_weight_inputs(10, 128, torch.float32, seed=6)
    logits[3::4, 0] = 0.0  # finite: opcheck compares with NaN != NaN
    shard = logits[:, 64:].t().contiguous().t()  # column-major: a permuted layout
    torch.library.opcheck(torch.ops.lowp.vocab_parallel_ce_stats, (shard, target, 64, True, weight))
    packets = [
        torch.ops.lowp.vocab_parallel_ce_stats(logits[:, r * 64 : (r + 1) * 64], target, r * 64, True, weight)
        for r in range(2)
    ]
    torch.library.opcheck(
        torch.ops.lowp.vocab_parallel_ce_merge, (torch.cat(packets), target, 64, 0.1, IGNORE, weight)
    )


def test_compiled_weighted_loss_is_one_graph_without_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda x, t, w: loss_through_ops(x, t, w, 0.1, "mean"), fullgraph=True, dynamic=True, backend=counter
    )
    for step, (rows, cols) in enumerate([(6, 40), (9, 52), (13, 70)]):
        logits, target, weight = class_weight_inputs(rows, cols, torch.float32, seed=step)
        with torch.compiler.set_stance("fail_on_recompile" if step > 1 else "default"):
            leaf = logits.clone().requires_grad_()
            loss = compiled(leaf, target, weight)
            (grad,) = torch.autograd.grad(loss, leaf)
        want, want_grad = torch_oracle(logits, target, weight, 0.1, "mean", torch.tensor(1.0))
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-6)
    assert counter.frame_count == 1


# ------------------------------------------------------------------ vocabulary-parallel


def check_vocab_parallel_merge(device: str, world: int = 3, shard: int = 48) -> None:
    """Every shard's weighted packet and their merge, in one process as the ranks compute them: loss
    against torch float64; each shard's backward with the merged statistics is its columns of the
    single-rank weighted backward, byte for byte."""
    logits, target, weight = class_weight_inputs(23, world * shard, torch.float32, seed=7, device=device)
    logits[5, :shard] = logits[5, :shard] - 40.0  # a shard far below the others
    logits[6, shard : 2 * shard] = float("-inf")  # an all -inf shard
    for label_smoothing in (0.0, 0.1):
        packets = [
            torch.ops.lowp.vocab_parallel_ce_stats(
                logits[:, r * shard : (r + 1) * shard], target, r * shard, label_smoothing > 0, weight
            )
            for r in range(world)
        ]
        merge = torch.ops.lowp.vocab_parallel_ce_merge
        loss, stats = merge(torch.cat(packets), target, shard, label_smoothing, IGNORE, weight)
        want, _ = torch_oracle(logits, target, weight, label_smoothing, "none", torch.ones(23))
        finite = assert_same_nonfinite(loss.cpu().double(), want, "merged loss")
        error = torch.where(finite, (loss.cpu().double() - want).abs(), 0.0)
        assert float(error.max()) <= 2e-4, float(error.max())
        _, single_stats = torch.ops.lowp.cross_entropy_fwd(logits, target, label_smoothing, IGNORE, weight)
        assert torch.equal(stats[0], single_stats[0]), "the same shift as the single-rank forward"
        grad_rows = torch.ones(23, device=device)
        full = torch.ops.lowp.cross_entropy_bwd(
            logits, target, stats, grad_rows, label_smoothing, IGNORE, 0, 0, weight
        )
        for r in range(world):
            columns = slice(r * shard, (r + 1) * shard)
            got = torch.ops.lowp.cross_entropy_bwd(
                logits[:, columns].contiguous(), target, stats, grad_rows, label_smoothing, IGNORE,
                r * shard, world * shard, weight,
            )  # fmt: skip
            assert torch.equal(got.view(torch.int32), full[:, columns].view(torch.int32)), f"rank {r}"


def test_vocab_parallel_merge_with_class_weights_matches_torch():
    check_vocab_parallel_merge("cpu")


@pytest.mark.interp
def test_interp_vocab_parallel_merge_with_class_weights_matches_torch():
    check_vocab_parallel_merge("cpu")


@pytest.mark.gpu
def test_gpu_vocab_parallel_merge_with_class_weights_matches_torch():
    check_vocab_parallel_merge("cuda", shard=160)


def check_gloo_rank(rank: int, world: int, case: tuple[float, str], group) -> None:
    """One rank of a gloo group: the weighted vocabulary-parallel loss (``distributed`` rows, then the
    weighted reduction) and this rank's gradient against torch float64."""
    from lowp_ops.distributed import vocab_parallel_cross_entropy_rows

    label_smoothing, reduction = case
    shard = 40
    logits, target, weight = class_weight_inputs(19, world * shard, torch.float32, seed=8)
    columns = slice(rank * shard, (rank + 1) * shard)
    mine = logits[:, columns].contiguous().requires_grad_()
    loss = vocab_parallel_cross_entropy_rows(mine, target, label_smoothing, IGNORE, group, weight)
    if reduction != "none":
        loss = torch.ops.lowp.cross_entropy_reduce(loss, target, IGNORE, reduction == "mean", weight)[0]
    grad_loss = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    (grad,) = torch.autograd.grad(loss, mine, grad_outputs=grad_loss)
    want_loss, want_grad = torch_oracle(logits, target, weight, label_smoothing, reduction, grad_loss)
    finite = assert_same_nonfinite(loss.detach().double(), want_loss, "loss")
    assert float(torch.where(finite, (loss.detach().double() - want_loss).abs(), 0.0).max()) <= 2e-4
    torch.testing.assert_close(grad.double(), want_grad[:, columns], rtol=1e-4, atol=1e-6)


def test_gloo_vocab_parallel_with_class_weights(tmp_path):
    cases = [(label_smoothing, reduction) for label_smoothing in (0.0, 0.1) for reduction in REDUCTIONS]
    results = process_groups.run_checks(
        3, str(tmp_path), "test_cross_entropy_class_weights", "check_gloo_rank", cases
    )
    process_groups.assert_all_passed(results, cases)


@pytest.mark.interp
def test_interp_gloo_vocab_parallel_with_class_weights(tmp_path):
    cases = [(0.1, "mean")]
    results = process_groups.run_checks(
        2, str(tmp_path), "test_cross_entropy_class_weights", "check_gloo_rank", cases
    )
    process_groups.assert_all_passed(results, cases)
