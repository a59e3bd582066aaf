"""Vocabulary-parallel LM head + cross entropy (``linear_cross_entropy(..., process_group=)``): the shard
ops in one process (every rank's part computed here, against float64 and the single-rank ops, byte for
byte where the contract says so), and real process groups: gloo on loopback with 2 and 3 ranks, NCCL on
two GPUs (checks in :mod:`linear_vocab_parallel_checks`, spawned by :mod:`vocab_parallel_checks`).
"""

from __future__ import annotations

import linear_vocab_parallel_checks as lm_checks
import pytest
import torch
import vocab_parallel_checks as checks
from ce_softmax_oracles import (
    assert_close_fp32,
    assert_row_stats_close,
    bits,
    ce_loss_fp32_atol,
    cross_entropy_oracle,
    lse_of,
    row_stats64,
)

import lowp_ops
from lowp_ops.meta.vocab_parallel import (
    SHARD_LOG_SUM,
    SHARD_SHIFT,
    SHARD_STATS,
    SHIFTED_SUM,
    TARGET_LOGIT,
    WIDTH,
)
from lowp_ops.reference import linear_cross_entropy as lce_ref
from lowp_ops.reference import linear_vocab_parallel as lvp_ref

IGNORE = -100
SHARD = 64  # a multiple of 32: MXFP8 row-wise blocks never straddle shards


def make_inputs(rows=45, hidden=48, world=3, device="cpu", seed=0):
    """hidden (rows, H), full weight (world * SHARD, H) bf16 (logits of spread ~3), global targets with
    ignored rows and one target in the last shard."""
    gen = torch.Generator().manual_seed(seed)
    vocab = world * SHARD
    h = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * (3 / hidden**0.5)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[::5] = IGNORE
    if rows > 3:
        target[3] = vocab - 5
    return h.bfloat16().to(device), w.bfloat16().to(device), target.to(device)


def shard_rows(weight: torch.Tensor, rank: int) -> torch.Tensor:
    return weight[rank * SHARD : (rank + 1) * SHARD]


def merge_in_process(hidden, weight, target, label_smoothing, chunk_size=16):
    """What the ranks compute, in one process: every shard's packet, stacked as the all-gather does, and
    the merge -> (packets, loss, row_stats)."""
    world = weight.shape[0] // SHARD
    packets = [
        torch.ops.lowp.linear_vocab_parallel_ce_stats(
            hidden, shard_rows(weight, r), target, r * SHARD, label_smoothing > 0, chunk_size
        )
        for r in range(world)
    ]
    merge = torch.ops.lowp.vocab_parallel_ce_merge
    loss, lse = merge(torch.cat(packets), target, SHARD, label_smoothing, IGNORE)
    return packets, loss, lse


def bf16_logits64(hidden, weight) -> torch.Tensor:
    """float64 copy of the op's logits ``bf16(hidden @ weight^T)`` (fp32 accumulation)."""
    return (hidden.cpu().float() @ weight.cpu().float().t()).bfloat16().double()


# ------------------------------------------------------------------------------- one process, ops


def check_packets_and_merge(device, world, label_smoothing):
    hidden, weight, target = make_inputs(world=world, device=device, seed=world)
    packets, loss, lse = merge_in_process(hidden, weight, target, label_smoothing)
    x = bf16_logits64(hidden, weight)
    for r, packet in enumerate(packets):
        assert packet.shape == (len(SHARD_STATS), hidden.shape[0]) and packet.dtype == torch.float32
        columns = slice(r * SHARD, (r + 1) * SHARD)
        assert_row_stats_close(packet[[SHARD_SHIFT, SHARD_LOG_SUM]], x[:, columns], what="shard stats")
        local = target.cpu() - r * SHARD
        in_shard = (local >= 0) & (local < SHARD)
        picked = x[:, columns].gather(1, local.clamp(0, SHARD - 1).unsqueeze(1)).squeeze(1)
        assert torch.equal(packet[TARGET_LOGIT].cpu().double(), torch.where(in_shard, picked, 0.0))
        shifted = x[:, columns] - row_stats64(x[:, columns])[0].unsqueeze(1)
        want_sum = shifted.sum(1) if label_smoothing > 0 else torch.zeros_like(picked)
        assert_close_fp32(packet[SHIFTED_SUM].cpu(), want_sum, rtol=1e-5, atol=1e-4, what="shifted sum")
        assert torch.all(packet[WIDTH] == SHARD)
    want_loss, _, _ = cross_entropy_oracle(
        x, target.cpu(), 1.0, label_smoothing=label_smoothing, ignore_index=IGNORE, reduction="none"
    )
    atol = ce_loss_fp32_atol(x)
    assert_close_fp32(loss.cpu(), want_loss, rtol=1e-5, atol=atol, what="loss")
    assert_row_stats_close(lse, x, what="merged stats")
    single_loss, single_lse = torch.ops.lowp.linear_cross_entropy_fwd(
        hidden, weight, target, label_smoothing, IGNORE, "none", "bf16", 16
    )
    assert_close_fp32(loss.cpu(), single_loss.cpu().double(), rtol=1e-5, atol=atol, what="single-rank loss")
    assert torch.equal(lse[0], single_lse[0]), "the same shift as the single-rank forward"
    assert_close_fp32(
        lse_of(lse.cpu()), lse_of(single_lse.cpu()), rtol=1e-6, atol=1e-6, what="single-rank lse"
    )


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("world", [1, 3])
def test_packets_and_merge_match_float64_and_the_single_rank_forward(world, label_smoothing):
    check_packets_and_merge("cpu", world, label_smoothing)


