"""Per-rank checks of the vocabulary-parallel cross entropy, run inside a spawned process group.

``run_group(world, backend, device, out_dir, check_names)`` spawns ``world`` ranks (gloo on loopback for
CPU, NCCL with one GPU per rank), each runs every named check in one group (spawning is the expensive
part) and writes ``{check: None | error text}`` to ``out_dir/rank<r>.json``. Every rank builds the full
logits from the same seed, so it can compare its shard with the single-process result; the float64
oracles of :mod:`ce_softmax_oracles` keep the comparisons independent of the code under test.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from ce_softmax_oracles import (
    assert_close_fp32,
    assert_within_ulps,
    bits,
    ce_loss_fp32_atol,
    cross_entropy_oracle,
    features_oracle,
)
from cudagraph_checks import capture
from process_groups import spawn_ranks

import lowp_ops
from lowp_ops.distributed import vocab_parallel_cross_entropy_stats

SHARD = 64  # shard width: a multiple of 32 (MXFP8 row blocks never straddle shards)
ROWS = 67  # not a multiple of 32: partial tiles and partial column-wise scale blocks
IGNORE = -100
CHECKS: dict[str, Callable] = {}
# NVLink multicast stays off on the shared GPU hosts (device notes), also in spawned ranks.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def check(fn: Callable) -> Callable:
    CHECKS[fn.__name__] = fn
    return fn


class Rank:
    """This process's place in the group and the shared full-vocabulary inputs."""

    def __init__(self, group: dist.ProcessGroup, device: str):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.columns = slice(self.rank * SHARD, (self.rank + 1) * SHARD)

    def inputs(self, seed: int, dtype=torch.bfloat16, rows: int = ROWS):
        """(full logits (rows, W*SHARD), global targets (rows,)) equal on every rank; a few ignored rows;
        every shard's logit sum is far from 0 (rank r's logits are shifted by 2 (r + 1)), so a smoothing
        sum over the local shard only shows up in the loss."""
        gen = torch.Generator().manual_seed(seed)
        vocab = self.world * SHARD
        logits = torch.randn(rows, vocab, generator=gen) * 3
        logits += 2 * (torch.arange(vocab).div(SHARD, rounding_mode="floor").float() + 1)
        target = torch.randint(0, vocab, (rows,), generator=gen)
        target[::7] = IGNORE
        return logits.to(dtype).to(self.device), target.to(self.device)

    def row_weights(self, seed: int, rows: int = ROWS) -> torch.Tensor:
        """A per-row upstream gradient in [0.5, 1.5), equal on every rank."""
        return (torch.rand(rows, generator=torch.Generator().manual_seed(seed)) + 0.5).to(self.device)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full[..., self.columns].contiguous()

    def gather_bytes(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's raw bytes of ``x`` (uint8: NCCL has no int16)."""
        raw = x.detach().contiguous().reshape(-1).view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(self.world)]
        dist.all_gather(parts, raw, group=self.group)
        return parts


def loss_and_grad(fn, logits, target, grad_loss=None, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, target, **kwargs)
    grad_loss = torch.ones_like(loss) if grad_loss is None else grad_loss
    (grad,) = torch.autograd.grad(loss, leaf, grad_outputs=grad_loss)
    return loss.detach(), grad


def assert_same_on_every_rank(r: Rank, x: torch.Tensor, what: str) -> None:
    mine = x.detach().contiguous().reshape(-1).view(torch.uint8)
    for other, part in enumerate(r.gather_bytes(x)):
        assert torch.equal(part, mine), f"{what}: rank {other} differs from rank {r.rank}"


@check
def loss_is_identical_on_every_rank_and_matches_float64(r: Rank):
    for reduction in ("mean", "sum", "none"):
        for ls in (0.0, 0.1):
            logits, target = r.inputs(1)
            loss = lowp_ops.cross_entropy(
                r.shard(logits),
                target,
                label_smoothing=ls,
                reduction=reduction,
                process_group=r.group,
                classes_last=True,
            )
            assert_same_on_every_rank(r, loss, f"loss {reduction} ls={ls}")
            want, _, _ = cross_entropy_oracle(
                logits.cpu(), target.cpu(), 1.0, label_smoothing=ls, ignore_index=IGNORE, reduction=reduction
            )
            atol = ce_loss_fp32_atol(logits.cpu())
            assert_close_fp32(loss.cpu(), want, rtol=1e-5, atol=atol, what=f"loss {reduction} ls={ls}")


