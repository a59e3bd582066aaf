"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and a tensor-parallel mesh on CPU with gloo, 2 ranks:

- a small MoE language model whose experts are ``lowp_ops.nn.GroupedSwiGLUMLP`` and whose LM head is
  ``lowp_ops.linear_cross_entropy`` trains for a few steps under FSDP2, each rank on half of every
  batch, with the losses of one process that trains on the whole batches;
- the vocabulary-parallel LM head on a device mesh (README): ``lm_head`` sharded over the vocabulary by
  ``ColwiseParallel``, its local rows and the mesh's process group passed to ``linear_cross_entropy``,
  gives the single-process loss and gradients.
"""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from process_groups import spawn_ranks

import lowp_ops

VOCAB, HIDDEN, FFN, EXPERTS, TOP_K = 64, 32, 32, 4, 2
ROWS, LENGTH, STEPS, LR = 4, 16, 4, 0.5
TIMEOUT_S = 240


class TinyMoELM(torch.nn.Module):
    """Embedding -> top-2 router -> grouped SwiGLU experts (bf16) with a residual -> RMS norm -> LM head
    and loss in one ``linear_cross_entropy`` (fp32 logits, never materialized)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = lowp_ops.nn.GroupedSwiGLUMLP(EXPERTS, HIDDEN, FFN, recipe="bf16")
        self.norm = torch.nn.RMSNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) fp32 -> (T, H) fp32: each token's top-2 experts, sorted by expert on the device."""
        probs, expert = torch.softmax(self.router(x), dim=-1).topk(TOP_K, dim=-1)
        order = torch.argsort(expert.reshape(-1), stable=True)
        split_sizes = torch.zeros(EXPERTS, dtype=torch.int64).scatter_add_(
            0, expert.reshape(-1), torch.ones(expert.numel(), dtype=torch.int64)
        )
        y = self.experts(x[order // TOP_K].bfloat16(), split_sizes, probs.reshape(-1)[order])
        unsorted = torch.empty_like(y).index_copy(0, order, y)
        return unsorted.view(-1, TOP_K, HIDDEN).float().sum(dim=1)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).reshape(-1, HIDDEN)
        x = self.norm(x + self.moe(x))
        return lowp_ops.linear_cross_entropy(x, self.head.weight, target.reshape(-1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS (ids, next-token targets) of ROWS sequences; the same number of ignored targets in each
    half of a batch, so the mean over the batch is the mean of the two halves' means."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (ROWS, LENGTH + 1), generator=gen)
        target = tokens[:, 1:].clone()
        target[:, :3] = -100
        out.append((tokens[:, :-1], target))
    return out


def train(rank: int = 0, world: int = 1) -> list[float]:
    """The loss of every step (averaged over the ranks); with ``world`` > 1 each rank trains on its rows
    of every batch under FSDP2 (experts and the rest sharded as two groups: bf16 and fp32)."""
    torch.manual_seed(0)
    model = TinyMoELM()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.experts)
        fully_shard(model)
        local = model.experts.fc1_weight.to_local()  # a DTensor: each rank holds its experts' rows
        assert local.shape[0] == EXPERTS // world, local.shape
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    losses = []
    for ids, target in batches():
        loss = model(ids[rows], target[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(float(loss))
    return losses


class TinyBody(torch.nn.Module):
    """Embedding -> linear -> RMS norm, fp32: the hidden states every tensor-parallel rank holds whole."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm = torch.nn.RMSNorm(HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.proj(self.embed(ids))))


def head_step(world: int, sequence_parallel: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, full gradient of every parameter) of one step of TinyBody + a bias-free lm_head; with
    ``world`` > 1 the lm_head is vocabulary-parallel on a 1-D mesh of all ranks (README's recipe).

    ``sequence_parallel``: the hidden states reach the head as a DTensor sharded over the sequence,
    gathered with a Partial gradient placement, and ``reduce_hidden_grad=False``: the backward
    reduce-scatters the hidden gradient instead of all-reducing it (the body's replicated parameters then
    get their gradients summed over the ranks, as a sequence-parallel model does)."""
    torch.manual_seed(0)
    body, lm_head = TinyBody(), torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    ids, target = batches()[0]
    hidden, weight, options = body(ids), lm_head.weight, {}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(lm_head, mesh, ColwiseParallel())  # weight: Shard(0), the vocabulary rows
        weight, options = lm_head.weight.to_local(), {"process_group": mesh.get_group("tp")}
        if sequence_parallel:
            mine = hidden.chunk(world, dim=1)[dist.get_rank()]
            gathered = DTensor.from_local(mine, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
            hidden = gathered.to_local(grad_placements=[Partial()])
            options["reduce_hidden_grad"] = False
    loss = lowp_ops.linear_cross_entropy(hidden, weight, target, **options)
    loss.backward()
    grads = {f"body.{name}": p.grad for name, p in body.named_parameters()}
    if sequence_parallel:
        for grad in grads.values():
            dist.all_reduce(grad)
    grads["lm_head.weight"] = lm_head.weight.grad
    if world > 1:
        grads["lm_head.weight"] = grads["lm_head.weight"].full_tensor()
    return loss.detach(), grads


def check_vocab_parallel_head(rank: int, world: int) -> None:
    want_loss, want = head_step(1)
    for sequence_parallel in (False, True):
        loss, grads = head_step(world, sequence_parallel)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        for name, grad in want.items():
            message = f"{name}, sequence_parallel={sequence_parallel}"
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=message)


def _worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=world
    )
    result = {}
    for name, check in (("losses", train), ("vocab_parallel_head", check_vocab_parallel_head)):
        try:
            result[name] = check(rank, world)
        except Exception:
            result[name] = "error"
            result[f"{name}:error"] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown (gloo's threads have aborted it under load)


def run_ranks(world: int, out_dir: str) -> list[dict]:
    return spawn_ranks(_worker, (world, out_dir), world, out_dir, TIMEOUT_S)


def test_one_process_trains():
    """The reference run itself learns (so equal losses below are not two flat lines)."""
    losses = train()
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Both checks in one spawned group of 2 (spawning is the expensive part)."""
    return run_ranks(2, str(tmp_path_factory.mktemp("fsdp2")))


def assert_no_error(results: list[dict], name: str) -> None:
    for rank, result in enumerate(results):
        assert f"{name}:error" not in result, f"rank {rank}:\n{result[f'{name}:error']}"


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_fsdp2_two_ranks_match_one_process(two_ranks):
    want = train()
    assert_no_error(two_ranks, "losses")
    results = two_ranks
    for result in results:
        # Half-batch GEMMs and the gradient reduce-scatter round differently than one whole-batch step
        # (bf16 expert gradients): the updates differ by roundings, the losses by ~1e-6.
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(want), rtol=1e-4, atol=0)
    assert results[0]["losses"] == results[1]["losses"]


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_vocab_parallel_head_on_a_device_mesh(two_ranks):
    assert_no_error(two_ranks, "vocab_parallel_head")
