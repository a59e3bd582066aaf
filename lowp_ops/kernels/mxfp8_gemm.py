"""MXFP8 GEMM ``out = op(A) @ B`` (operands as in :mod:`lowp_ops.meta.mxfp8_gemm`) for the LM-head backward.

sm90 has no block-scaled MMA, so the Triton kernel scales in registers: each K step loads the FP8 tile of
A and its E8M0 codes (one per 32 elements along K), multiplies by ``2^(e - 127)`` (exact: an FP8 value
times a power of two fits bf16) and feeds a bf16 MMA with fp32 accumulation. ``B`` is the bf16 operand
as given, or MXFP8 with blocks along K, scaled the same way (TE's recipe). ``dot_scaled=True`` hands the
FP8 tiles and codes to ``tl.dot_scaled`` instead, which the compiler itself upcasts to bf16 on sm90.

On sm100 (block-scaled tensor cores) an MXFP8 ``B`` goes to ``torch._scaled_mm`` with MX scales.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..formats import FP8_DTYPES, ceil_div, next_power_of_2
from ..meta.mxfp8_gemm import gemm_dims, mxfp8_gemm_output
from ..reference.mxfp8 import swizzle_scales
from .bf16_pairs import to_dtype_rne
from .launch import cached_launch
from .mxfp8 import dequantize_multiplier, fp8_to_fp32

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DOT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TRITON_DTYPES = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


@triton.jit
def scale_tile_along_k(values, codes, BLOCK_K: tl.constexpr, K_AXIS: tl.constexpr):
    """fp32 ``values`` times ``2^(code - 127)`` per 32 elements along ``K_AXIS`` of a 2-D tile. ``codes``:
    one E8M0 code per block, ``[rows, BLOCK_K // 32]`` for K_AXIS 1, ``[BLOCK_K // 32, cols]`` for 0."""
    multiplier = dequantize_multiplier(codes.to(tl.int32))
    if K_AXIS == 1:
        rows: tl.constexpr = values.shape[0]
        blocks = tl.reshape(values, [rows, BLOCK_K // 32, 32]) * multiplier[:, :, None]
        return tl.reshape(blocks, [rows, BLOCK_K])
    else:
        cols: tl.constexpr = values.shape[1]
        blocks = tl.reshape(values, [BLOCK_K // 32, 32, cols]) * multiplier[:, None, :]
        return tl.reshape(blocks, [BLOCK_K, cols])


@cached_launch
@triton.jit
def mxfp8_gemm_kernel(
    a_ptr,
    stride_am,
    stride_ak,
    a_scale_ptr,
    stride_asm,
    stride_ask,
    b_ptr,
    stride_bk,
    stride_bn,
    b_scale_ptr,
    stride_bsk,
    stride_bsn,
    c_ptr,
    stride_cm,
    stride_cn,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_FORMAT: tl.constexpr,
    B_FORMAT: tl.constexpr,
    B_IS_MXFP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One program: a BLOCK_M x BLOCK_N tile of ``out``, grouped along M for L2 reuse of B."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * tiles_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    # Rows/columns past M/N wrap around (valid addresses, never stored): no masks on M and N.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    a_scale_ptrs = a_scale_ptr + offs_m[:, None] * stride_asm + offs_kb[None, :] * stride_ask
    b_scale_ptrs = b_scale_ptr + offs_kb[:, None] * stride_bsk + offs_n[None, :] * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # K tail: data 0 with code 0 contributes exactly 0.
        if EVEN_K:
            a = tl.load(a_ptrs)
            a_codes = tl.load(a_scale_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(offs_k < K - k0)[None, :], other=0.0)
            a_codes = tl.load(a_scale_ptrs, mask=(offs_kb * 32 < K - k0)[None, :], other=0)
            b = tl.load(b_ptrs, mask=(offs_k < K - k0)[:, None], other=0.0)
        if B_IS_MXFP8:
            if EVEN_K:
                b_codes = tl.load(b_scale_ptrs)
            else:
                b_codes = tl.load(b_scale_ptrs, mask=(offs_kb * 32 < K - k0)[:, None], other=0)
        if DOT_SCALED:
            if B_IS_MXFP8:
                acc = tl.dot_scaled(a, a_codes, A_FORMAT, b, tl.trans(b_codes), B_FORMAT, acc)
            else:
                acc = tl.dot_scaled(a, a_codes, A_FORMAT, b, None, B_FORMAT, acc)
        else:
            # Upcast right after the load (the interpreter's bf16 math is wrong); scale in fp32, exactly.
            a_values = scale_tile_along_k(fp8_to_fp32(a), a_codes, BLOCK_K, 1).to(DOT_DTYPE)
            if B_IS_MXFP8:
                b_values = scale_tile_along_k(fp8_to_fp32(b), b_codes, BLOCK_K, 0).to(DOT_DTYPE)
            elif FP32_DOT:
                b_values = b.to(tl.float32)
            else:
                b_values = b
            if FP32_DOT:
                acc = tl.dot(a_values, b_values, acc, input_precision="ieee")
            else:
                acc = tl.dot(a_values, b_values, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        a_scale_ptrs += (BLOCK_K // 32) * stride_ask
        b_scale_ptrs += (BLOCK_K // 32) * stride_bsk

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_bounds = (rows[:, None] < M) & (cols[None, :] < N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :].to(tl.int64) * stride_cn
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=in_bounds, other=0.0).to(tl.float32)
    tl.store(c_ptrs, to_dtype_rne(acc, c_ptr.dtype.element_ty), mask=in_bounds)


def gemm_config(m: int, n: int, k: int) -> dict:
    """Fixed launch configuration (no autotuning: CUDA-graph capture). Under the interpreter the tiles
    shrink to the problem (fewer, larger numpy steps)."""
    if INTERPRET:
        clamp = lambda size, low, high: max(low, min(high, next_power_of_2(size)))
        return dict(BLOCK_M=clamp(m, 16, 64), BLOCK_N=clamp(n, 16, 64), BLOCK_K=clamp(k, 32, 64), GROUP_M=8)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


def _dot_dtype(b: torch.Tensor, b_is_mxfp8: bool):
    if INTERPRET:
        return tl.float32  # the interpreter's bf16 dot is wrong
    return tl.bfloat16 if b_is_mxfp8 else TRITON_DTYPES[DOT_FORMATS[b.dtype]]


def _operand_strides(data: torch.Tensor, scale: torch.Tensor, use: str) -> tuple[int, int, int, int]:
    """(stride along M, along K, scale stride along M, scale stride along K-blocks) of op(A)."""
    if use == "rowwise":
        return data.stride(0), data.stride(1), scale.stride(0), scale.stride(1)
    return data.stride(1), data.stride(0), scale.stride(1), scale.stride(0)


def uses_scaled_mm(a_data: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor | None, k: int) -> bool:
    """Block-scaled tensor cores (sm100 family) and an MXFP8 ``B`` of a shape ``_scaled_mm`` takes."""
    if not a_data.is_cuda or b_scale is None or INTERPRET:
        return False
    major, _ = torch.cuda.get_device_capability(a_data.device)
    return major == 10 and k % 32 == 0 and b.shape[1] % 16 == 0


def _scaled_mm(a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, out_dtype) -> torch.Tensor:
    """sm100: ``torch._scaled_mm`` wants A (M, K) row-major and B (K, N) column-major, both with 1x32
    blocks along K and GEMM-swizzled E8M0 scales: transpose what is stored the other way."""
    if a_use == "rowwise":
        a_rows, a_row_scale = a_data, a_scale
    else:
        a_rows, a_row_scale = a_data.t().contiguous(), a_scale.t()
    b_rows, b_row_scale = b.t().contiguous(), b_scale.t()
    e8m0 = torch.float8_e8m0fnu
    return torch._scaled_mm(
        a_rows.view(FP8_DTYPES[a_fp8_dtype]),
        b_rows.view(FP8_DTYPES[b_fp8_dtype]).t(),
        swizzle_scales(a_row_scale.contiguous()).view(e8m0),
        swizzle_scales(b_row_scale.contiguous()).view(e8m0),
        out_dtype=out_dtype,
    )


def mxfp8_gemm_into(
    out: torch.Tensor,
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_use: str,
    a_fp8_dtype: str,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    b_fp8_dtype: str,
    accumulate: bool,
    dot_scaled: bool = False,
    config: dict | None = None,
) -> None:
    """``out = out_dtype(op(A) @ B [+ out])`` into ``out`` (M, N), any strides; fp32 accumulation, one
    rounding. ``dot_scaled`` and ``config`` select the kernel variant and launch configuration."""
    m, n, k = gemm_dims(a_data, a_use, b)
    if m == 0 or n == 0:
        return
    if k == 0:
        if not accumulate:
            out.zero_()
        return
    if uses_scaled_mm(a_data, b, b_scale, k):
        product = _scaled_mm(a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, out.dtype)
        out.add_(product) if accumulate else out.copy_(product)
        return
    b_is_mxfp8 = b_scale is not None
    stride_am, stride_ak, stride_asm, stride_ask = _operand_strides(a_data, a_scale, a_use)
    config = config or gemm_config(m, n, k)
    dot_dtype = _dot_dtype(b, b_is_mxfp8)
    grid = (ceil_div(m, config["BLOCK_M"]) * ceil_div(n, config["BLOCK_N"]),)
    mxfp8_gemm_kernel[grid](
        a_data.view(FP8_DTYPES[a_fp8_dtype]),
        stride_am,
        stride_ak,
        a_scale,
        stride_asm,
        stride_ask,
        b.view(FP8_DTYPES[b_fp8_dtype]) if b_is_mxfp8 else b,
        b.stride(0),
        b.stride(1),
        b_scale if b_is_mxfp8 else a_scale,
        b_scale.stride(0) if b_is_mxfp8 else 0,
        b_scale.stride(1) if b_is_mxfp8 else 0,
        out,
        out.stride(0),
        out.stride(1),
        m,
        n,
        k,
        A_FORMAT=a_fp8_dtype,
        B_FORMAT=b_fp8_dtype if b_is_mxfp8 else DOT_FORMATS[b.dtype],
        B_IS_MXFP8=b_is_mxfp8,
        DOT_DTYPE=dot_dtype,
        FP32_DOT=dot_dtype == tl.float32,
        DOT_SCALED=dot_scaled,
        ACCUMULATE=accumulate,
        EVEN_K=k % config["BLOCK_K"] == 0,
        **config,
    )


def launch_mxfp8_gemm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_use: str,
    a_fp8_dtype: str,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    b_fp8_dtype: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``lowp::mxfp8_gemm`` on CUDA (or interpreted CPU) tensors."""
    out = mxfp8_gemm_output(a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, out_dtype)
    mxfp8_gemm_into(out, a_data, a_scale, a_use, a_fp8_dtype, b, b_scale, b_fp8_dtype, False)
    return out
