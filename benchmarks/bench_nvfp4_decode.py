"""NVFP4 local-value decode benchmark (H200), at one MoE layer of T=16384 tokens, H=4096, F=1536,
E=8 experts with bench_grouped_mlp's uneven splits.

1. ``lowp::nvfp4_decode_rows`` (tokens (T, H), and the 16x16 weights (E, 2F, H) as one batch) and
   ``lowp::nvfp4_group_decode_columns`` (the grouped column-wise copy, (H, T) out): the Triton kernels
   against their pure-PyTorch references run on CUDA (the recipe's previous path), as effective
   bandwidth against a device-to-device copy measured in the same run; bit equality checked.
   Byte floor per value: 0.5 (codes) + 1/16 (scales) read, 2 (bf16) written.
2. A launch-config sweep of both kernels.
3. The recipe's three operand functions (quantize + decode) at this shape.

Run:        PYTHONPATH=. python3 benchmarks/bench_nvfp4_decode.py [--json PATH]
CPU smoke:  not supported (timings need CUDA).
"""

from __future__ import annotations

import torch
from _common import copy_bandwidth_tbs, environment, median_ms, moe_shape_args, write_json
from bench_grouped_mlp import uneven_splits

from lowp_ops.composite import grouped_nvfp4
from lowp_ops.kernels.nvfp4_decode import launch_nvfp4_decode_rows, launch_nvfp4_group_decode_columns
from lowp_ops.reference import nvfp4_decode as reference

BYTES_PER_VALUE = 0.5 + 1 / 16 + 2
ROWS_SWEEP = [(16, 256, 4), (32, 256, 4), (16, 512, 4), (32, 512, 8), (8, 256, 2), (64, 128, 8), (16, 128, 2)]
COLUMNS_SWEEP = [
    (32, 128, 4),
    (16, 128, 4),
    (64, 128, 8),
    (32, 256, 4),
    (16, 256, 4),
    (64, 64, 4),
    (8, 512, 4),
]


def operands(tokens, hidden, ffn, experts):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) * hidden**-0.5).bfloat16()
    split_sizes = torch.tensor(uneven_splits(tokens, experts), device="cuda")
    row_data, row_scale, col_data, col_scale, *_ = torch.ops.lowp.nvfp4_group_quantize(
        x, split_sizes, True, True, True, None, None
    )
    amax = weight.abs().amax(dim=(1, 2)).float()
    copies = [
        torch.ops.lowp.nvfp4_quantize(weight[e], True, False, False, amax[e : e + 1], None, True)
        for e in range(experts)
    ]
    weight_data = torch.stack([c[0] for c in copies])
    weight_scale = torch.stack([c[1] for c in copies])
    return {
        "x": x,
        "weight": weight,
        "split_sizes": split_sizes,
        "rows": (row_data, row_scale),
        "weights": (weight_data, weight_scale),
        "columns": (col_data, col_scale, split_sizes, hidden, tokens),
    }


def kernel_rows(data, copy_tbs):
    cases = [
        ("decode_rows tokens (T, H)", launch_nvfp4_decode_rows, reference.nvfp4_decode_rows, data["rows"]),
        (
            "decode_rows weights (E, 2F, H)",
            launch_nvfp4_decode_rows,
            reference.nvfp4_decode_rows,
            data["weights"],
        ),
        (
            "group_decode_columns (H, T)",
            launch_nvfp4_group_decode_columns,
            reference.nvfp4_group_decode_columns,
            data["columns"],
        ),
    ]
    rows = []
    for name, kernel, ref, args in cases:
        got, expected = kernel(*args), ref(*args)
        same = torch.equal(got.view(torch.int16), expected.view(torch.int16))
        nbytes = got.numel() * BYTES_PER_VALUE
        for impl, fn in (("lowp Triton", kernel), ("PyTorch reference on CUDA", ref)):
            ms = median_ms(lambda fn=fn, args=args: fn(*args))
            tbs = nbytes / ms / 1e9
            rows.append(
                {"op": name, "impl": impl, "ms": ms, "tbs": tbs, "of_copy": tbs / copy_tbs, "bit_equal": same}
            )
    return rows


def sweep(data):
    results = []
    for name, kernel, args, configs in (
        ("decode_rows tokens", launch_nvfp4_decode_rows, data["rows"], ROWS_SWEEP),
        ("decode_rows weights", launch_nvfp4_decode_rows, data["weights"], ROWS_SWEEP),
        ("group_decode_columns", launch_nvfp4_group_decode_columns, data["columns"], COLUMNS_SWEEP),
    ):
        for config in configs:
            ms = median_ms(lambda kernel=kernel, args=args, config=config: kernel(*args, config=config))
            results.append({"op": name, "config": config, "ms": ms})
    return results


def recipe_operands(data):
    x, weight, split_sizes = data["x"], data["weight"], data["split_sizes"]
    cases = [
        ("rowwise_operand(x)", lambda: grouped_nvfp4.rowwise_operand(x, split_sizes)),
        ("columnwise_operand(x), RHT", lambda: grouped_nvfp4.columnwise_operand(x, split_sizes)),
        ("weight_operand(fc1 weight)", lambda: grouped_nvfp4.weight_operand(weight)),
    ]
    return [{"impl": name, "ms": median_ms(fn)} for name, fn in cases]


def main():
    args = moe_shape_args()
    tokens, hidden, ffn, experts = args.shape
    data = operands(tokens, hidden, ffn, experts)
    copy_ms, copy_tbs = copy_bandwidth_tbs()
    kernels = kernel_rows(data, copy_tbs)
    configs = sweep(data)
    recipe = recipe_operands(data)
    env = environment()
    print(f"# NVFP4 decode, T={tokens} H={hidden} F={ffn} E={experts}, splits {data['split_sizes'].tolist()}")
    print(f"{env}; copy {copy_tbs:.2f} TB/s ({copy_ms:.3f} ms for 2 GiB)\n")
    print("| op | impl | ms | TB/s | of copy | bit-equal |\n|---|---|---|---|---|---|")
    for r in kernels:
        speed = f"{r['ms']:.3f} | {r['tbs']:.2f} | {r['of_copy']:.0%}"
        print(f"| {r['op']} | {r['impl']} | {speed} | {r['bit_equal']} |")
    print("\n| sweep | (BLOCK_ROWS, BLOCK_COLS, warps) | ms |\n|---|---|---|")
    for r in configs:
        print(f"| {r['op']} | {r['config']} | {r['ms']:.3f} |")
    print("\n| recipe operand (quantize + decode) | ms |\n|---|---|")
    for r in recipe:
        print(f"| {r['impl']} | {r['ms']:.3f} |")
    payload = {"env": env, "shape": args.shape, "copy_tbs": copy_tbs}
    payload.update(kernels=kernels, sweep=configs, recipe=recipe)
    write_json("bench_nvfp4_decode.json", payload, args.json)


if __name__ == "__main__":
    main()
