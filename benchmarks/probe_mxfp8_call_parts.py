"""The parts of one ``cross_entropy_with_mxfp8_grad`` call, each timed alone in a CUDA graph (GPU time,
four rotating logits copies), to see where the call's time goes beyond its two big kernels:

    python benchmarks/probe_mxfp8_call_parts.py [--shapes 8192x50257,8192x50176]

Rows: the forward; the fused MXFP8 backward (its launcher, allocations and fills included) with a dense
dloss per row and with one dloss broadcast to every row (stride 0, what the call passes for ``mean``);
forward + backward; forward + reduction + backward; the public call; then the reduction kernel per
rows-a-step / warps, and one scale fill.
"""

from __future__ import annotations

import argparse

import torch
from _common import ce_probe_inputs, copy_bandwidth_tbs, graph_ms, rotating

import lowp_ops
from lowp_ops.kernels import cross_entropy as ce


def time_parts(shape: str) -> None:
    n, _, x, target, stats = ce_probe_inputs(shape)
    dense = torch.full((n,), 1.0 / n, device="cuda")
    broadcast = torch.full((1,), 1.0 / n, device="cuda").expand(n)
    copies = [x] + [x.clone() for _ in range(3)]

    def bwd(t, s=stats, g=dense):
        return ce.launch_cross_entropy_bwd_mxfp8(t, target, s, g, 0.0, -100, "e4m3", True, True, "compact")

    def fwd_reduce_bwd(t):
        loss_rows, s = ce.launch_cross_entropy_fwd(t, target, 0.0, -100)
        return bwd(t, s, ce.launch_cross_entropy_reduce(loss_rows, target, -100, True)[1].expand(n))

    parts = {
        "forward": lambda t: ce.launch_cross_entropy_fwd(t, target, 0.0, -100),
        "backward, dense dloss": bwd,
        "backward, broadcast dloss": lambda t: bwd(t, stats, broadcast),
        "forward + backward": lambda t: bwd(t, ce.launch_cross_entropy_fwd(t, target, 0.0, -100)[1]),
        "forward + reduction + backward": fwd_reduce_bwd,
        "cross_entropy_with_mxfp8_grad": lambda t: lowp_ops.cross_entropy_with_mxfp8_grad(t, target),
    }
    for name, fn in parts.items():
        print(f"{shape:>12} {name:<32} {graph_ms(rotating(copies, fn)):8.4f} ms", flush=True)


def time_reductions(n: int = 8192) -> None:
    loss_rows, target = torch.rand(n, device="cuda"), torch.randint(0, 1000, (n,), device="cuda")
    loss, scale = torch.empty((), device="cuda"), torch.empty((), device="cuda")
    for block, warps in [(4096, 8), (8192, 8), (8192, 16), (2048, 4)]:
        kernel = ce.cross_entropy_reduce_kernel[(1,)]

        def reduce(block=block, warps=warps, kernel=kernel):
            kernel(loss_rows, target, n, -100, loss, scale, loss_rows, 0, MEAN=True, BLOCK=block,
                   HAS_WEIGHT=False, num_warps=warps)  # fmt: skip

        print(f"reduction of {n} rows, {block} a step, {warps} warps: {1000 * graph_ms(reduce, 50):.2f} us")
    fill = torch.empty(n, 1572, dtype=torch.uint8, device="cuda")
    print(f"fill of {n} x 1572 uint8 scales: {1000 * graph_ms(fill.zero_, 50):.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8192x50257,8192x50176")
    args = parser.parse_args()
    print(f"copy {copy_bandwidth_tbs()[1]:.3f} TB/s")
    for shape in args.shapes.split(","):
        time_parts(shape)
    time_reductions()


if __name__ == "__main__":
    main()
