"""Grouped SwiGLU MLP benchmark (H200), at one MoE layer of T=16384 tokens, H=4096, F=1536,
E=8 experts with uneven splits (multiples of 128, one expert empty), bf16.

1. The fused dGLU kernel and the SwiGLU forward kernel: effective bandwidth (byte floor / time) against
   a device-to-device copy measured in the same run, next to the eager reference on CUDA and
   torch.compile of it; a small launch-config sweep of the dGLU kernel.
   Floors: dGLU reads g (2 B) and c (4 B), writes dc (4 B) per ffn element, plus 8 B per token
   (probs in, dprobs out); SwiGLU forward reads c (4 B) and writes h (2 B) per ffn element.
2. The full MLP forward+backward (bf16 recipe, and the emulated MXFP8 / NVFP4 recipes when available)
   against the sum of its six grouped GEMMs alone, an eager PyTorch grouped implementation
   (torch._grouped_mm + elementwise SwiGLU, autograd) and torch.compile of that implementation.

Run:        PYTHONPATH=. python3 benchmarks/bench_grouped_mlp.py [--json PATH]
CPU smoke:  not supported (torch._grouped_mm's fast path and the timings need CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import copy_bandwidth_tbs, environment, graph_ms, median_ms, moe_shape_args, write_json

import lowp_ops
from lowp_ops.kernels.swiglu import launch_dglu, launch_swiglu_fwd
from lowp_ops.reference import swiglu as swiglu_ref

SWEEP = [(rows, cols, warps) for rows in (4, 8, 16) for cols in (128, 256, 512) for warps in (4, 8)]


def uneven_splits(tokens: int, experts: int, seed: int = 0) -> list[int]:
    """Multiples of 128 summing to ``tokens``, expert 2 empty, the rest uneven."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.25
    weights[2] = 0
    blocks = (weights / weights.sum() * (tokens // 128)).floor().long()
    blocks[0] += tokens // 128 - blocks.sum()
    return (blocks * 128).tolist()


def make(tokens, hidden, ffn, experts):
    splits = uneven_splits(tokens, experts)
    dev = "cuda"
    return {
        "x": (torch.randn(tokens, hidden, device=dev) * 0.5).bfloat16(),
        "fc1_weight": (torch.randn(experts, 2 * ffn, hidden, device=dev) * hidden**-0.5).bfloat16(),
        "fc2_weight": (torch.randn(experts, hidden, ffn, device=dev) * ffn**-0.5).bfloat16(),
        "split_sizes": torch.tensor(splits, device=dev),
        "probs": torch.rand(tokens, device=dev),
        "dy": (torch.randn(tokens, hidden, device=dev) * 0.01).bfloat16(),
        "splits": splits,
    }


def torch_grouped_mlp(x, fc1_weight, fc2_weight, split_sizes, probs):
    """What a user writes today: torch._grouped_mm and an elementwise SwiGLU in fp32."""
    offs = torch.cumsum(split_sizes, 0, dtype=torch.int32)
    c = torch._grouped_mm(x, fc1_weight.transpose(1, 2), offs)
    gate, linear = c.float().chunk(2, dim=1)
    h = (F.silu(gate) * linear * probs[:, None]).bfloat16()
    return torch._grouped_mm(h, fc2_weight.transpose(1, 2), offs)


def fwd_bwd(fn, inputs, **kwargs):
    leaves = [inputs[k].detach().requires_grad_() for k in ("x", "fc1_weight", "fc2_weight")]
    probs = inputs["probs"].detach().requires_grad_()

    def run():
        y = fn(leaves[0], leaves[1], leaves[2], inputs["split_sizes"], probs, **kwargs)
        y.backward(inputs["dy"])

    return run


def gemms_only(inputs):
    """The six grouped GEMMs of forward+backward, bf16, nothing else."""
    x, w1, w2, dy = (inputs[k] for k in ("x", "fc1_weight", "fc2_weight", "dy"))
    offs = torch.cumsum(inputs["split_sizes"], 0, dtype=torch.int32)
    c = torch._grouped_mm(x, w1.transpose(1, 2), offs)
    h = c[:, : c.shape[1] // 2].contiguous()

    def run():
        torch._grouped_mm(x, w1.transpose(1, 2), offs)
        torch._grouped_mm(h, w2.transpose(1, 2), offs)
        torch._grouped_mm(dy, w2, offs)
        torch._grouped_mm(dy.t(), h, offs)
        torch._grouped_mm(c, w1, offs)
        torch._grouped_mm(c.t(), x, offs)

    return run


def kernel_rows(inputs, ffn, copy_tbs):
    tokens = inputs["x"].shape[0]
    c = (torch.randn(tokens, 2 * ffn, device="cuda") * 2).bfloat16()
    g = torch.randn(tokens, ffn, device="cuda").bfloat16()
    probs, splits = inputs["probs"], inputs["split_sizes"]
    dglu_bytes = tokens * ffn * 10 + tokens * 8
    fwd_bytes = tokens * ffn * 6 + tokens * 4
    compiled_dglu = torch.compile(swiglu_ref.dglu, dynamic=False)
    compiled_fwd = torch.compile(swiglu_ref.swiglu_fwd, dynamic=False)
    cases = [
        ("dglu", "lowp Triton", dglu_bytes, lambda: launch_dglu(g, c, probs, splits, 0)),
        ("dglu", "lowp Triton, interleave 32", dglu_bytes, lambda: launch_dglu(g, c, probs, splits, 32)),
        ("dglu", "eager reference", dglu_bytes, lambda: swiglu_ref.dglu(g, c, probs, splits, 0)),
        ("dglu", "torch.compile(reference)", dglu_bytes, lambda: compiled_dglu(g, c, probs, splits, 0)),
        ("swiglu_fwd", "lowp Triton", fwd_bytes, lambda: launch_swiglu_fwd(c, probs, 0)),
        ("swiglu_fwd", "eager reference", fwd_bytes, lambda: swiglu_ref.swiglu_fwd(c, probs, 0)),
        ("swiglu_fwd", "torch.compile(reference)", fwd_bytes, lambda: compiled_fwd(c, probs, 0)),
    ]
    rows = []
    for op, impl, nbytes, fn in cases:
        ms = median_ms(fn)
        tbs = nbytes / ms / 1e9
        row = {"op": op, "impl": impl, "ms": ms, "tbs": tbs, "of_copy": tbs / copy_tbs}
        if impl.startswith("lowp"):  # GPU time alone: these kernels last ~0.1 ms, near launch cost
            row["graph_ms"] = graph_ms(fn)
            row["graph_of_copy"] = nbytes / row["graph_ms"] / 1e9 / copy_tbs
        rows.append(row)
    sweep = []
    for config in SWEEP:
        ms = graph_ms(lambda cfg=config: launch_dglu(g, c, probs, splits, 0, cfg))
        sweep.append({"config": config, "graph_ms": ms, "of_copy": dglu_bytes / ms / 1e9 / copy_tbs})
    return rows, sweep


def mlp_rows(inputs):
    compiled_torch = torch.compile(torch_grouped_mlp, dynamic=False)
    cases = [
        ("six grouped GEMMs alone (bf16)", gemms_only(inputs)),
        ("lowp bf16", fwd_bwd(lowp_ops.grouped_swiglu_mlp, inputs, recipe="bf16")),
        ("eager torch._grouped_mm + SwiGLU", fwd_bwd(torch_grouped_mlp, inputs)),
        ("torch.compile of it", fwd_bwd(compiled_torch, inputs)),
        ("lowp mxfp8 (emulated)", fwd_bwd(lowp_ops.grouped_swiglu_mlp, inputs, recipe="mxfp8")),
        ("lowp nvfp4 (emulated)", fwd_bwd(lowp_ops.grouped_swiglu_mlp, inputs, recipe="nvfp4")),
        (
            "lowp nvfp4, fc1_dy_amax_from_dglu",
            fwd_bwd(lowp_ops.grouped_swiglu_mlp, inputs, recipe="nvfp4", fc1_dy_amax_from_dglu=True),
        ),
    ]
    rows = []
    for name, fn in cases:
        try:
            ms = median_ms(fn)
        except NotImplementedError as error:
            rows.append({"impl": name, "ms": None, "note": str(error)})
            continue
        rows.append({"impl": name, "ms": ms})
    gemm_ms = rows[0]["ms"]
    for row in rows:
        row["of_gemms"] = row["ms"] / gemm_ms if row["ms"] else None
    return rows


def main():
    args = moe_shape_args()
    tokens, hidden, ffn, experts = args.shape
    inputs = make(tokens, hidden, ffn, experts)
    copy_ms, copy_tbs = copy_bandwidth_tbs()
    kernels, sweep = kernel_rows(inputs, ffn, copy_tbs)
    mlp = mlp_rows(inputs)
    env = environment()
    print(f"# grouped SwiGLU MLP, T={tokens} H={hidden} F={ffn} E={experts}, splits {inputs['splits']}")
    print(f"{env}; copy {copy_tbs:.2f} TB/s ({copy_ms:.3f} ms for 2 GiB)\n")
    print("| op | impl | ms | TB/s | of copy | graph ms | graph of copy |\n|---|---|---|---|---|---|---|")
    for r in kernels:
        graph = f"{r['graph_ms']:.4f} | {r['graph_of_copy']:.0%}" if "graph_ms" in r else " | "
        print(f"| {r['op']} | {r['impl']} | {r['ms']:.3f} | {r['tbs']:.2f} | {r['of_copy']:.0%} | {graph} |")
    print("\ndGLU sweep (CUDA-graph GPU time), best first:")
    for r in sorted(sweep, key=lambda r: r["graph_ms"])[:8]:
        print(
            f"  BLOCK_T, BLOCK_F, warps, F_SPLITS = {r['config']}: {r['graph_ms']:.4f} ms {r['of_copy']:.0%}"
        )
    print()
    print("| forward+backward | ms | x six GEMMs |\n|---|---|---|")
    for r in mlp:
        if r["ms"] is None:
            print(f"| {r['impl']} | n/a ({r['note']}) | |")
        else:
            print(f"| {r['impl']} | {r['ms']:.3f} | {r['of_gemms']:.2f} |")
    payload = {"env": env, "shape": args.shape, "splits": inputs["splits"], "copy_tbs": copy_tbs}
    payload.update(kernels=kernels, dglu_sweep=sweep, mlp=mlp)
    write_json("bench_grouped_mlp.json", payload, args.json)


if __name__ == "__main__":
    main()