@check
def label_smoothing_exchanges_the_logit_sum(r: Rank):
    """TE sums the smoothing term over the local shard only (docs/cross_entropy.md#vocabulary-parallel):
    that loss differs from the oracle by far more than the tolerance here, and ours matches the oracle."""
    ls = 0.2
    logits, target = r.inputs(2)
    loss = lowp_ops.cross_entropy(
        r.shard(logits), target, label_smoothing=ls, process_group=r.group, classes_last=True
    )
    want, _, _ = cross_entropy_oracle(
        logits.cpu(), target.cpu(), 1.0, label_smoothing=ls, ignore_index=IGNORE, reduction="mean"
    )
    atol = ce_loss_fp32_atol(logits.cpu())
    assert_close_fp32(loss.cpu(), want, rtol=1e-5, atol=atol, what="loss")
    x = logits.cpu().double()
    valid = target.cpu() != IGNORE
    vocab = x.shape[1]
    local_mean_error = ls * (x.sum(1) - x[:, r.columns].sum(1)) / vocab  # TE's loss minus the true loss
    te_loss = want + local_mean_error[valid].sum() / valid.sum()
    assert abs(float(te_loss - want)) > 100 * atol, "inputs too weak to expose the local smoothing sum"


@check
def gradient_is_the_shard_of_the_single_rank_gradient(r: Rank):
    for reduction, ls in (("mean", 0.0), ("none", 0.1), ("sum", 0.1)):
        logits, target = r.inputs(3)
        grad_loss = r.row_weights(30) if reduction == "none" else None
        kwargs = dict(label_smoothing=ls, reduction=reduction)
        _, grad = loss_and_grad(
            lowp_ops.cross_entropy, r.shard(logits), target, grad_loss, process_group=r.group, **kwargs
        )
        assert grad.dtype == torch.bfloat16
        # Byte for byte: the single-rank backward op on the full logits with the same (merged) lse.
        _, lse = vocab_parallel_cross_entropy_stats(r.shard(logits), target, ls, IGNORE, r.group)
        rows = grad_loss if grad_loss is not None else torch.ones_like(target, dtype=torch.float32)
        if reduction == "mean":
            rows = rows / (target != IGNORE).sum()
        full = torch.ops.lowp.cross_entropy_bwd(logits, target, lse, rows.float(), ls, IGNORE)
        assert torch.equal(bits(grad), bits(full[:, r.columns])), f"grad {reduction} ls={ls}: not the slice"
        # And within one bf16 ulp (plus fp32 slack) of the float64 gradient.
        _, want, _ = cross_entropy_oracle(
            logits.cpu(),
            target.cpu(),
            1.0 if grad_loss is None else grad_loss.cpu(),
            label_smoothing=ls,
            ignore_index=IGNORE,
            reduction=reduction,
        )
        assert_within_ulps(grad.cpu(), want[:, r.columns], slack=1e-6, what=f"grad {reduction} ls={ls}")


