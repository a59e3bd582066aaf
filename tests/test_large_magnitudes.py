"""Precision at any logit magnitude: the cross entropy, softmax, log_softmax and
logsumexp keep their digits when a constant ``c`` (up to 1e30, and rows near the fp32 maximum) is added
to every logit, in every path: the references (plain tests), the Triton kernels (``interp``: CPU tensors
under ``TRITON_INTERPRET=1``; ``gpu``: the same checks on CUDA, where the fused MXFP8 backward is the
Gluon kernel), the vocabulary-parallel merge (in one process and in a gloo group) and the LM head.

The oracle is float64 on the very fp32/bf16 values the ops receive, formed as PyTorch does (``x - max``
first), so it is exact for inputs of any magnitude. Tolerances never grow with ``|c|``: they scale with
the spread ``|x - max|`` of a row and ``log V``, the quantities whose fp32 rounding the ops cannot avoid.
Formed as ``lse - x_y`` / ``x - lse`` (what these ops did before), the errors grow as ``|c| * 2^-24``:
``[1e4 + 2, 1e4 - 1]`` loses the loss's fourth digit, ``[1e8, 1e8]`` gives loss 0, a bf16 row of 1e38
gives probabilities 1 (or 0), and label smoothing at 3e38 overflows to -inf.
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
from lowp_ops.meta.cross_entropy import LOG_SUM, SHIFT

NEG_INF = float("-inf")
IGNORE = -100
MAGNITUDES = (0.0, 1e2, -3e3, 1e4, 2.0**20, 1e8, -1e15, 1e30, -1e30, 3e38)
REFERENCE_SETTINGS = settings(max_examples=25, deadline=None)
INTERP_SETTINGS = settings(max_examples=8, deadline=None)


# ------------------------------------------------------------------------------------ float64 oracle


def shifted64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(x - shift, log Σ exp(x - shift))`` of the rows of ``x`` (shift: the row maximum, 0 when
    infinite); exact for fp32 inputs of any magnitude."""
    x = x.double()
    row_max = x.amax(dim=1, keepdim=True)
    z = x - torch.where(row_max.abs() == math.inf, 0.0, row_max)
    return z, torch.exp(z).sum(dim=1, keepdim=True).log()


def log_softmax64(x: torch.Tensor) -> torch.Tensor:
    """float64 log_softmax as PyTorch forms it; NaN rows for all -inf rows and rows holding +inf."""
    z, log_sum = shifted64(x)
    has_pos_inf = (x.double() == math.inf).any(dim=1, keepdim=True)
    return torch.where(has_pos_inf, math.nan, z - log_sum)


