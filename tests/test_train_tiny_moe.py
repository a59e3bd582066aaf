"""The main job, examples/train_tiny_moe.py: a short CPU run learns with zero graph breaks; on CUDA the
CUDA-graph run reproduces the eager run's losses bit for bit. Each run is its own process (Dynamo state
and a CUDA-graph capture stay out of the test process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(
    r"^steps=(\d+) first_loss=([\d.]+) last_loss=([\d.]+) graph_breaks=(\d+) recompiles=(\d+)"
    r" tokens_per_s=(\d+)$"
)


def run_example(*args: str, timeout: int = 600) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_tiny_moe.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_short_cpu_run_learns_with_no_graph_break_and_no_recompile():
    out = run_example("--steps", "12", "--device", "cpu")
    last_line = out.strip().splitlines()[-1]
    match = SUMMARY.match(last_line)
    assert match, f"last line does not follow the contract: {last_line!r}"
    steps, first, last, breaks, recompiles, _ = match.groups()
    assert int(steps) == 12
    assert float(last) < float(first) - 0.5, (first, last)  # ln(256) = 5.55 at the start
    assert int(breaks) == 0
    assert int(recompiles) == 0


def test_plot_trains_the_three_recipes_and_writes_a_png(tmp_path):
    path = tmp_path / "losses.png"
    out = run_example("--steps", "2", "--device", "cpu", "--plot", str(path))
    recipes = [line.split()[0] for line in out.splitlines() if line.startswith("recipe=")]
    assert sorted(recipes) == ["recipe=bf16", "recipe=mxfp8", "recipe=nvfp4"]
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 200
    assert SUMMARY.match(out.strip().splitlines()[-1])


def test_bad_arguments_are_rejected_with_the_argument_named():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_tiny_moe.py"), "--steps", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "--steps" in result.stderr


@pytest.mark.gpu
@pytest.mark.cudagraph
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_run_reproduces_the_eager_losses_bit_for_bit(tmp_path):
    graphed, eager = tmp_path / "graphed.json", tmp_path / "eager.json"
    common = ("--device", "cuda", "--steps", "8", "--recipe", "mxfp8")
    run_example(*common, "--losses", str(graphed))
    run_example(*common, "--no-cuda-graph", "--losses", str(eager))
    graphed_losses = json.loads(graphed.read_text())["losses"]
    eager_losses = json.loads(eager.read_text())["losses"]
    assert len(graphed_losses) == 8
    # Steps 1-3 run before the capture, steps 4-8 are graph replays: all must match bit for bit.
    assert graphed_losses == eager_losses
