"""The main job, examples/train_tiny_moe.py: a short CPU run learns with zero graph breaks; the plain-PyTorch
baseline trains the same model as lowp's bf16 recipe; on CUDA the CUDA-graph run reproduces the compiled
run's losses bit for bit. Each training run is its own process (Dynamo state and a CUDA-graph capture stay
out of the test process)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tiny_moe.py"
SUMMARY = re.compile(
    r"^model=(?P<model>lowp|baseline) recipe=(?P<recipe>\w+) device=(?P<device>\w+) mode=(?P<mode>\w+)"
    r" steps=(?P<steps>\d+) first_loss=(?P<first>[\d.]+) last_loss=(?P<last>[\d.]+)"
    r" graph_breaks=(?P<breaks>\d+) recompiles=(?P<recompiles>\d+) tokens_per_s=(?P<tokens_per_s>\d+|n/a)"
    r" peak_memory_mib=(?P<peak>[\d.]+|n/a)$"
)


def example_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    env.pop("LOWP_OPS_CPU_KERNELS", None)
    return env


def run_example(*args: str, timeout: int = 600) -> list[dict[str, str]]:
    """Run the example in its own process -> the fields of each summary line it printed (one per run)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        env=example_env(),
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr[-3000:]
    matches = [SUMMARY.match(line) for line in lines]
    assert all(matches), f"a line does not follow the contract: {lines!r}"
    return [match.groupdict() for match in matches]