def ce_oracle(
    x: torch.Tensor, target: torch.Tensor, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-row loss and its gradient (grad_loss 1 per row) of ``(N, V)`` logits, F.cross_entropy's
    definition (``ignore_index`` rows: 0 and 0; a -inf logit with smoothing: +inf)."""
    log_p = log_softmax64(x)
    n_cols = x.shape[1]
    valid = target != IGNORE
    picked = log_p.gather(1, target.clamp(0, n_cols - 1).long().unsqueeze(1)).squeeze(1)
    loss = -(1.0 - label_smoothing) * picked
    if label_smoothing > 0:
        loss = loss - label_smoothing * log_p.sum(dim=1) / n_cols
    onehot = F.one_hot(target.clamp(0, n_cols - 1).long(), n_cols).double()
    grad = torch.exp(log_p) - label_smoothing / n_cols - (1.0 - label_smoothing) * onehot
    return torch.where(valid, loss, 0.0), torch.where(valid.unsqueeze(1), grad, 0.0)


def spread(x: torch.Tensor) -> torch.Tensor:
    """``|x - max|`` per element (0 where not finite): what fp32 rounding of ``x - shift`` scales with."""
    z, _ = shifted64(x)
    return torch.where(torch.isfinite(z), z.abs(), 0.0)


def loss_slack(x: torch.Tensor) -> torch.Tensor:
    """Absolute error bound of a row's fp32 loss: roundoff of the row's spread and of log V (summed over
    ~log2 V levels), independent of the logits' magnitude."""
    n_cols = x.shape[1]
    widest = spread(x).amax(dim=1) if n_cols else torch.zeros(x.shape[0], dtype=torch.float64)
    return 16 * FP32_UNIT * (4 + 2 * widest + math.log(max(n_cols, 1))) * (2 + math.log2(max(n_cols, 1)))


def prob_slack(x: torch.Tensor) -> torch.Tensor:
    """Absolute error bound of fp32 ``exp((x - shift) - log_sum)`` (and of dlogits with the fp32
    subtractions of ``ls / V`` and ``1 - ls``)."""
    z, log_sum = shifted64(x)
    p = torch.where(torch.isfinite(z), torch.exp(z - log_sum), 0.0).nan_to_num(0.0)
    log_sum = torch.where(torch.isfinite(log_sum), log_sum.abs(), 0.0)
    return 8 * FP32_UNIT * (p * (4 + spread(x) + log_sum) + 1)


def assert_loss_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, what: str) -> None:
    got = got.double().cpu()
    finite = assert_same_nonfinite(got, want, what)
    error = torch.where(finite, (got - want).abs(), 0.0)
    allowed = loss_slack(x.cpu()) + 4 * FP32_UNIT * want.abs().nan_to_num(0.0, 0.0, 0.0)
    assert bool((error <= allowed).all()), (
        f"{what}: worst error {float((error - allowed).max())} beyond the bound; got {got.tolist()[:4]}, "
        f"want {want.tolist()[:4]}"
    )


# ------------------------------------------------------------------------------------------ inputs


