"""The MXFP8 recipe's operand round trips (``lowp::mxfp8_round_trip``, H200) at one MoE layer's shapes:
column-wise blocks along the whole token dim against blocks within each expert's tokens (``group_ends``),
next to a device-to-device copy measured in the same run.

Shapes: T=16384 tokens, E=8 experts with uneven split sizes (not multiples of 32, one expert empty) and
the grouped MLP's wgrad operands: x and dy (T x 4096), dc (T x 3072), h (T x 1536), bf16. Floors: each
copy reads 2 B and writes 2 B per element (row+col 6 B, one copy 4 B). Timed calls cycle through ROTATE
inputs, a new one each call.

Run:        PYTHONPATH=. python3 benchmarks/bench_mxfp8_round_trip.py [--json PATH]
"""

from __future__ import annotations

import torch
from _common import copy_bandwidth_tbs, environment, gpu_script_args, median_ms, rotating, write_json

import lowp_ops.library as library

TOKENS, EXPERTS, ROTATE = 16384, 8, 4
WIDTHS = (4096, 3072, 1536)
MODES = {"row+col": (True, True), "col": (False, True)}


def uneven_ends(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """int32 group ends of uneven split sizes summing to ``tokens``: expert 2 empty, the others not
    multiples of 32."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.25
    weights[2] = 0
    sizes = (weights / weights.sum() * tokens).floor().long()
    sizes[0] += tokens - sizes.sum()
    return torch.cumsum(sizes, 0).to(torch.int32)


def main() -> None:
    args = gpu_script_args(__doc__, lambda p: p.add_argument("--json", default=None))
    copy_ms, copy_tbs = copy_bandwidth_tbs()
    ends = uneven_ends(TOKENS, EXPERTS).cuda()
    rows = []
    print(f"copy {copy_tbs:.2f} TB/s; split ends {ends.tolist()}")
    print(f"{'shape':>12s} {'mode':>8s} {'blocks':>8s} {'ms':>8s} {'% copy':>7s}")
    for width in WIDTHS:
        inputs = [torch.randn(TOKENS, width, device="cuda").bfloat16() for _ in range(ROTATE)]
        for mode, (rowwise, columnwise) in MODES.items():
            floor = (2 + 2 * (rowwise + columnwise)) * TOKENS * width
            for blocks, group_ends in (("whole", None), ("experts", ends)):
                call = rotating(
                    inputs,
                    lambda x, r=rowwise, c=columnwise, g=group_ends: library.mxfp8_round_trip(
                        x, "e4m3", r, c, g
                    ),
                )
                ms = median_ms(call)
                share = floor / ms / 1e9 / copy_tbs * 100
                rows.append(dict(tokens=TOKENS, width=width, mode=mode, blocks=blocks, ms=ms, pct_copy=share))
                print(f"{TOKENS:>6d}x{width:<5d} {mode:>8s} {blocks:>8s} {ms:8.4f} {share:7.1f}", flush=True)
    path = write_json(
        "bench_mxfp8_round_trip.json",
        {"env": environment(), "copy_ms": copy_ms, "copy_tbs": copy_tbs, "rows": rows},
        args.json,
    )
    print(f"json: {path}")


if __name__ == "__main__":
    main()