def recorded_backward(steps, hidden, weight, target, lse, grad_rows, grad_format, other, shard=None):
    """(dhidden, dweight, [(start, end, dlogits or payload)]) of the single-rank schedule (shard None) or
    of one shard's schedule ``shard = (rank, world)``."""
    seen = []

    def record(start, end, dlogits):
        seen.append((start, end, dlogits))

    args = (hidden, weight, target, lse, grad_rows, 0.1, IGNORE, grad_format, other, 16, True, True)
    if shard is None:
        dh, dw = lce_ref.backward_chunks(*args, steps=steps, on_dlogits=record)
    else:
        rank, world = shard
        args = (hidden, shard_rows(weight, rank), *args[2:], rank * SHARD, world * SHARD)
        dh, dw = lvp_ref.bwd_chunks(*args, steps=steps, on_dlogits=record)
    return dh, dw, seen


def assert_dlogits_are_the_columns(got, full, rank, grad_format):
    columns = slice(rank * SHARD, (rank + 1) * SHARD)
    for (start, end, mine), (_, _, whole) in zip(got, full, strict=True):
        if grad_format == "none":
            assert torch.equal(bits(mine), bits(whole[:, columns])), "bf16 dlogits"
            continue
        rows, blocks = end - start, slice(rank * SHARD // 32, (rank + 1) * SHARD // 32)
        assert torch.equal(mine[0].view(torch.uint8), whole[0][:, columns].view(torch.uint8)), "row data"
        assert torch.equal(mine[2].view(torch.uint8), whole[2][:, columns].view(torch.uint8)), "col data"
        assert torch.equal(mine[1][:rows, : SHARD // 32], whole[1][:rows, blocks]), "row scale"
        col_blocks = -(-rows // 32)
        assert torch.equal(mine[3][:col_blocks, :SHARD], whole[3][:col_blocks, columns]), "col scale"


def check_shard_backward(steps, device, grad_format, other_operand, world=3):
    """Given the merged lse, each shard's dlogits are the columns of the single-rank dlogits (bf16, or
    the MXFP8 payload), its dweight the rows of the single-rank dweight (byte for byte), and the shards'
    partial dhidden sum to the single-rank one (up to their bf16 roundings)."""
    hidden, weight, target = make_inputs(world=world, device=device, seed=7)
    _, _, lse = merge_in_process(hidden, weight, target, 0.1)
    grad_rows = (torch.rand(target.shape, generator=torch.Generator().manual_seed(1)) + 0.5).to(device)
    common = (steps, hidden, weight, target, lse, grad_rows, grad_format, other_operand)
    full_dh, full_dw, full_seen = recorded_backward(*common)
    dh_sum = torch.zeros_like(full_dh, dtype=torch.float32)
    for rank in range(world):
        dh, dw, seen = recorded_backward(*common, shard=(rank, world))
        assert_dlogits_are_the_columns(seen, full_seen, rank, grad_format)
        # Equal dlogits bytes (above) make equal dweight rows unless the GEMM library sums a row-subset
        # product in another order (cuBLAS may pick another kernel for another M; not seen on CPU).
        assert torch.equal(bits(dw), bits(shard_rows(full_dw, rank))), f"rank {rank}: dweight rows"
        dh_sum += dh.float()
    scale = full_dh.abs().max().item()
    torch.testing.assert_close(dh_sum.to(full_dh.dtype), full_dh, rtol=1.6e-2, atol=4e-3 * scale)


@pytest.mark.parametrize(
    ("grad_format", "other_operand"), [("none", "bf16"), ("mxfp8_e4m3", "bf16"), ("mxfp8_e5m2", "mxfp8")]
)
def test_shard_backward_is_the_slice_of_the_single_rank_backward(grad_format, other_operand):
    check_shard_backward(lce_ref.REFERENCE_STEPS, "cpu", grad_format, other_operand)


def test_no_tokens_give_empty_packets_and_zero_weight_gradient():
    hidden, weight, target = make_inputs(rows=0, world=2)
    packets, loss, _ = merge_in_process(hidden, weight, target, 0.1)
    assert packets[1].shape == (len(SHARD_STATS), 0) and loss.shape == (0,)
    empty = torch.zeros(0)
    dh, dw = torch.ops.lowp.linear_vocab_parallel_ce_bwd(
        hidden,
        shard_rows(weight, 1),
        target,
        torch.zeros(2, 0),
        empty,
        0.1,
        IGNORE,
        "none",
        "bf16",
        0,
        True,
        True,
        64,
        128,
    )
    assert dh.shape == (0, hidden.shape[1]) and torch.all(dw == 0)


@pytest.mark.parametrize(
    ("vocab_start", "vocab_total", "message"),
    [(-1, 128, "vocab_start must be >= 0"), (100, 128, "must not exceed vocab_total"), (0, 0, "vocab_total")],
)
def test_bad_shard_arguments_are_named(vocab_start, vocab_total, message):
    hidden, weight, target = make_inputs(rows=4, world=2)
    lse, grad_rows = torch.zeros(2, 4), torch.ones(4)
    args = (hidden, shard_rows(weight, 0), target, lse, grad_rows, 0.0, IGNORE, "none", "bf16", 0, True, True)
    with pytest.raises(ValueError, match=message):
        torch.ops.lowp.linear_vocab_parallel_ce_bwd(*args, vocab_start, vocab_total)
    with pytest.raises(ValueError, match="vocab_start must be >= 0"):
        torch.ops.lowp.linear_vocab_parallel_ce_stats(hidden, shard_rows(weight, 0), target, -1, False, 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(process_group=object()), NotImplementedError, "process_group must be a torch.distributed"),
        (dict(reduce_hidden_grad="yes"), TypeError, "reduce_hidden_grad must be a bool"),
    ],
)
def test_bad_public_arguments_are_named(kwargs, error, message):
    hidden, weight, target = make_inputs(rows=4, world=1)
    with pytest.raises(error, match=message):
        lowp_ops.linear_cross_entropy(hidden, weight, target, **kwargs)


def test_opcheck_shard_ops():
    hidden, weight, target = make_inputs(rows=10, world=2)
    shard = shard_rows(weight, 1).t().contiguous().t()  # column-major: a permuted layout
    torch.library.opcheck(torch.ops.lowp.linear_vocab_parallel_ce_stats, (hidden, shard, target, 64, True, 4))
    _, _, lse = merge_in_process(hidden, weight, target, 0.1)
    grad_rows = torch.rand(10) + 0.5
    for grad_format in ("none", "mxfp8_e4m3"):
        args = (
            hidden,
            shard,
            target,
            lse,
            grad_rows,
            0.1,
            IGNORE,
            grad_format,
            "bf16",
            4,
            True,
            True,
            64,
            128,
        )
        torch.library.opcheck(torch.ops.lowp.linear_vocab_parallel_ce_bwd, args)


# ---------------------------------------------------------------- the Triton kernels (interpreter)


@pytest.mark.interp
def test_interp_packets_and_merge_match_float64():
    assert lowp_ops.library.cpu_runs_triton()
    check_packets_and_merge("cpu", 2, 0.1)


@pytest.mark.interp
@pytest.mark.parametrize("grad_format", ["none", "mxfp8_e4m3"])
def test_interp_shard_backward_is_the_slice_of_the_single_rank_backward(grad_format):
    from lowp_ops.kernels.linear_cross_entropy import KERNEL_STEPS

    assert lowp_ops.library.cpu_runs_triton()
    check_shard_backward(KERNEL_STEPS, "cpu", grad_format, "bf16", world=2)


@pytest.mark.interp
def test_interp_gloo_group_runs_the_kernels(tmp_path):
    names = [
        "lm_head_loss_is_identical_on_every_rank_and_matches_single_rank",
        "lm_head_gradients_are_the_shard_of_the_single_rank_gradients",
    ]
    results = checks.run_backend("gloo", 2, str(tmp_path), names)
    for name in names:
        checks.assert_passed(results, name)


# --------------------------------------------------------------------------- real process groups


checks.define_group_tests(globals(), lm_checks.LM_HEAD_CHECKS, "lm_head_cuda_graph_replay_matches_eager")


@pytest.mark.gpu
@pytest.mark.parametrize(("grad_format", "other_operand"), [("none", "bf16"), ("mxfp8_e4m3", "mxfp8")])
def test_gpu_shard_backward_is_the_slice_of_the_single_rank_backward(grad_format, other_operand):
    from lowp_ops.kernels.linear_cross_entropy import KERNEL_STEPS

    check_shard_backward(KERNEL_STEPS, "cuda", grad_format, other_operand)


@pytest.mark.gpu
def test_gpu_packets_and_merge_match_float64():
    check_packets_and_merge("cuda", 3, 0.1)