def logits_with_offset(
    n_rows: int, n_cols: int, offset: float, dtype: torch.dtype, seed: int, masked: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dtype(offset + x)`` with ``x`` of spread ~4 (some -inf in every fourth row, a masked leading
    block, an all -inf ignored row; the other rows finite, so that their smoothed loss is too), and
    targets with ignored rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, n_cols, generator=gen, dtype=torch.float64) * 4
    logits = (x + offset).to(dtype)
    if masked:
        sparse = torch.rand(n_rows, n_cols, generator=gen) < 0.1
        logits[sparse & (torch.arange(n_rows) % 4 == 3).unsqueeze(1)] = NEG_INF
    target = torch.randint(0, n_cols, (n_rows,), generator=gen)
    target[::5] = IGNORE
    if masked and n_rows >= 3 and n_cols >= 2:
        logits[1, : n_cols // 2] = NEG_INF  # a masked leading block
        target[1] = n_cols - 1
        logits[1, n_cols - 1] = dtype_offset(offset, dtype)
        logits[2] = NEG_INF  # ignored all -inf row
        target[2] = IGNORE
    return logits, target


def dtype_offset(offset: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(offset, dtype=torch.float64).to(dtype))


@st.composite
def offset_inputs(draw, max_rows: int = 6, max_cols: int = 300):
    n_rows, n_cols = draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    offset = draw(st.sampled_from(MAGNITUDES))
    logits, target = logits_with_offset(n_rows, n_cols, offset, dtype, draw(st.integers(0, 2**31)))
    return logits, target, draw(st.sampled_from([0.0, 0.1]))


# ---------------------------------------------------------------------- checks (every implementation)


def check_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> None:
    """Per-row loss and the gradient (bf16/fp32 in the logits' dtype) of ``lowp::cross_entropy_fwd`` /
    ``_bwd`` against the float64 oracle, with magnitude-free tolerances; the row statistics are the exact
    row maximum and a log-sum within fp32 roundoff."""
    loss, stats = torch.ops.lowp.cross_entropy_fwd(logits, target, label_smoothing, IGNORE)
    want_loss, want_grad = ce_oracle(logits.cpu(), target.cpu(), label_smoothing)
    assert_loss_close(loss, want_loss, logits, "loss")
    _, log_sum = shifted64(logits.cpu())
    row_max = logits.cpu().double().amax(dim=1) if logits.shape[1] else torch.zeros(logits.shape[0])
    assert torch.equal(stats[SHIFT].cpu().double(), torch.where(row_max.abs() == math.inf, 0.0, row_max))
    finite = torch.isfinite(log_sum.squeeze(1))
    error = (stats[LOG_SUM].cpu().double() - log_sum.squeeze(1))[finite].abs()
    assert bool((error <= 8 * FP32_UNIT * (1 + log_sum.squeeze(1)[finite].abs())).all()), "log_sum"

    grad_rows = torch.rand(target.shape, generator=torch.Generator().manual_seed(3)).to(logits.device) + 0.5
    dlogits = torch.ops.lowp.cross_entropy_bwd(logits, target, stats, grad_rows, label_smoothing, IGNORE)
    weight = grad_rows.cpu().double().unsqueeze(1)
    slack = prob_slack(logits.cpu()) * weight
    assert_within_ulps(dlogits.cpu(), want_grad * weight, ulps=1, slack=slack, what="dlogits")
    assert (dlogits[target == IGNORE] == 0).all(), "ignored rows get an exact zero gradient"


def check_softmax_family(x: torch.Tensor) -> None:
    """softmax / log_softmax / logsumexp forward (and the softmax backward through autograd) against
    float64, with magnitude-free tolerances."""
    log_p = log_softmax64(x.cpu())
    probs = lowp_ops.softmax(x, -1)
    slack = prob_slack(x.cpu())
    assert_within_ulps(probs.cpu(), torch.exp(log_p), ulps=1, slack=slack, what="softmax")
    log_probs = lowp_ops.log_softmax(x, -1)
    _, log_sum = shifted64(x.cpu())
    log_slack = 8 * FP32_UNIT * (4 + spread(x.cpu()) + log_sum.abs().nan_to_num(0.0, 0.0, 0.0))
    assert_within_ulps(log_probs.cpu(), log_p, ulps=1, slack=log_slack, what="log_softmax")
    lse = lowp_ops.logsumexp(x, -1).float()
    want_lse = torch.logsumexp(x.cpu().double(), -1)
    assert_same_nonfinite(lse.cpu(), want_lse, "logsumexp")
    finite = torch.isfinite(want_lse)
    lse_slack = 8 * FP32_UNIT * (want_lse.abs() + 4 + math.log(max(x.shape[1], 1)))
    if x.dtype != torch.float32:  # returned in x's dtype
        lse_slack = lse_slack + want_lse.abs() * 2.0**-8
    assert bool(((lse.cpu().double() - want_lse).abs()[finite] <= lse_slack[finite]).all()), "logsumexp"


# ------------------------------------------------------------------- the issue's examples (reference)


def examples(device: str) -> None:
    """Four reported failures at large magnitudes, and logsumexp of ``[inf, 1]``."""
    f32 = dict(dtype=torch.float32, device=device)
    x = torch.tensor([[1e4 + 2, 1e4 - 1]], **f32)
    target = torch.tensor([0], device=device)
    loss = lowp_ops.cross_entropy(x, target)
    assert abs(float(loss) - math.log1p(math.exp(-3.0))) <= 4 * FP32_UNIT, float(loss)

    x = torch.tensor([[1e8, 1e8]], **f32).requires_grad_()
    loss = lowp_ops.cross_entropy(x, target)
    loss.backward()
    assert abs(float(loss) - math.log(2.0)) <= 4 * FP32_UNIT, float(loss)
    assert torch.equal(x.grad.cpu(), torch.tensor([[-0.5, 0.5]])), x.grad
    assert torch.equal(lowp_ops.softmax(x.detach(), -1).cpu(), torch.tensor([[0.5, 0.5]]))

    row = torch.full((1, 6), 1e38, dtype=torch.bfloat16, device=device)
    probs = lowp_ops.softmax(row, -1).cpu().double()
    # The interpreter truncates bf16 stores: one ulp below the nearest value there.
    assert bool(((probs - 1 / 6).abs() <= 2.0**-10).all()), probs

    big = torch.full((2, 6), 3e38, **f32)
    want = math.log(6.0)
    loss = lowp_ops.cross_entropy(big, torch.tensor([0, 5], device=device), label_smoothing=0.1)
    assert abs(float(loss) - want) <= 8 * FP32_UNIT * want, float(loss)

    lse = lowp_ops.logsumexp(torch.tensor([[math.inf, 1.0], [math.inf, NEG_INF]], **f32), -1)
    assert torch.equal(lse.cpu(), torch.tensor([math.inf, math.inf]))


def test_examples_from_the_issue():
    examples("cpu")


@pytest.mark.interp
def test_interp_examples_from_the_issue():
    assert lowp_ops.library.cpu_runs_triton()
    examples("cpu")


@pytest.mark.gpu
def test_gpu_examples_from_the_issue():
    examples("cuda")


# --------------------------------------------------------- shift invariance: property tests, every path


@REFERENCE_SETTINGS
@given(offset_inputs())
def test_cross_entropy_matches_float64_at_any_offset(case):
    check_cross_entropy(*case)


@REFERENCE_SETTINGS
@given(offset_inputs())
def test_softmax_family_matches_float64_at_any_offset(case):
    check_softmax_family(case[0])


@pytest.mark.interp
@INTERP_SETTINGS
@given(offset_inputs(max_rows=4, max_cols=80))
def test_interp_cross_entropy_matches_float64_at_any_offset(case):
    check_cross_entropy(*case)


@pytest.mark.interp
@INTERP_SETTINGS
@given(offset_inputs(max_rows=4, max_cols=80))
def test_interp_softmax_family_matches_float64_at_any_offset(case):
    check_softmax_family(case[0])


@pytest.mark.gpu
@settings(max_examples=40, deadline=None)
@given(offset_inputs(max_rows=40, max_cols=5000))
def test_gpu_cross_entropy_and_softmax_match_float64_at_any_offset(case):
    logits, target, label_smoothing = case
    check_cross_entropy(logits.cuda(), target.cuda(), label_smoothing)
    check_softmax_family(logits.cuda())


def exact_shift_results(c: float, device: str) -> tuple[torch.Tensor, ...]:
    """Loss, dlogits, softmax and log_softmax of ``x + c`` where every ``x + c`` is exact in fp32 (x on a
    grid of 1/4, |x| <= 8, c a power of two up to 2^20)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randint(-32, 33, (7, 45), generator=gen).double() / 4 + c).float().to(device)
    target = torch.randint(0, 45, (7,), generator=gen).to(device)
    logits = x.clone().requires_grad_()
    loss = lowp_ops.cross_entropy(logits, target, label_smoothing=0.1, reduction="none")
    (dlogits,) = torch.autograd.grad(loss.sum(), logits)
    return loss, dlogits, lowp_ops.softmax(x, -1), lowp_ops.log_softmax(x, -1)


def check_exact_shifts(device: str) -> None:
    """Adding an exactly representable constant changes nothing but fp32 roundoff of ``x - shift``:
    results at ``c`` equal those at 0 within a few ulps of the results themselves (not of ``c``)."""
    base = exact_shift_results(0.0, device)
    for c in (2.0**10, -(2.0**16), 2.0**20):
        for name, got, want in zip(
            ("loss", "dlogits", "softmax", "log_softmax"), exact_shift_results(c, device), base, strict=True
        ):
            torch.testing.assert_close(
                got, want, rtol=8 * FP32_UNIT * 16, atol=8 * FP32_UNIT * 16, msg=f"{name} at c={c}"
            )


def test_exact_shifts_change_nothing_but_roundoff():
    check_exact_shifts("cpu")


@pytest.mark.interp
def test_interp_exact_shifts_change_nothing_but_roundoff():
    check_exact_shifts("cpu")


@pytest.mark.gpu
def test_gpu_exact_shifts_change_nothing_but_roundoff():
    check_exact_shifts("cuda")


# --------------------------------------------- the kernels' online statistics across blocks (interp)


def rising_rows(offset: float, n_cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose maximum moves up block after block (the running shift and the shifted sum are rebased
    at every block), one with a masked leading block, one falling, one of ties; targets spread out."""
    gen = torch.Generator().manual_seed(11)
    ramp = torch.linspace(-20, 20, n_cols, dtype=torch.float64)
    rows = torch.stack([ramp, ramp.flip(0), torch.zeros(n_cols), ramp + torch.randn(n_cols, generator=gen)])
    logits = (rows + offset).to(dtype)
    logits[3, : n_cols // 3] = NEG_INF
    target = torch.tensor([n_cols - 1, 0, n_cols // 2, n_cols - 2])
    return logits, target


@pytest.mark.interp
@pytest.mark.parametrize("offset", [0.0, 1e4, -(2.0**20), 1e30])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_interp_statistics_across_blocks_keep_their_digits(offset, label_smoothing, monkeypatch):
    from lowp_ops.kernels import cross_entropy as ce_kernels
    from lowp_ops.kernels import softmax as softmax_kernels
    from lowp_ops.kernels.launch import clear_plans

    logits, target = rising_rows(offset, 100, torch.float32)
    loss, stats = ce_kernels.launch_cross_entropy_fwd(logits, target, label_smoothing, IGNORE, block=16)
    want_loss, _ = ce_oracle(logits, target, label_smoothing)
    assert_loss_close(loss, want_loss, logits, "loss over blocks of 16")
    one_block_loss, one_block_stats = ce_kernels.launch_cross_entropy_fwd(
        logits, target, label_smoothing, IGNORE
    )
    assert torch.equal(stats[SHIFT], one_block_stats[SHIFT]), "the same shift in one block or many"
    assert_loss_close(one_block_loss, want_loss, logits, "loss in one block")
    monkeypatch.setattr(softmax_kernels, "MAX_BLOCK", 16)
    clear_plans()  # a plan of these shapes would keep the unpatched block
    check_softmax_family(logits)


# ----------------------------------------------------------- log_softmax of an all -inf row ("nan")


def check_all_minus_inf_log_softmax_gradient(device: str) -> None:
    """``masked_rows="nan"``: an all -inf row's log_softmax is NaN and so is its gradient (PyTorch's
    autograd gives NaN too); ``"zero"``: -inf and a zero gradient."""
    x = torch.tensor([[NEG_INF] * 5, [1.0, 2.0, NEG_INF, 0.0, 3.0]], device=device)
    for mode, want_row in (("nan", math.nan), ("zero", 0.0)):
        leaf = x.clone().requires_grad_()
        out = lowp_ops.log_softmax(leaf, -1, masked_rows=mode)
        out.backward(torch.ones_like(out))
        torch_leaf = x.double().cpu().requires_grad_()
        torch.log_softmax(torch_leaf, -1).backward(torch.ones(2, 5, dtype=torch.float64))
        want = torch_leaf.grad.clone()
        want[0] = want_row
        assert torch.equal(torch.isnan(leaf.grad.cpu()), torch.isnan(want)), f"{mode}: {leaf.grad}"
        torch.testing.assert_close(leaf.grad.cpu().double().nan_to_num(7.0), want.nan_to_num(7.0))


def test_all_minus_inf_log_softmax_gradient_matches_torch():
    check_all_minus_inf_log_softmax_gradient("cpu")


@pytest.mark.interp
def test_interp_all_minus_inf_log_softmax_gradient_matches_torch():
    check_all_minus_inf_log_softmax_gradient("cpu")


@pytest.mark.gpu
def test_gpu_all_minus_inf_log_softmax_gradient_matches_torch():
    check_all_minus_inf_log_softmax_gradient("cuda")


# ------------------------------------------------------------------ vocabulary-parallel merge


def sharded_logits(offset: float, world: int, shard: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits near ``offset`` whose shards differ: in some rows one shard sits far below the others
    (its contribution underflows), one is all -inf, one holds the maximum alone."""
    logits, target = logits_with_offset(9, world * shard, offset, torch.float32, seed)
    logits[3, :shard] = float(torch.tensor(offset - 1e3 - abs(offset) * 0.5).float())
    logits[4, shard : 2 * shard] = NEG_INF
    logits[5, -1] = float(torch.tensor(offset + 7.0).float())
    target[5] = world * shard - 1
    return logits, target


def check_vocab_parallel_merge(
    logits: torch.Tensor, target: torch.Tensor, world: int, label_smoothing: float
):
    """Every shard's packet and their merge, in one process, as the ranks compute them; each shard's
    backward with the merged statistics is its columns of the float64 gradient."""
    shard = logits.shape[1] // world
    packets = [
        torch.ops.lowp.vocab_parallel_ce_stats(
            logits[:, r * shard : (r + 1) * shard], target, r * shard, label_smoothing > 0
        )
        for r in range(world)
    ]
    merge = torch.ops.lowp.vocab_parallel_ce_merge
    loss, stats = merge(torch.cat(packets), target, shard, label_smoothing, IGNORE)
    want_loss, want_grad = ce_oracle(logits.cpu(), target.cpu(), label_smoothing)
    assert_loss_close(loss, want_loss, logits, "merged loss")
    row_max = logits.cpu().double().amax(dim=1)
    assert torch.equal(stats[SHIFT].cpu().double(), torch.where(row_max.abs() == math.inf, 0.0, row_max))
    grad_rows = torch.ones_like(loss)
    slack = prob_slack(logits.cpu())
    for r in range(world):
        columns = slice(r * shard, (r + 1) * shard)
        got = torch.ops.lowp.cross_entropy_bwd(
            logits[:, columns].contiguous(),
            target,
            stats,
            grad_rows,
            label_smoothing,
            IGNORE,
            r * shard,
            world * shard,
        )
        assert_within_ulps(
            got.cpu(), want_grad[:, columns], ulps=1, slack=slack[:, columns], what=f"rank {r} grad"
        )


@pytest.mark.parametrize("offset", [0.0, 1e4, 2.0**20, -1e8, 1e30, 3e38])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_vocab_parallel_merge_matches_float64_at_any_offset(offset, label_smoothing):
    check_vocab_parallel_merge(*sharded_logits(offset, 3, 40), 3, label_smoothing)


@pytest.mark.interp
@pytest.mark.parametrize("offset", [1e4, 1e30])
def test_interp_vocab_parallel_merge_matches_float64_at_any_offset(offset):
    check_vocab_parallel_merge(*sharded_logits(offset, 3, 40), 3, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [1e4, 2.0**20, 1e30, 3e38])
def test_gpu_vocab_parallel_merge_matches_float64_at_any_offset(offset):
    logits, target = sharded_logits(offset, 3, 160)
    check_vocab_parallel_merge(logits.cuda(), target.cuda(), 3, 0.1)


def check_gloo_rank(rank: int, world: int, case: tuple[float, float], group) -> None:
    """One rank of a gloo group: the public vocabulary-parallel loss and gradient of its shard at
    ``case = (offset, label_smoothing)`` against float64."""
    offset, label_smoothing = case
    shard = 40
    logits, target = sharded_logits(offset, world, shard)
    columns = slice(rank * shard, (rank + 1) * shard)
    mine = logits[:, columns].contiguous().requires_grad_()
    loss = lowp_ops.cross_entropy(
        mine, target, label_smoothing=label_smoothing, reduction="none", process_group=group
    )
    (grad,) = torch.autograd.grad(loss.sum(), mine)
    want_loss, want_grad = ce_oracle(logits, target, label_smoothing)
    assert_loss_close(loss.detach(), want_loss, logits, f"rank {rank} loss")
    slack = prob_slack(logits)[:, columns]
    assert_within_ulps(grad, want_grad[:, columns], ulps=1, slack=slack, what=f"rank {rank} grad")


def check_gloo(tmp_path, offsets: list[float]) -> None:
    cases = [(offset, label_smoothing) for offset in offsets for label_smoothing in (0.0, 0.1)]
    results = process_groups.run_checks(3, str(tmp_path), "test_large_magnitudes", "check_gloo_rank", cases)
    process_groups.assert_all_passed(results, cases)


def test_gloo_vocab_parallel_loss_and_grad_at_any_offset(tmp_path):
    check_gloo(tmp_path, [1e4, -(2.0**20), 1e30, 3e38])


@pytest.mark.interp
def test_interp_gloo_vocab_parallel_loss_and_grad_at_any_offset(tmp_path):
    check_gloo(tmp_path, [2.0**20, 3e38])


# ------------------------------------------------------------------------------ MXFP8 gradient


def check_mxfp8_contract(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> None:
    """The fused MXFP8 backward equals quantizing the bf16 backward byte for byte (both copies and both
    scale tensors) at large magnitudes too."""
    _, stats = torch.ops.lowp.cross_entropy_fwd(logits, target, label_smoothing, IGNORE)
    grad_rows = torch.rand(target.shape, generator=torch.Generator().manual_seed(4)).to(logits.device) + 0.5
    args = (logits, target, stats, grad_rows, label_smoothing, IGNORE)
    for fp8_dtype, layout in (("e4m3", "compact"), ("e5m2", "swizzled")):
        fused = torch.ops.lowp.cross_entropy_bwd_mxfp8(*args, fp8_dtype, True, True, layout)
        grad = torch.ops.lowp.cross_entropy_bwd(*args)
        quantized = torch.ops.lowp.mxfp8_quantize(grad, fp8_dtype, True, True, layout)
        for name, got, want in zip(
            ("row_data", "row_scale", "col_data", "col_scale"), fused, quantized, strict=True
        ):
            assert torch.equal(got, want), (
                f"{fp8_dtype} {layout} {name}: {int((got != want).sum())} bytes differ"
            )


@pytest.mark.parametrize("offset", [1e4, 1e30, 3e38])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_gradient_is_the_quantized_gradient_at_any_offset(offset, dtype):
    check_mxfp8_contract(*logits_with_offset(40, 160, offset, dtype, seed=6), 0.1)


@pytest.mark.interp
@pytest.mark.parametrize("offset", [2.0**20, 3e38])
def test_interp_mxfp8_gradient_is_the_quantized_gradient_at_any_offset(offset):
    check_mxfp8_contract(*logits_with_offset(40, 160, offset, torch.bfloat16, seed=6), 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [1e4, 2.0**20, 1e30, 3e38])
@pytest.mark.parametrize("n_cols", [160, 4096])
def test_gpu_mxfp8_gradient_is_the_quantized_gradient_at_any_offset(offset, n_cols):
    logits, target = logits_with_offset(70, n_cols, offset, torch.bfloat16, seed=6)
    check_mxfp8_contract(logits.cuda(), target.cuda(), 0.1)  # >= 128 columns, compact: the Gluon kernel


# ------------------------------------------------------------------------------ LM head + loss


def lm_head_inputs(offset: float, n_tokens: int, hidden: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """fp32 ``hidden``, ``weight`` whose logits ``offset + Σ small`` are exact in fp32 whatever the GEMM's
    summation order (integers, quarters, ``|offset| <= 2^20``): hidden[:, 0] = 1, weight[:, 0] = offset."""
    gen = torch.Generator().manual_seed(8)
    h = torch.randint(-2, 3, (n_tokens, hidden), generator=gen).float()
    w = torch.randint(-2, 3, (vocab, hidden), generator=gen).float() / 4
    h[:, 0], w[:, 0] = 1.0, offset
    target = torch.randint(0, vocab, (n_tokens,), generator=gen)
    target[::6] = IGNORE
    return h, w, target


def check_lm_head(offset: float, n_tokens: int, hidden: int, vocab: int, reduction: str) -> None:
    """``linear_cross_entropy`` (fp32) against the float64 loss and gradients of its exact logits."""
    h, w, target = lm_head_inputs(offset, n_tokens, hidden, vocab)
    logits = h.double() @ w.double().t()
    want_rows, want_dlogits = ce_oracle(logits, target, 0.1)
    h_leaf, w_leaf = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = lowp_ops.linear_cross_entropy(h_leaf, w_leaf, target, label_smoothing=0.1, reduction=reduction)
    loss.sum().backward()
    n_valid = int((target != IGNORE).sum())
    scale = 1.0 / n_valid if reduction == "mean" else 1.0
    if reduction == "none":
        assert_loss_close(loss.detach(), want_rows, logits, "per-row loss")
    else:
        assert abs(float(loss) - float(want_rows.sum()) * scale) <= float(loss_slack(logits).sum()) * scale
    dlogits = want_dlogits * scale
    slack = prob_slack(logits) * scale
    # dweight = dlogits^T h, dhidden = dlogits w: the fp32 dlogits error times |h| / |w|, plus fp32 sums.
    want_dw = dlogits.t() @ h.double()
    dw_slack = slack.t() @ h.double().abs() + 4 * n_tokens * FP32_UNIT * (
        dlogits.abs().t() @ h.double().abs()
    )
    assert bool(((w_leaf.grad.double() - want_dw).abs() <= dw_slack + 1e-30).all()), "dweight"
    want_dh = (dlogits @ w.double())[:, 1:]  # column 0 is offset * Σ dlogits = 0: pure roundoff
    small_w = w.double()[:, 1:].abs()
    dh_slack = slack @ small_w + 4 * vocab * FP32_UNIT * (dlogits.abs() @ small_w)
    assert bool(((h_leaf.grad.double()[:, 1:] - want_dh).abs() <= dh_slack + 1e-30).all()), "dhidden"


@pytest.mark.parametrize("offset", [0.0, 1e4, -(2.0**20)])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_lm_head_matches_float64_at_large_offsets(offset, reduction):
    check_lm_head(offset, 24, 32, 100, reduction)


@pytest.mark.interp
@pytest.mark.parametrize("offset", [1e4, 2.0**20])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_interp_lm_head_matches_float64_at_large_offsets(offset, reduction, monkeypatch):
    """Interpreted kernels; ``mean`` with N <= H runs the in-gradient-buffer schedule (the column
    kernels), here on two logits pieces and slices of several blocks (partials rebased twice)."""
    from lowp_ops.kernels import cross_entropy_columns, linear_cross_entropy

    monkeypatch.setattr(linear_cross_entropy, "LOGITS_OUTSIDE_ROWS", 40)
    monkeypatch.setattr(cross_entropy_columns, "STATS_PROGRAMS", 2)
    check_lm_head(offset, 24, 32, 100, reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [1e4, 2.0**20])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_gpu_lm_head_matches_float64_at_large_offsets(offset, reduction):
    check_lm_head_cuda(offset, reduction)


def check_lm_head_cuda(offset: float, reduction: str) -> None:
    """As :func:`check_lm_head` on CUDA, the loss only (fp32 GEMMs: exact logits unless TF32 is on)."""
    h, w, target = lm_head_inputs(offset, 300, 512, 5000)
    h_leaf, w_leaf = h.cuda().requires_grad_(), w.cuda().requires_grad_()
    loss = lowp_ops.linear_cross_entropy(
        h_leaf, w_leaf, target.cuda(), label_smoothing=0.1, reduction=reduction
    )
    logits = h.double() @ w.double().t()
    want_rows, _ = ce_oracle(logits, target, 0.1)
    if reduction == "none":
        assert_loss_close(loss.detach().cpu(), want_rows, logits, "per-row loss")
    else:
        n_valid = int((target != IGNORE).sum())
        assert (
            abs(float(loss) - float(want_rows.sum()) / n_valid) <= float(loss_slack(logits).sum()) / n_valid
        )
