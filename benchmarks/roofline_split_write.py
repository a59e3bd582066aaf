"""What the MXFP8 access pattern itself reaches on the H200 (not a test): read a bf16 tile once and
write it as two fp8 arrays (row+col data, no scales, no arithmetic), next to a same-run copy. This is
the ceiling a row+col quantizer with this memory layout can reach. Also: registers/spills and the
row-only / column-only split of the fused CE backward."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from _common import copy_bandwidth_tbs, gpu_script_args, median_ms

from lowp_ops.kernels.cross_entropy import launch_cross_entropy_bwd_mxfp8, launch_cross_entropy_fwd
from lowp_ops.kernels.mxfp8 import launch_mxfp8_quantize


@triton.jit
def split_write_kernel(
    x_ptr, a_ptr, b_ptr, cols, BLOCK_COLS: tl.constexpr, TWO: tl.constexpr, ALONG_ROWS: tl.constexpr
):
    if ALONG_ROWS:  # adjacent programs on adjacent column tiles of one 32-row block
        row_block, col_tile = (
            tl.program_id(0) // tl.cdiv(cols, BLOCK_COLS),
            tl.program_id(0) % tl.cdiv(cols, BLOCK_COLS),
        )
    else:  # adjacent programs down a column strip
        row_block, col_tile = tl.program_id(0) % 512, tl.program_id(0) // 512  # 16384 rows
    rows_idx = row_block * 32 + tl.arange(0, 32)
    cols_idx = col_tile * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    offsets = rows_idx[:, None].to(tl.int64) * cols + cols_idx[None, :]
    x = tl.load(x_ptr + offsets).to(tl.float32)
    tl.store(a_ptr + offsets, x.to(tl.float8e4nv))
    if TWO:
        tl.store(b_ptr + offsets, (x * 2.0).to(tl.float8e4nv))


def main() -> None:
    gpu_script_args(__doc__)
    _, copy_tbs = copy_bandwidth_tbs()
    print(f"copy {copy_tbs:.3f} TB/s")
    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    a = torch.empty(x.shape, device="cuda", dtype=torch.float8_e4m3fn)
    b = torch.empty_like(a)
    for along_rows in (False, True):
        for two in (True, False):
            floor = 4.0 if two else 3.0
            for block_cols, warps in [(64, 1), (128, 1), (256, 1), (256, 2), (256, 4), (512, 4)]:
                grid = (x.numel() // (32 * block_cols),)

                def launch(grid=grid, block_cols=block_cols, warps=warps, two=two, along_rows=along_rows):
                    return split_write_kernel[grid](
                        x, a, b, x.shape[1], BLOCK_COLS=block_cols, TWO=two, ALONG_ROWS=along_rows,
                        num_warps=warps,
                    )  # fmt: skip

                ms = median_ms(launch)
                pct = 100 * floor * x.numel() / ms / 1e9 / copy_tbs
                name = ("write 2 fp8" if two else "write 1 fp8") + (
                    " along rows" if along_rows else " down columns"
                )
                print(f"read bf16, {name} cols={block_cols} warps={warps}: {ms:.4f} ms {pct:5.1f}% of copy")
    launch_mxfp8_quantize(x, "e4m3", True, True, "compact")
    n_rows, vocab = 4096, 129280
    logits = (torch.randn(n_rows, vocab, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    _, lse = launch_cross_entropy_fwd(logits, target, 0.0, -100)
    grad_rows = torch.full((n_rows,), 1.0 / n_rows, device="cuda")
    for rowwise, columnwise, floor in [(True, True, 4.0625), (True, False, 3.03), (False, True, 3.03)]:
        ms = median_ms(
            lambda r=rowwise, c=columnwise: launch_cross_entropy_bwd_mxfp8(
                logits, target, lse, grad_rows, 0.0, -100, "e4m3", r, c, "compact"
            )
        )
        pct = 100 * floor * logits.numel() / ms / 1e9 / copy_tbs
        print(f"ce bwd mxfp8 rowwise={rowwise} columnwise={columnwise}: {ms:.4f} ms {pct:5.1f}%")
    from lowp_ops.kernels import cross_entropy, mxfp8

    try:
        for fn in (mxfp8.mxfp8_quantize_kernel, cross_entropy.cross_entropy_bwd_mxfp8_kernel):
            for device_cache in fn.device_caches.values():
                for compiled_kernel in device_cache[0].values():  # (kernel cache, ...) in triton 3.6
                    print(
                        fn.__name__ if hasattr(fn, "__name__") else fn.fn.__name__,
                        "warps", compiled_kernel.metadata.num_warps,
                        "regs", compiled_kernel.n_regs, "spills", compiled_kernel.n_spills,
                    )  # fmt: skip

    except Exception as error:  # the cache layout is a Triton internal
        print("registers not available:", type(error).__name__, error)


if __name__ == "__main__":
    main()
