"""RMSNorm forward and forward+backward on the H200: lowp_ops.rms_norm next to transformers' Llama
formula (eager torch ops and ``torch.compile``), ``torch.nn.functional.rms_norm`` and Liger's RMSNorm.

GPU time per call from CUDA-graph replays (``_common.graph_ms``), inputs rotated over buffers larger than
L2; "% copy" = byte floor / time / same-run copy bandwidth, floor 4 B/element forward (read x, write y,
bf16) and 10 B/element forward+backward (+ read x and dy, write dx); also the bytes autograd saves for
the backward, per element. Each (implementation, shape) runs in its own process (a failed capture
poisons its process); a case that cannot be captured is timed eagerly instead and says so.
``--sweep``: the backward kernel alone under each launch configuration.

Run: ``python benchmarks/bench_rms_norm.py [--sweep]`` (JSON to --json or $OUT).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from _common import copy_bandwidth_tbs, environment, graph_ms, import_liger, median_ms, rotating, write_json

import lowp_ops

EPS = 1e-5
IMPLS = ("lowp", "F.rms_norm", "Liger", "transformers (eager)", "transformers (torch.compile)")
RESULT_TAG = "BENCH_RMS_NORM "
SWEEP = [
    (rows, warps, per_sm, stages)
    for rows, warps in ((1, 4), (1, 8), (2, 8), (4, 8), (4, 16))
    for per_sm in (1, 2, 4)
    for stages in (1, 2, 3)
]


def llama_formula(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * hidden.to(x.dtype)


def implementation(name: str):
    if name == "lowp":
        return lambda x, w: lowp_ops.rms_norm(x, w, EPS)
    if name == "F.rms_norm":
        return lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS)
    if name == "Liger":
        liger = import_liger("ops.rms_norm", "LigerRMSNormFunction")
        # LigerRMSNorm's defaults (in_place=True: dx written over dy)
        return None if liger is None else (lambda x, w: liger.apply(x, w, EPS, 0.0, "llama", True))
    if name == "transformers (eager)":
        return llama_formula
    return torch.compile(llama_formula)


def saved_bytes(fn, x: torch.Tensor, weight: torch.Tensor) -> int:
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, weight)
    return sum(seen.values())


def inputs(rows: int, hidden: int):
    copies = max(2, int(2 * 80e6 // (rows * hidden * 2)) + 1)
    xs = [torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    leaves = [x.clone().requires_grad_() for x in xs]
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16().requires_grad_()
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    return xs, leaves, weight, dy


def measure(name: str, rows: int, hidden: int) -> dict:
    """GPU ms of the forward and of forward + backward (``autograd.grad``: no accumulation into .grad)."""
    fn = implementation(name)
    if fn is None:
        return {"error": "unavailable"}
    xs, leaves, weight, dy = inputs(rows, hidden)

    def forward(x):
        with torch.no_grad():
            return fn(x, weight)

    def forward_backward(x):
        return torch.autograd.grad(fn(x, weight), (x, weight), dy)

    for x in leaves[:2]:  # compile (torch.compile) and warm up outside any capture
        forward(x)
        forward_backward(x)
    torch.cuda.synchronize()
    timing = "graph"
    try:
        fwd, both = graph_ms(rotating(xs, forward)), graph_ms(rotating(leaves, forward_backward))
    except Exception as error:  # the process cannot capture any more: eager timing, in a fresh one
        return {"error": f"capture failed ({type(error).__name__}: {str(error)[:100]})", "retry_eager": True}
    return summarize(fwd, both, rows, hidden, timing, saved_bytes(fn, leaves[0], weight))


def measure_eager(name: str, rows: int, hidden: int) -> dict:
    fn = implementation(name)
    xs, leaves, weight, dy = inputs(rows, hidden)
    with torch.no_grad():
        fwd = median_ms(rotating(xs, lambda x: fn(x, weight)))
    both = median_ms(rotating(leaves, lambda x: torch.autograd.grad(fn(x, weight), (x, weight), dy)))
    return summarize(fwd, both, rows, hidden, "eager", saved_bytes(fn, leaves[0], weight))


def summarize(fwd: float, both: float, rows: int, hidden: int, timing: str, saved: int) -> dict:
    _, copy_tbs = copy_bandwidth_tbs()
    elements = rows * hidden
    return {
        "timing": timing,
        "copy_tbs": copy_tbs,
        "fwd_ms": fwd,
        "fwd_pct_copy": 100 * 4 * elements / (fwd * 1e-3) / (copy_tbs * 1e12),
        "fwd_bwd_ms": both,
        "fwd_bwd_pct_copy": 100 * 10 * elements / (both * 1e-3) / (copy_tbs * 1e12),
        "saved_bytes_per_element": saved / elements,
    }


def sweep(rows: int, hidden: int) -> list[dict]:
    """The backward kernel alone (dx and the weight gradient, 6 B/element) under each configuration."""
    from lowp_ops.kernels import rms_norm as kernels

    xs, _, weight, dy = inputs(rows, hidden)
    _, rstd = kernels.launch_rms_norm_fwd(xs[0], weight.detach(), EPS, True)
    _, copy_tbs = copy_bandwidth_tbs()
    found = []
    for config in [None, *SWEEP]:
        ms = graph_ms(
            rotating(
                xs, lambda x, c=config: kernels.launch_rms_norm_bwd(dy, x, weight.detach(), rstd, True, c)
            )
        )
        pct = 100 * 6 * rows * hidden / (ms * 1e-3) / (copy_tbs * 1e12)
        found.append({"config": config or ("default", kernels.bwd_config(hidden)), "ms": ms, "pct_copy": pct})
    found.sort(key=lambda r: r["ms"])
    return found


def child(args: argparse.Namespace) -> None:
    rows, hidden = map(int, args.shapes.split("x"))
    if args.sweep:
        result = {"sweep": sweep(rows, hidden)}
    elif args.eager:
        result = measure_eager(args.impl, rows, hidden)
    else:
        result = measure(args.impl, rows, hidden)
    print(RESULT_TAG + json.dumps(result))


def run_child(*flags: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *flags], capture_output=True, text=True, timeout=300
    )
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    return {
        "error": (done.stderr or done.stdout).strip().splitlines()[-1][:200]
        if (done.stderr or done.stdout)
        else "no output"
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x2048,16384x4096,8192x8192")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="lowp", help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(environment())
    results = []
    for shape in args.shapes.split(","):
        if args.sweep:
            found = run_child("--shapes", shape, "--sweep")
            print(f"\n{shape} backward sweep (BLOCK_ROWS, num_warps, programs/SM, stages): ms, % copy")
            for r in found.get("sweep", [])[:8]:
                print(f"  {r['config']}: {r['ms']:.4f} ms, {r['pct_copy']:.1f}%")
            results.append({"shape": shape, **found})
            continue
        print(f"\n{shape} bf16")
        print("| impl | fwd ms | fwd % copy | fwd+bwd ms | fwd+bwd % copy | saved B/elem | timing |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for name in IMPLS:
            r = run_child("--shapes", shape, "--impl", name)
            if r.get("retry_eager"):
                r = {**run_child("--shapes", shape, "--impl", name, "--eager"), "note": r["error"]}
            if "fwd_ms" not in r:
                print(f"| {name} | failed: {r.get('error')} |")
            else:
                print(
                    f"| {name} | {r['fwd_ms']:.4f} | {r['fwd_pct_copy']:.1f} | {r['fwd_bwd_ms']:.4f} | "
                    f"{r['fwd_bwd_pct_copy']:.1f} | {r['saved_bytes_per_element']:.2f} | {r['timing']} |"
                )
            results.append({"shape": shape, "impl": name, **r})
    write_json("bench_rms_norm.json", {"env": environment(), "rows": results}, args.json)


if __name__ == "__main__":
    main()