@check
def ignored_rows_give_zero_loss_and_gradient(r: Rank):
    logits, target = r.inputs(4)
    target[: ROWS // 2] = IGNORE
    loss, grad = loss_and_grad(
        lowp_ops.cross_entropy, r.shard(logits), target, reduction="none", process_group=r.group
    )
    ignored = target == IGNORE
    assert torch.all(loss[ignored] == 0) and torch.all(loss[~ignored] > 0)
    assert torch.all(grad[ignored] == 0)
    target[:] = IGNORE
    loss, grad = loss_and_grad(lowp_ops.cross_entropy, r.shard(logits), target, process_group=r.group)
    assert torch.isnan(loss), "mean over no rows is NaN, like PyTorch"
    assert torch.all(grad == 0)


@check
def masked_shards_are_safe(r: Rank):
    """Row 0: rank 0's whole shard is -inf; row 1: every shard but the last is -inf and the target sits
    in a masked shard (loss +inf); row 2: all -inf (NaN, like the single rank); row 3 ignored and all -inf
    (loss 0, gradient 0)."""
    for ls in (0.0, 0.1):
        logits, target = r.inputs(5, dtype=torch.float32)
        logits[0, :SHARD] = float("-inf")
        logits[1, : (r.world - 1) * SHARD] = float("-inf")
        target[1] = 3
        logits[2:4] = float("-inf")
        target[3] = IGNORE
        loss, grad = loss_and_grad(
            lowp_ops.cross_entropy,
            r.shard(logits),
            target,
            label_smoothing=ls,
            reduction="none",
            process_group=r.group,
        )
        want_loss, want_grad, _ = cross_entropy_oracle(
            logits.cpu(), target.cpu(), 1.0, label_smoothing=ls, ignore_index=IGNORE, reduction="none"
        )
        want_loss[2] = want_grad[2] = float("nan")  # the all -inf row: NaN like PyTorch
        atol = ce_loss_fp32_atol(logits.cpu())
        assert_close_fp32(loss.cpu(), want_loss, rtol=1e-5, atol=atol, what=f"loss ls={ls}")
        assert_close_fp32(grad.cpu(), want_grad[:, r.columns], rtol=1e-5, atol=1e-6, what=f"grad ls={ls}")
        assert_same_on_every_rank(r, loss, "loss")


@check
def out_of_range_target_gives_nan(r: Rank):
    logits, target = r.inputs(6)
    target[1] = r.world * SHARD  # one past the global vocabulary: NaN, though it is in no shard
    target[2] = -5
    loss, grad = loss_and_grad(
        lowp_ops.cross_entropy, r.shard(logits), target, reduction="none", process_group=r.group
    )
    assert torch.isnan(loss[1:3]).all() and not torch.isnan(loss[3:]).any()
    assert torch.isnan(grad[1:3]).all() and not torch.isnan(grad[3:]).any()


@check
def unequal_shards_give_nan_on_every_rank(r: Rank):
    _, target = r.inputs(7)
    width = SHARD + (32 if r.rank == 0 else 0)
    local = torch.randn(ROWS, width, device=r.device).to(torch.bfloat16)
    target = target.clamp(max=SHARD - 1)
    loss = lowp_ops.cross_entropy(local, target, reduction="none", process_group=r.group, classes_last=True)
    assert torch.isnan(loss).all(), "unequal shard widths must poison the loss"


@check
def mxfp8_gradient_is_the_shard_of_the_single_rank_payload(r: Rank):
    for fp8_dtype, ls, reduction in (("e4m3", 0.1, "none"), ("e5m2", 0.0, "mean")):
        logits, target = r.inputs(8)
        grad_loss = r.row_weights(80) if reduction == "none" else None
        loss, payload = lowp_ops.cross_entropy_with_mxfp8_grad(
            r.shard(logits),
            target,
            grad_loss,
            label_smoothing=ls,
            reduction=reduction,
            fp8_dtype=fp8_dtype,
            process_group=r.group,
        )
        assert_same_on_every_rank(r, loss, "loss")
        _, lse = vocab_parallel_cross_entropy_stats(r.shard(logits), target, ls, IGNORE, r.group)
        rows = grad_loss if grad_loss is not None else torch.ones_like(target, dtype=torch.float32)
        if reduction == "mean":
            rows = rows / (target != IGNORE).sum()
        full = torch.ops.lowp.cross_entropy_bwd_mxfp8(
            logits, target, lse, rows.float(), ls, IGNORE, fp8_dtype, True, True, "compact"
        )
        row_data, row_scale, col_data, col_scale = (t.view(torch.uint8) for t in full)
        cols, blocks = r.columns, slice(r.rank * SHARD // 32, (r.rank + 1) * SHARD // 32)
        col_blocks = -(-ROWS // 32)
        what = f"{fp8_dtype} ls={ls} {reduction}"
        assert torch.equal(payload.row_data.view(torch.uint8), row_data[:, cols]), f"{what}: row data"
        assert torch.equal(payload.col_data.view(torch.uint8), col_data[:, cols]), f"{what}: col data"
        got_row_scale, got_col_scale = (
            payload.row_scale.view(torch.uint8),
            payload.col_scale.view(torch.uint8),
        )
        assert torch.equal(got_row_scale[:ROWS, : SHARD // 32], row_scale[:ROWS, blocks]), (
            f"{what}: row scale"
        )
        assert torch.equal(got_col_scale[:col_blocks, :SHARD], col_scale[:col_blocks, cols]), (
            f"{what}: col scale"
        )
        assert torch.all(got_row_scale[ROWS:] == 0) and torch.all(got_col_scale[col_blocks:] == 0), "padding"


@check
def compiled_fullgraph_matches_eager(r: Rank):
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = "inductor" if r.device.startswith("cuda") else "aot_eager"
    counter = CompileCounterWithBackend(backend)

    def step(logits, target):
        return lowp_ops.cross_entropy(
            logits, target, label_smoothing=0.1, process_group=r.group, classes_last=True
        )

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for seed in (9, 10):
        logits, target = r.inputs(seed)
        want_loss, want_grad = loss_and_grad(step, r.shard(logits), target)
        loss, grad = loss_and_grad(compiled, r.shard(logits), target)
        if backend == "aot_eager":
            assert torch.equal(bits(loss), bits(want_loss)), "compiled loss differs from eager"
            assert torch.equal(bits(grad), bits(want_grad)), "compiled gradient differs from eager"
        else:
            # Inductor fuses the mean's sum and division differently from eager (the H200 run saw the
            # loss differ in its last bits); the ops' own outputs are the same kernels either way.
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
            torch.testing.assert_close(grad, want_grad, rtol=1e-2, atol=2**-20)
        assert_same_on_every_rank(r, loss, "compiled loss")
    assert counter.frame_count == 1, f"{counter.frame_count} graphs (want one, no recompile)"


@check
def batched_logits_keep_their_shape(r: Rank):
    logits, target = r.inputs(11, rows=2 * 5)
    shard = r.shard(logits).view(2, 5, SHARD)
    loss, grad = loss_and_grad(
        lowp_ops.cross_entropy,
        shard,
        target.view(2, 5),
        reduction="none",
        classes_last=True,
        process_group=r.group,
    )
    assert loss.shape == (2, 5) and grad.shape == shard.shape


@check
def cuda_graph_replay_matches_eager(r: Rank):
    """NCCL inside a captured forward+backward: replay with new logits and targets equals eager."""
    logits, target = r.inputs(12)
    static_logits = r.shard(logits).requires_grad_()
    static_target = target.clone()

    def step():
        loss = lowp_ops.cross_entropy(
            static_logits, static_target, label_smoothing=0.1, process_group=r.group, classes_last=True
        )
        (grad,) = torch.autograd.grad(loss, static_logits)
        return loss, grad

    graph, (static_loss, static_grad) = capture(step)
    for seed in (13, 14):
        new_logits, new_target = r.inputs(seed)
        with torch.no_grad():
            static_logits.copy_(r.shard(new_logits))
        static_target.copy_(new_target)
        graph.replay()
        torch.cuda.synchronize()
        want_loss, want_grad = loss_and_grad(
            lowp_ops.cross_entropy,
            r.shard(new_logits),
            new_target,
            label_smoothing=0.1,
            process_group=r.group,
        )
        assert torch.equal(bits(static_loss), bits(want_loss)), f"seed {seed}: replayed loss"
        assert torch.equal(bits(static_grad), bits(want_grad)), f"seed {seed}: replayed gradient"
        assert_same_on_every_rank(r, static_loss, "replayed loss")


FEATURE_CASES = ({"z_loss": 1e-3}, {"softcap": 5.0}, {"z_loss": 1e-3, "softcap": 5.0, "label_smoothing": 0.1})


@check
def loss_features_are_identical_on_every_rank_and_match_float64(r: Rank):
    """z-loss, soft-capping and both with smoothing across the group: loss, z-loss, lse equal on every
    rank and, like each rank's gradient shard, at fp32 precision of the float64 definitions."""
    for kwargs in FEATURE_CASES:
        for reduction in ("mean", "none"):
            logits, target = r.inputs(5, dtype=torch.float32)
            grad_loss = r.row_weights(50) if reduction == "none" else None
            leaf = r.shard(logits).requires_grad_()
            loss, z_value, lse = lowp_ops.cross_entropy(
                leaf, target, reduction=reduction, process_group=r.group, classes_last=True,
                return_z_loss=True, return_lse=True, **kwargs,
            )  # fmt: skip
            upstream = torch.ones_like(loss) if grad_loss is None else grad_loss
            (grad,) = torch.autograd.grad(loss, leaf, grad_outputs=upstream)
            what = f"{kwargs} {reduction}"
            for name, value in (("loss", loss), ("z_loss", z_value), ("lse", lse)):
                assert_same_on_every_rank(r, value, f"{name} {what}")
            want = features_oracle(
                logits.cpu(), target.cpu(), 1.0 if grad_loss is None else grad_loss.cpu(),
                ignore_index=IGNORE, reduction=reduction, **kwargs,
            )  # fmt: skip
            torch.testing.assert_close(loss.detach().cpu().double(), want[0], rtol=2e-5, atol=1e-5, msg=what)
            torch.testing.assert_close(z_value.cpu().double(), want[2], rtol=2e-5, atol=1e-6, msg=what)
            torch.testing.assert_close(lse.cpu().double(), want[3], rtol=1e-6, atol=1e-5, msg=what)
            scale = want[1].abs().max().item()
            mine = want[1][:, r.columns]
            torch.testing.assert_close(grad.cpu().double(), mine, rtol=2e-5, atol=2e-5 * scale, msg=what)


CPU_CHECKS = [name for name in CHECKS if name != "cuda_graph_replay_matches_eager"]


def _worker(rank: int, world: int, backend: str, device: str, out_dir: str, names: list[str]) -> None:
    if device == "cuda":
        os.environ.update(NCCL_ENV)
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    init = f"file://{os.path.join(out_dir, 'store')}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    results = {}
    try:
        r = Rank(dist.group.WORLD, device)
        for name in names:
            started = time.perf_counter()
            try:
                torch._dynamo.reset()
                CHECKS[name](r)
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
            results[f"{name}:seconds"] = round(time.perf_counter() - started, 2)
            dist.barrier()  # a failed check must not leave a collective half-done for the next one
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
    os._exit(0)  # as process_groups._worker: gloo's threads have aborted interpreter teardown


def run_group(
    world: int, backend: str, device: str, out_dir: str, names: list[str], timeout_s: float
) -> list[dict]:
    """Spawn the group, wait at most ``timeout_s`` (then kill the ranks), return each rank's results."""
    return spawn_ranks(
        _worker,
        (world, backend, device, out_dir, names),
        world,
        out_dir,
        timeout_s,
        finished=lambda results: results is not None and all(name in results for name in names),
    )


GROUP_TIMEOUT_S = 240
NCCL_TIMEOUT_S = 480  # first NCCL communicators and Inductor compiles on the GPU machine


def run_backend(backend: str, world: int, out_dir: str, names: list[str]) -> list[dict]:
    """:func:`run_group` on CPU tensors (gloo) or on two GPUs (nccl; the test is skipped without them)."""
    if backend == "gloo":
        return run_group(world, "gloo", "cpu", out_dir, names, GROUP_TIMEOUT_S)
    if torch.cuda.device_count() < world:
        import pytest

        pytest.skip(f"needs {world} GPUs")
    return run_group(world, "nccl", "cuda", out_dir, names, NCCL_TIMEOUT_S)


def assert_passed(results: list[dict], name: str) -> None:
    for rank, result in enumerate(results):
        assert result[name] is None, f"rank {rank} of {len(results)}:\n{result[name]}"


# ------------------------------------------------- checks of the vocabulary-parallel LM head
# Registered into CHECKS by importing their module here, so that the spawned ranks (which import this
# module to find _worker) know them too.
import linear_vocab_parallel_checks  # noqa: E402, F401


def define_group_tests(namespace: dict, names: list[str], graph_check: str) -> None:
    """Add to a test module's ``namespace`` the tests that run the check functions ``names`` in real
    process groups: ``test_gloo`` (2 and 3 CPU ranks), ``test_nccl`` (2 GPUs) and
    ``test_nccl_cuda_graph_replay_matches_eager`` (the check ``graph_check`` in its own process)."""
    import pytest

    @pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"gloo{world}")
    def gloo_results(request, tmp_path_factory):
        return run_backend("gloo", request.param, str(tmp_path_factory.mktemp("gloo")), names)

    @pytest.fixture(scope="module")
    def nccl_results(tmp_path_factory):
        return run_backend("nccl", 2, str(tmp_path_factory.mktemp("nccl2")), names)

    each_check = pytest.mark.parametrize("name", names)

    @each_check
    def test_gloo(gloo_results, name):
        assert_passed(gloo_results, name)

    @pytest.mark.gpu
    @pytest.mark.multigpu
    @each_check
    def test_nccl(nccl_results, name):
        assert_passed(nccl_results, name)

    @pytest.mark.gpu
    @pytest.mark.multigpu
    @pytest.mark.cudagraph
    def test_nccl_cuda_graph_replay_matches_eager(tmp_path):
        assert_passed(run_backend("nccl", 2, str(tmp_path), [graph_check]), graph_check)

    namespace.update(
        gloo_results=gloo_results,
        nccl_results=nccl_results,
        test_gloo=test_gloo,
        test_nccl=test_nccl,
        test_nccl_cuda_graph_replay_matches_eager=test_nccl_cuda_graph_replay_matches_eager,
    )
