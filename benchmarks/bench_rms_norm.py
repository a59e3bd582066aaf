"""RMSNorm forward and forward+backward on the H200: lowp_ops.rms_norm next to transformers' Llama
formula (eager torch ops and ``torch.compile``), ``torch.nn.functional.rms_norm`` and Liger's RMSNorm.

GPU time per call from CUDA-graph replays (``_common.graph_ms``), inputs rotated over buffers larger than
L2; "% copy" = byte floor / time / same-run copy bandwidth, floor 4 B/element forward (read x, write y,
bf16) and 10 B/element forward+backward (+ read x and dy, write dx). Also the bytes autograd saves for
the backward per element. Run: ``python benchmarks/bench_rms_norm.py`` (JSON to --json or $OUT).
"""

from __future__ import annotations

import argparse

import torch
from _common import copy_bandwidth_tbs, environment, graph_ms, import_liger, rotating, write_json

import lowp_ops

EPS = 1e-5


def llama_formula(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * hidden.to(x.dtype)


def implementations() -> dict:
    found = {
        "lowp": lambda x, w: lowp_ops.rms_norm(x, w, EPS),
        "transformers (eager)": llama_formula,
        "transformers (torch.compile)": torch.compile(llama_formula),
        "F.rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS),
    }
    liger = import_liger("ops.rms_norm", "LigerRMSNormFunction")
    if liger is not None:
        # LigerRMSNorm's defaults (in_place=True: dx written over dy)
        found["Liger"] = lambda x, w: liger.apply(x, w, EPS, 0.0, "llama", True)
    return found


def saved_bytes(fn, x: torch.Tensor, weight: torch.Tensor) -> int:
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, weight)
    return sum(seen.values())


def measure(fn, xs, leaves, weight, dy, copy_tbs: float) -> dict:
    """GPU ms of the forward and of forward + backward (``autograd.grad``: no accumulation into .grad)."""

    def forward(x):
        with torch.no_grad():
            return fn(x, weight)

    def forward_backward(x):
        return torch.autograd.grad(fn(x, weight), (x, weight), dy)

    rows, hidden = xs[0].shape
    fwd, both = graph_ms(rotating(xs, forward)), graph_ms(rotating(leaves, forward_backward))
    elements = rows * hidden
    return {
        "fwd_ms": fwd,
        "fwd_pct_copy": 100 * 4 * elements / (fwd * 1e-3) / (copy_tbs * 1e12),
        "fwd_bwd_ms": both,
        "fwd_bwd_pct_copy": 100 * 10 * elements / (both * 1e-3) / (copy_tbs * 1e12),
        "saved_bytes_per_element": saved_bytes(fn, leaves[0], weight) / elements,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x2048,16384x4096,8192x8192")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    _, copy_tbs = copy_bandwidth_tbs()
    print(f"copy {copy_tbs:.3f} TB/s; {environment()}")
    results = []
    for shape in args.shapes.split(","):
        rows, hidden = map(int, shape.split("x"))
        copies = max(2, int(2 * 80e6 // (rows * hidden * 2)) + 1)
        xs = [torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        leaves = [x.clone().requires_grad_() for x in xs]
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16().requires_grad_()
        dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        print(f"\n{rows} x {hidden} bf16")
        print("| impl | fwd ms | fwd % copy | fwd+bwd ms | fwd+bwd % copy | saved B/elem |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, fn in implementations().items():
            try:
                r = measure(fn, xs, leaves, weight, dy, copy_tbs)
            except Exception as error:  # a peer that cannot run here: say why, go on
                print(f"| {name} | failed: {type(error).__name__}: {str(error)[:120]} |")
                continue
            print(
                f"| {name} | {r['fwd_ms']:.4f} | {r['fwd_pct_copy']:.1f} | {r['fwd_bwd_ms']:.4f} | "
                f"{r['fwd_bwd_pct_copy']:.1f} | {r['saved_bytes_per_element']:.2f} |"
            )
            results.append({"shape": shape, "impl": name, **r})
    write_json(
        "bench_rms_norm.json", {"env": environment(), "copy_tbs": copy_tbs, "rows": results}, args.json
    )


if __name__ == "__main__":
    main()