@pytest.fixture(scope="module")
def example():
    """The example as a module (its functions, no training run)."""
    spec = importlib.util.spec_from_file_location("train_tiny_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_cpu_run_learns_with_no_graph_break_and_no_recompile():
    (run,) = run_example("--steps", "12", "--device", "cpu")
    assert (run["model"], run["recipe"], run["mode"]) == ("lowp", "mxfp8", "compiled")
    assert int(run["steps"]) == 12
    assert float(run["last"]) < float(run["first"]) - 0.5, run  # ln(256) = 5.55 at the start
    assert int(run["breaks"]) == 0
    assert int(run["recompiles"]) == 0
    assert int(run["tokens_per_s"]) > 0
    assert run["peak"] == "n/a"  # CPU: no allocator statistics


def test_a_run_with_no_timed_step_reports_no_speed():
    """The first WARMUP_STEPS + 1 steps (compilation, warm-up, capture) are not timed: 4 steps leave none."""
    (run,) = run_example("--steps", "4", "--device", "cpu", "--mode", "eager")
    assert run["tokens_per_s"] == "n/a"


def test_eager_baseline_trains_the_same_model_as_lowp_bf16(tmp_path):
    """The plain-PyTorch baseline (torch.softmax, torch._grouped_mm experts, F.cross_entropy on full
    logits) starts from the same parameters as lowp's bf16 recipe: their losses agree to bf16 rounding
    step after step (an independent check of both models), and neither compiles in eager mode."""
    lowp_path, baseline_path = tmp_path / "lowp.json", tmp_path / "baseline.json"
    common = ("--steps", "4", "--device", "cpu", "--mode", "eager")
    (lowp,) = run_example(*common, "--recipe", "bf16", "--losses", str(lowp_path))
    (baseline,) = run_example(*common, "--baseline", "--losses", str(baseline_path))
    assert (lowp["model"], baseline["model"]) == ("lowp", "baseline")
    assert lowp["mode"] == baseline["mode"] == "eager"
    assert baseline["recipe"] == "bf16" and baseline["peak"] == "n/a"
    lowp_losses = [float.fromhex(v) for v in json.loads(lowp_path.read_text())["runs"][0]["losses"]]
    base_losses = [float.fromhex(v) for v in json.loads(baseline_path.read_text())["runs"][0]["losses"]]
    assert len(lowp_losses) == len(base_losses) == 4
    assert base_losses[-1] < base_losses[0] - 0.3, base_losses  # the baseline learns too
    for ours, theirs in zip(lowp_losses, base_losses, strict=True):
        assert abs(ours - theirs) < 0.02, (lowp_losses, base_losses)


def test_plot_trains_the_three_recipes_and_the_baseline_and_writes_a_png(tmp_path):
    path = tmp_path / "losses.png"
    runs = run_example("--steps", "2", "--device", "cpu", "--baseline", "--plot", str(path))
    assert [(run["model"], run["recipe"]) for run in runs] == [
        ("lowp", "bf16"),
        ("lowp", "mxfp8"),
        ("lowp", "nvfp4"),
        ("baseline", "bf16"),
    ]
    assert all(int(run["breaks"]) == 0 and int(run["recompiles"]) == 0 for run in runs), runs
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_loss_figure_has_a_title_axis_labels_and_a_legend(example, tmp_path):
    runs = [
        {"model": "lowp", "recipe": "mxfp8", "losses": [5.5, 4.0, 3.0]},
        {"model": "baseline", "recipe": "bf16", "losses": [5.5, 4.1, 3.2]},
    ]
    figure = example.loss_figure(runs, "the title")
    (axis,) = figure.axes
    assert axis.get_title() == "the title"
    assert axis.get_xlabel() and axis.get_ylabel()
    labels = [text.get_text() for text in axis.get_legend().get_texts()]
    assert labels == ["lowp mxfp8", "plain PyTorch bf16"]
    assert [list(line.get_ydata()) for line in axis.get_lines()] == [run["losses"] for run in runs]
    figure.savefig(tmp_path / "figure.png")
    assert (tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--steps", "0"), "--steps"),
        (("--batch", "0"), "--batch"),
        (("--mode", "graph"), "--mode graph"),  # a CUDA graph on CPU
        (("--mode", "fast"), "--mode"),
        (("--baseline", "--recipe", "mxfp8"), "--recipe"),
        (("--plot", "x.png", "--recipe", "bf16"), "--recipe"),
        # Checked before minutes of training: a folder that does not exist, a format matplotlib lacks.
        (("--plot", "no_such_folder/x.png"), "--plot: the folder"),
        (("--plot", "losses.txt"), "--plot: the file's extension"),
        (("--losses", "no_such_folder/l.json"), "--losses: the folder"),
    ],
)
def test_bad_arguments_are_rejected_with_the_argument_named(example, capsys, args, named):
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(["--device", "cpu", *args])
    assert exit_info.value.code != 0
    assert named in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.cudagraph
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_run_reproduces_the_compiled_losses_bit_for_bit(tmp_path):
    graphed, compiled = tmp_path / "graphed.json", tmp_path / "compiled.json"
    common = ("--device", "cuda", "--steps", "8", "--recipe", "mxfp8")
    (graph_run,) = run_example(*common, "--mode", "graph", "--losses", str(graphed))
    run_example(*common, "--mode", "compiled", "--losses", str(compiled))
    assert float(graph_run["peak"]) > 0  # MiB from torch.cuda.max_memory_allocated
    graphed_losses = json.loads(graphed.read_text())["runs"][0]["losses"]
    compiled_losses = json.loads(compiled.read_text())["runs"][0]["losses"]
    assert len(graphed_losses) == 8
    # Steps 1-3 run before the capture, steps 4-8 are graph replays: all must match bit for bit.
    assert graphed_losses == compiled_losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_cuda_baseline_and_lowp_bf16_train_alike(mode):
    """On CUDA, in eager and compiled mode: the plain-PyTorch baseline and lowp's bf16 recipe start from
    one loss and learn alike; each reports tokens/s and its peak memory."""
    common = ("--device", "cuda", "--steps", "6", "--mode", mode)
    (lowp,) = run_example(*common, "--recipe", "bf16")
    (baseline,) = run_example(*common, "--baseline")
    for run in (lowp, baseline):
        assert int(run["breaks"]) == 0 and int(run["recompiles"]) == 0, run
        assert int(run["tokens_per_s"]) > 0 and float(run["peak"]) > 0, run
    assert abs(float(lowp["first"]) - float(baseline["first"])) < 0.02, (lowp, baseline)
    assert abs(float(lowp["last"]) - float(baseline["last"])) < 0.05, (lowp, baseline)
