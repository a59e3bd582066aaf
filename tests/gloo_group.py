"""A small gloo process group on loopback for one-off checks (the vocabulary-parallel suites keep their
own, larger runner in :mod:`vocab_parallel_checks`).

``run_checks(world, out_dir, module, function, cases)`` spawns ``world`` ranks; each imports ``module``
and calls ``module.function(rank, world, case, group)`` for every case, recording ``None`` or the
traceback per case in ``out_dir/rank<r>.json``. :func:`assert_all_passed` raises with the first failure.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import traceback

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
    os._exit(0)  # as vocab_parallel_checks: gloo's threads have aborted interpreter teardown


def run_checks(world: int, out_dir: str, module: str, function: str, cases: list) -> list[dict]:
    """Every rank's ``{repr(case): None | traceback}``; the ranks are killed after ``TIMEOUT_S``."""
    context = mp.start_processes(
        _worker,
        args=(world, out_dir, module, function, cases),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gloo group of {world} did not finish in {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def assert_all_passed(results: list[dict], cases: list) -> None:
    for rank, result in enumerate(results):
        assert sorted(result) == sorted(repr(case) for case in cases), f"rank {rank} ran {sorted(result)}"
        for case, error in result.items():
            assert error is None, f"rank {rank}, case {case}:\n{error}"
