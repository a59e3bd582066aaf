"""Shared timing helpers for the H200 benchmarks: median of do_bench and a same-run copy ceiling."""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import types

import torch
import triton
from triton.testing import do_bench


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def rotating(buffers: list, fn):
    """A call of ``fn(buffer)`` on the next of ``buffers`` each time, so that no timed call finds the
    previous call's input in L2 (our kernels load with an evict_last hint); CUDA graphs capture the cycle."""
    turn = itertools.cycle(buffers)
    return lambda: fn(next(turn))


def ce_probe_inputs(shape: str):
    """``(n, v, logits, target, row_stats)`` of a cross-entropy probe at ``"NxV"``: seeded bf16 logits
    (randn x 3) and targets on CUDA, and the forward's row statistics."""
    from lowp_ops.kernels.cross_entropy import launch_cross_entropy_fwd

    n, v = map(int, shape.split("x"))
    torch.manual_seed(0)
    logits = (torch.randn(n, v, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda")
    return n, v, logits, target, launch_cross_entropy_fwd(logits, target, 0.0, -100)[1]


def capture_graph(fn, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, after three warm-up calls on a side stream. Raises if
    ``fn`` cannot be captured (e.g. it syncs with the host)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_ms(fn, calls: int = 10) -> float:
    """GPU time per call of ``fn`` without host (launch) overhead: median replay of a CUDA graph holding
    ``calls`` calls, divided by ``calls``."""
    return median_ms(capture_graph(fn, calls).replay) / calls


def copy_bandwidth_tbs(device: str = "cuda", gib: float = 2.0) -> tuple[float, float]:
    """(ms, TB/s) of a device-to-device copy of ``gib`` GiB, counting bytes read plus written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return ms, 2 * src.numel() * 2 / ms / 1e9


POWER_CAP_REASONS = 0x4 | 0x80  # nvidia-smi clocks_event_reasons: software and hardware power cap


class ClockWatch:
    """Samples the SM clock with nvidia-smi every 100 ms while its block runs. Afterwards ``min_mhz``
    (lowest sample) and ``power_capped`` (any sample with a power-cap reason) say whether the clock was
    pulled down during the measurement; both stay None where nvidia-smi is missing or gave no sample.

    The fused MXFP8 backward loses 4-7 points of copy bandwidth when the power cap throttles the SMs
    (H200, 2026-11-30): a time without its clock cannot be read."""

    def __init__(self) -> None:
        self.min_mhz: int | None = None
        self.median_mhz: int | None = None
        self.power_capped: bool | None = None
        self._proc = None

    def __enter__(self) -> ClockWatch:
        # NVML numbers GPUs without CUDA_VISIBLE_DEVICES: the first visible one is what torch calls 0.
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        query = "--query-gpu=clocks.sm,clocks_throttle_reasons.active"
        command = ["nvidia-smi", "-i", gpu, query, "--format=csv,noheader,nounits", "-lms", "100"]
        try:
            pipe, quiet = subprocess.PIPE, subprocess.DEVNULL
            self._proc = subprocess.Popen(command, stdout=pipe, stderr=quiet, text=True)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out = self._proc.communicate(timeout=5)[0]
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return
        samples = []
        for line in out.splitlines():
            fields = [f.strip() for f in line.split(",")]
            if len(fields) == 2 and fields[0].isdigit():
                samples.append((int(fields[0]), int(fields[1], 16)))
        if samples:
            self.min_mhz = min(mhz for mhz, _ in samples)
            self.median_mhz = sorted(mhz for mhz, _ in samples)[len(samples) // 2]
            self.power_capped = any(reasons & POWER_CAP_REASONS for _, reasons in samples)

    def note(self) -> str:
        """E.g. ``1650 MHz capped``; empty without samples."""
        if self.min_mhz is None:
            return ""
        return f"{self.min_mhz} MHz{' capped' if self.power_capped else ''}"


def sustained_ms(fn, seconds: float = 2.0, calls: int = 20, graph: bool = True) -> tuple[float, ClockWatch]:
    """Per-call time of ``fn`` run back to back for ``seconds`` (replays of a CUDA graph of ``calls``
    calls, or eager calls), the first 40% untimed: the GPU reaches the clock its power cap allows for
    this kernel alone, which a 100 ms ``do_bench`` burst does not show (the fused MXFP8 backward draws the
    H200's 700 W cap within a second, measured on 2026-11-30). Also the ClockWatch of the timed part."""
    step = capture_graph(fn, calls).replay if graph else fn
    per_step = calls if graph else 1

    def run_for(duration: float) -> int:
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            step()
            steps += 1
            if steps % 8 == 0:  # keep the host at most 8 steps ahead
                torch.cuda.synchronize()
        return steps

    run_for(0.4 * seconds)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with ClockWatch() as clock:
        begin.record()
        steps = run_for(0.6 * seconds)
        end.record()
        torch.cuda.synchronize()
    return begin.elapsed_time(end) / (steps * per_step), clock


def gpu_script_args(doc: str | None, add_arguments=None) -> argparse.Namespace:
    """The command line of a CUDA-only script: ``--help`` prints ``doc`` on any machine; without a CUDA
    device the script exits with status 2 and says so. ``add_arguments(parser)`` adds its options."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA device (torch sees none)\n")
    return args


def moe_shape_args() -> argparse.Namespace:
    """Command line of the MoE benchmarks: ``--shape T H F E`` (tokens, hidden, FFN width, experts;
    default 16384 4096 1536 8) and ``--json`` (an output path)."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shape", type=int, nargs=4, default=[16384, 4096, 1536, 8], metavar=("T", "H", "F", "E")
    )
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def environment() -> dict:
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {
        "gpu": props.name if props else "cpu",
        "sms": props.multi_processor_count if props else 0,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def write_json(name: str, payload: dict, path: str | None = None) -> str | None:
    path = path or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
    return path


def import_liger(module: str, name: str):
    """``liger_kernel.<module>.<name>``, or None with a printed reason. peft in the GPU image can raise a
    non-ImportError on import, which escapes Liger's own guard: make it a clean ImportError first."""
    try:
        import peft  # noqa: F401
    except ImportError:
        pass
    except Exception:
        sys.modules["peft"] = None
    try:
        return getattr(importlib.import_module(f"liger_kernel.{module}"), name)
    except Exception as error:
        print(f"Liger unavailable: {type(error).__name__}: {error}")
        return None


# TransformerEngine's pure-Triton cross entropy, as TE's CrossEntropyFunction calls it.
_TE_CROSS_ENTROPY = "transformer_engine.pytorch.triton.cross_entropy"
# TE's autograd Function around it (what `parallel_cross_entropy` applies).
_TE_CROSS_ENTROPY_FUNCTION = "transformer_engine.pytorch.cross_entropy"


def _import_te_module(site: str | None, module: str, extra: dict[str, dict] | None = None):
    """``module`` of a TransformerEngine wheel installed under ``site`` (``pip install --no-deps --target
    <site>``), or None with a printed reason.

    TE's package ``__init__`` loads its compiled library, which the wheel alone does not ship; the
    cross entropy needs none of it (Triton kernels and torch). So the parent packages are stand-ins
    that only point at their folders, present while the modules load and removed afterwards (so that
    nothing else, such as peft's check for TE, sees a half-imported TE). ``extra``: more stand-in
    modules, name -> attributes. ``site`` stays off ``sys.path``."""
    if not site:
        return None
    root = os.path.join(site, "transformer_engine")
    if not os.path.isdir(root):
        print(f"TransformerEngine unavailable: no {root}")
        return None
    packages = ["transformer_engine", "transformer_engine.common", "transformer_engine.common.triton"]
    packages += ["transformer_engine.pytorch", "transformer_engine.pytorch.triton"]
    added = []
    try:
        for name in packages:
            if name not in sys.modules:
                stand_in = types.ModuleType(name)
                stand_in.__path__ = [os.path.join(site, *name.split("."))]
                sys.modules[name] = stand_in
                added.append(name)
        for name, attributes in (extra or {}).items():
            stand_in = types.ModuleType(name)
            stand_in.__dict__.update(attributes)
            sys.modules[name] = stand_in
            added.append(name)
        return importlib.import_module(module)
    except Exception as error:
        print(f"TransformerEngine's {module} unavailable: {type(error).__name__}: {error}")
        return None
    finally:
        loaded = [
            _TE_CROSS_ENTROPY,
            _TE_CROSS_ENTROPY_FUNCTION,
            "transformer_engine.common.triton.cross_entropy",
        ]
        for name in [*added, *loaded]:
            sys.modules.pop(name, None)


def import_te_triton_cross_entropy(site: str | None):
    """The module ``transformer_engine.pytorch.triton.cross_entropy`` under ``site``, or None."""
    return _import_te_module(site, _TE_CROSS_ENTROPY)


def import_te_cross_entropy_function(site: str | None):
    """TE's ``CrossEntropyFunction`` (the autograd node of ``parallel_cross_entropy``) under ``site``, or
    None. Its module's one other import, ``transformer_engine.pytorch.jit`` (which needs TE's compiled
    library), stands in with ``no_torch_dynamo`` as the identity: TE's real decorator wraps
    ``parallel_cross_entropy`` in ``torch._dynamo.disable``, host time this leaves out of TE's figure."""

    def no_torch_dynamo(recursive=True, when=None):
        return lambda function: function

    jit = {"transformer_engine.pytorch.jit": {"no_torch_dynamo": no_torch_dynamo}}
    module = _import_te_module(site, _TE_CROSS_ENTROPY_FUNCTION, jit)
    return None if module is None else module.CrossEntropyFunction
