"""Process groups of spawned ranks for the distributed tests (vocabulary-parallel losses, FSDP2, the
gloo checks of single test files).

:func:`spawn_ranks` starts ``world`` ranks of a worker that writes its results to
``out_dir/rank<r>.json``, waits for them (killing them after a timeout) and returns every rank's
results; each suite's worker decides what a result is.

``run_checks(world, out_dir, module, function, cases)`` is a small gloo group on loopback for one-off
checks: each rank imports ``module`` and calls ``module.function(rank, world, case, group)`` for every
case, recording ``None`` or the traceback per case. :func:`assert_all_passed` raises with the first
failure.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import traceback
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 240


def _worker(rank: int, world: int, out_dir: str, module: str, function: str, cases: list) -> None:
    init = f"file://{os.path.join(out_dir, 'store')}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = {}
    try:
        check = getattr(importlib.import_module(module), function)
        for case in cases:
            try:
                check(rank, world, case, dist.group.WORLD)
                results[repr(case)] = None
            except Exception:
                results[repr(case)] = traceback.format_exc()
            dist.barrier()  # a failed case must not leave a collective half-done for the next one
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
    # Skip interpreter teardown: under load, gloo's background threads have aborted it ("terminate
    # called without an active exception") after every check had passed and been written out.
    os._exit(0)


def read_results(out_dir: str, rank: int) -> dict | None:
    """``out_dir/rank<rank>.json`` as written by a worker; None while it does not exist."""
    path = os.path.join(out_dir, f"rank{rank}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def spawn_ranks(
    worker: Callable,
    args: tuple,
    world: int,
    out_dir: str,
    timeout_s: float,
    finished: Callable[[dict | None], bool] | None = None,
) -> list[dict]:
    """Spawn ``worker(rank, *args)`` on ``world`` ranks, wait at most ``timeout_s`` (then kill them) and
    return each rank's :func:`read_results`. ``finished``: a rank that exits abnormally after writing
    results that ``finished`` accepts died in teardown, not in a check (its results stand)."""
    context = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a group of {world} ranks did not finish in {timeout_s} s")
    except mp.ProcessExitedException:
        if finished is None or not all(finished(read_results(out_dir, rank)) for rank in range(world)):
            raise
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [read_results(out_dir, rank) for rank in range(world)]


def run_checks(world: int, out_dir: str, module: str, function: str, cases: list) -> list[dict]:
    """Every rank's ``{repr(case): None | traceback}``; the ranks are killed after ``TIMEOUT_S``."""
    return spawn_ranks(_worker, (world, out_dir, module, function, cases), world, out_dir, TIMEOUT_S)


def assert_all_passed(results: list[dict], cases: list) -> None:
    for rank, result in enumerate(results):
        assert sorted(result) == sorted(repr(case) for case in cases), f"rank {rank} ran {sorted(result)}"
        for case, error in result.items():
            assert error is None, f"rank {rank}, case {case}:\n{error}"
