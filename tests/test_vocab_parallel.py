"""Vocabulary-parallel cross entropy (``process_group=``): the shard statistics and their merge in one
process (against float64 and the single-rank ops), the backward's shard arguments (byte-identical
slices), and real process groups: gloo on loopback with 2 and 3 ranks, NCCL on two GPUs.

The process-group tests spawn each group once (module-scoped fixture) and run every check of
:mod:`vocab_parallel_checks` in it; each test below then reports one check.
"""

from __future__ import annotations

import pytest
import torch
import vocab_parallel_checks as checks
from ce_softmax_oracles import (
    assert_close_fp32,
    assert_row_stats_close,
    bits,
    ce_loss_fp32_atol,
    cross_entropy_oracle,
    row_stats32,
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

IGNORE = -100


def sharded_inputs(rows: int, world: int, shard: int, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab = world * shard
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[::5] = IGNORE
    logits[1, :shard] = float("-inf")  # a masked shard
    logits[2] = float("-inf")  # an all -inf row
    return logits.to(device), target.to(device)


def merge_in_process(logits, target, world, label_smoothing):
    """What the ranks compute, in one process: every shard's packet, stacked as the all-gather does."""
    shard = logits.shape[1] // world
    packets = [
        torch.ops.lowp.vocab_parallel_ce_stats(
            logits[:, r * shard : (r + 1) * shard], target, r * shard, label_smoothing > 0
        )
        for r in range(world)
    ]
    gathered = torch.cat(packets)
    return packets, torch.ops.lowp.vocab_parallel_ce_merge(gathered, target, shard, label_smoothing, IGNORE)


# ------------------------------------------------------------------------------- one process, ops


def check_packets_and_merge(logits, target, world, label_smoothing):
    shard = logits.shape[1] // world
    packets, (loss, stats) = merge_in_process(logits, target, world, label_smoothing)
    x = logits.cpu().double()
    for r, packet in enumerate(packets):
        assert packet.shape == (len(SHARD_STATS), logits.shape[0]) and packet.dtype == torch.float32
        columns = slice(r * shard, (r + 1) * shard)
        assert_row_stats_close(packet[[SHARD_SHIFT, SHARD_LOG_SUM]], x[:, columns], what="shard stats")
        local = target.cpu() - r * shard
        in_shard = (local >= 0) & (local < shard)
        picked = x[:, columns].gather(1, local.clamp(0, shard - 1).unsqueeze(1)).squeeze(1)
        assert torch.equal(packet[TARGET_LOGIT].cpu().double(), torch.where(in_shard, picked, 0.0))
        shifted = x[:, columns] - row_stats64(x[:, columns])[0].unsqueeze(1)
        want_sum = shifted.sum(1) if label_smoothing > 0 else torch.zeros_like(picked)
        assert_close_fp32(packet[SHIFTED_SUM].cpu(), want_sum, rtol=1e-5, atol=1e-4, what="shifted sum")
        assert torch.all(packet[WIDTH] == shard)
    want_loss, _, _ = cross_entropy_oracle(
        x, target.cpu(), 1.0, label_smoothing=label_smoothing, ignore_index=IGNORE, reduction="none"
    )
    want_loss[2] = float("nan")  # all -inf row
    atol = ce_loss_fp32_atol(logits.cpu())
    assert_close_fp32(loss.cpu(), want_loss, rtol=1e-5, atol=atol, what="loss")
    assert_row_stats_close(stats, x, what="merged stats")
    assert stats[1, 2] == float("-inf"), "an all -inf row keeps log_sum = -inf, like the single-rank forward"


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("world", [1, 3])
def test_packets_and_merge_match_float64(world, label_smoothing):
    logits, target = sharded_inputs(37, world, 96, seed=world)
    check_packets_and_merge(logits, target, world, label_smoothing)


def test_merge_poisons_unequal_shard_widths():
    logits, target = sharded_inputs(9, 2, 64)
    packets, _ = merge_in_process(logits, target, 2, 0.0)
    packets[1][WIDTH] = 32
    loss, stats = torch.ops.lowp.vocab_parallel_ce_merge(torch.cat(packets), target, 64, 0.0, IGNORE)
    assert torch.isnan(loss).all() and torch.isnan(stats).all()


def shard_backward_matches_slice(device, label_smoothing, mxfp8, shard=64):
    """Each rank's backward of its vocabulary shard is the slice of the whole-vocabulary backward (on
    CUDA, shards of >= 128 columns run the Gluon MXFP8 kernel, narrower ones Triton's)."""
    world = 3
    logits, target = sharded_inputs(45, world, shard, device=device, seed=7)
    target[3] = 2 * shard + 5  # in the last shard
    target[4] = world * shard  # out of range: NaN row everywhere
    _, (_, stats) = merge_in_process(logits, target, world, label_smoothing)
    grad_rows = torch.rand(target.shape, generator=torch.Generator().manual_seed(1)).to(device) + 0.5
    common = (target, stats, grad_rows, label_smoothing, IGNORE)
    mx = ("e4m3", True, True, "compact")
    op = torch.ops.lowp.cross_entropy_bwd_mxfp8 if mxfp8 else torch.ops.lowp.cross_entropy_bwd
    full = op(logits, *common, *mx) if mxfp8 else op(logits, *common)
    for r in range(world):
        columns = slice(r * shard, (r + 1) * shard)
        shard_args = (r * shard, world * shard)
        if mxfp8:
            got = op(logits[:, columns].contiguous(), *common, *mx, *shard_args)
            assert torch.equal(bits(got[0]), bits(full[0][:, columns])), "row data"
            assert torch.equal(bits(got[2]), bits(full[2][:, columns])), "col data"
            blocks = slice(r * shard // 32, (r + 1) * shard // 32)
            assert torch.equal(got[1][:45, : shard // 32], full[1][:45, blocks]), "row scale"
            assert torch.equal(got[3][:2, :shard], full[3][:2, columns]), "col scale"
        else:
            got = op(logits[:, columns].contiguous(), *common, *shard_args)
            assert torch.equal(bits(got), bits(full[:, columns]))
            assert torch.isnan(got[4]).all()


@pytest.mark.parametrize("mxfp8", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_shard_backward_is_the_slice_of_the_full_backward(label_smoothing, mxfp8):
    shard_backward_matches_slice("cpu", label_smoothing, mxfp8)


def test_shard_backward_defaults_are_the_single_rank_backward():
    logits, target = sharded_inputs(20, 1, 100)
    stats = row_stats32(logits)
    grad_rows = torch.ones(20)
    plain = torch.ops.lowp.cross_entropy_bwd(logits, target, stats, grad_rows, 0.1, IGNORE)
    explicit = torch.ops.lowp.cross_entropy_bwd(logits, target, stats, grad_rows, 0.1, IGNORE, 0, 100)
    assert torch.equal(bits(plain), bits(explicit))


@pytest.mark.parametrize(
    ("vocab_start", "vocab_total", "message"),
    [(-1, 200, "vocab_start must be >= 0"), (150, 200, "must not exceed vocab_total"), (5, 0, "must be 0")],
)
def test_bad_shard_arguments_are_named(vocab_start, vocab_total, message):
    logits, target = sharded_inputs(4, 1, 100)
    stats, grad_rows = torch.zeros(2, 4), torch.ones(4)
    with pytest.raises(ValueError, match=message):
        torch.ops.lowp.cross_entropy_bwd(
            logits, target, stats, grad_rows, 0.0, IGNORE, vocab_start, vocab_total
        )


def test_opcheck_vocab_parallel_ops():
    logits, target = sharded_inputs(10, 2, 64)
    logits[1:3] = 0.5  # finite rows only (opcheck's comparisons treat NaN as unequal)
    shard = logits[:, 64:].t().contiguous().t()  # column-major: a permuted layout
    torch.library.opcheck(torch.ops.lowp.vocab_parallel_ce_stats, (shard, target, 64, True))
    gathered = torch.cat(merge_in_process(logits, target, 2, 0.1)[0])
    torch.library.opcheck(torch.ops.lowp.vocab_parallel_ce_merge, (gathered, target, 64, 0.1, IGNORE))
    stats, grad_rows = torch.zeros(2, 10), torch.ones(10)
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_bwd, (shard, target, stats, grad_rows, 0.1, IGNORE, 64, 128)
    )


# ---------------------------------------------------------------- the Triton kernels (interpreter)


@pytest.mark.interp
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_interp_packets_and_merge_match_float64(label_smoothing):
    assert lowp_ops.library.cpu_runs_triton()
    logits, target = sharded_inputs(37, 3, 96, seed=3)
    check_packets_and_merge(logits, target, 3, label_smoothing)


@pytest.mark.interp
@pytest.mark.parametrize("mxfp8", [False, True])
def test_interp_shard_backward_is_the_slice_of_the_full_backward(mxfp8):
    assert lowp_ops.library.cpu_runs_triton()
    shard_backward_matches_slice("cpu", 0.1, mxfp8)


@pytest.mark.interp
def test_interp_gloo_group_runs_the_kernels(tmp_path):
    names = ["loss_is_identical_on_every_rank_and_matches_float64", "masked_shards_are_safe"]
    results = checks.run_backend("gloo", 2, str(tmp_path), names)
    for name in names:
        checks.assert_passed(results, name)


# --------------------------------------------------------------------------- real process groups


checks.define_group_tests(globals(), checks.CPU_CHECKS, "cuda_graph_replay_matches_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("shard", [64, 160])
@pytest.mark.parametrize("mxfp8", [False, True])
def test_gpu_shard_backward_is_the_slice_of_the_full_backward(mxfp8, shard):
    shard_backward_matches_slice("cuda", 0.1, mxfp8, shard)


@pytest.mark.gpu
def test_gpu_packets_and_merge_match_float64():
    logits, target = sharded_inputs(37, 3, 96, device="cuda", seed=3)
    check_packets_and_merge(logits, target, 3, 0.1)
