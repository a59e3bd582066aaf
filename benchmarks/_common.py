"""Shared timing helpers for the H200 benchmarks: median of do_bench and a same-run copy ceiling."""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys

import torch
import triton
from triton.testing import do_bench


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


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
