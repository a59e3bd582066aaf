"""``lowp::mxfp8_gemm``: the reference against a float64 decode of the FP8 bits, the Triton kernel (both
operand kinds, both scaling variants) against the reference, ``opcheck`` and argument errors.

``interp`` tests run the kernel on CPU tensors under TRITON_INTERPRET=1 (tiny shapes); ``gpu`` tests the
same bodies on CUDA at LM-head-like shapes.
"""

from __future__ import annotations

import pytest
import torch

from lowp_ops.kernels import mxfp8_gemm as gemm_kernels
from lowp_ops.reference import mxfp8 as mxfp8_ref
from lowp_ops.reference import mxfp8_gemm as gemm_ref

FP8_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SUITES = [
    pytest.param("interp", marks=pytest.mark.interp, id="interp"),
    pytest.param("gpu", marks=pytest.mark.gpu, id="gpu"),
]
# (M, N, K): a K tail (K % 64 != 0, a partial 32-block), M/N tails, and an even case.
SHAPES = {"interp": [(40, 24, 100), (64, 48, 128)], "gpu": [(1000, 520, 4100), (2048, 4096, 8192)]}


def quantized_a(m: int, k: int, use: str, fp8_dtype: str, gen, device="cpu"):
    """(data uint8, scale) of op(A) (M, K) with a wide magnitude spread between 32-blocks."""
    shape = (m, k) if use == "rowwise" else (k, m)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 7, shape, generator=gen).float())
    row_data, row_scale, col_data, col_scale = mxfp8_ref.mxfp8_quantize(
        x.to(device), fp8_dtype, use == "rowwise", use == "columnwise", "compact"
    )
    if use == "rowwise":
        return row_data.view(torch.uint8), row_scale
    return col_data.view(torch.uint8), col_scale


def other_operand(k: int, n: int, kind: str, gen, device="cpu"):
    """(b, b_scale): bf16 (K, N), or its E4M3 column-wise copy (blocks along K)."""
    b = torch.randn(k, n, generator=gen).to(torch.bfloat16).to(device)
    if kind == "bf16":
        return b, None
    _, _, col_data, col_scale = mxfp8_ref.mxfp8_quantize(b, "e4m3", False, True, "compact")
    return col_data.view(torch.uint8), col_scale


def decode_float64(
    data: torch.Tensor, scale: torch.Tensor, fp8_dtype: str, blocks_along: int
) -> torch.Tensor:
    """Independent oracle: FP8 bits through torch's float8 dtype, times 2^(code - 127), in float64."""
    values = data.view(FP8_TORCH[fp8_dtype]).double()
    rows, cols = values.shape
    exponents = scale.double() - 127
    if blocks_along == 1:
        exponents = exponents[:rows].repeat_interleave(32, dim=1)[:, :cols]
    else:
        exponents = exponents[:, :cols].repeat_interleave(32, dim=0)[:rows]
    return values * torch.exp2(exponents)


@pytest.mark.parametrize("use", ["rowwise", "columnwise"])
@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
@pytest.mark.parametrize("fp8_dtype", ["e4m3", "e5m2"])
def test_reference_equals_float64_decode_then_matmul(use, kind, fp8_dtype):
    gen = torch.Generator().manual_seed(1)
    m, n, k = 37, 29, 100
    a_data, a_scale = quantized_a(m, k, use, fp8_dtype, gen)
    b, b_scale = other_operand(k, n, kind, gen)
    a64 = decode_float64(a_data, a_scale, fp8_dtype, 1 if use == "rowwise" else 0)
    a64 = a64 if use == "rowwise" else a64.t()
    b64 = b.double() if b_scale is None else decode_float64(b, b_scale, "e4m3", 0)
    out = gemm_ref.mxfp8_gemm(a_data, a_scale, use, fp8_dtype, b, b_scale, "e4m3", torch.float32)
    torch.testing.assert_close(out.double(), a64 @ b64, rtol=1e-5, atol=1e-5 * (a64.abs() @ b64.abs()).max())


def run_kernel_against_reference(suite, use, kind, dot_scaled, fp8_dtype, accumulate):
    device = "cuda" if suite == "gpu" else "cpu"
    gen = torch.Generator().manual_seed(2)
    for m, n, k in SHAPES[suite]:
        a_data, a_scale = quantized_a(m, k, use, fp8_dtype, gen, device)
        b, b_scale = other_operand(k, n, kind, gen, device)
        want = gemm_ref.mxfp8_gemm(a_data, a_scale, use, fp8_dtype, b, b_scale, "e4m3", torch.float32)
        out = torch.randn(m, n, generator=gen).to(device)
        if accumulate:
            want = want + out
        gemm_kernels.mxfp8_gemm_into(
            out, a_data, a_scale, use, fp8_dtype, b, b_scale, "e4m3", accumulate, dot_scaled=dot_scaled
        )
        scale = (want.abs().max() + 1).item()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6 * scale * k**0.5)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("use", ["rowwise", "columnwise"])
@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
@pytest.mark.parametrize("dot_scaled", [False, True], ids=["registers", "dot_scaled"])
def test_kernel_matches_reference(suite, use, kind, dot_scaled):
    run_kernel_against_reference(suite, use, kind, dot_scaled, "e4m3", accumulate=False)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("use", ["rowwise", "columnwise"])
def test_kernel_e5m2_accumulates_into_out(suite, use):
    run_kernel_against_reference(suite, use, "bf16", False, "e5m2", accumulate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_op_on_cuda_rounds_once_to_out_dtype(out_dtype):
    gen = torch.Generator().manual_seed(3)
    a_data, a_scale = quantized_a(300, 640, "rowwise", "e4m3", gen, "cuda")
    b, _ = other_operand(640, 200, "bf16", gen, "cuda")
    got = torch.ops.lowp.mxfp8_gemm(a_data, a_scale, "rowwise", "e4m3", b, None, "e4m3", out_dtype)
    assert got.dtype == out_dtype
    # Exact product in float64 and the fp32 accumulation bound: the tensor cores sum in another order
    # than cuBLAS sgemm (the H200 run showed 2e-3 absolute differences on outputs of magnitude ~100).
    a = mxfp8_ref.mxfp8_dequantize(a_data.cpu(), a_scale.cpu(), "e4m3", "rowwise", "compact", torch.float32)
    a = a.double()  # exact: fp8 values times powers of two
    exact = a @ b.cpu().double()
    bound = 4 * a.shape[1] * 2.0**-24 * (a.abs() @ b.cpu().double().abs()) + 1e-30
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()  # one rounding to bf16
    error = (got.cpu().double() - exact).abs()
    assert bool((error <= bound).all()), f"worst error / bound: {float((error / bound).max()):.3g}"


@pytest.mark.parametrize("use", ["rowwise", "columnwise"])
@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_opcheck(use, kind):
    gen = torch.Generator().manual_seed(4)
    a_data, a_scale = quantized_a(33, 70, use, "e4m3", gen)
    b, b_scale = other_operand(70, 19, kind, gen)
    torch.library.opcheck(
        torch.ops.lowp.mxfp8_gemm.default, (a_data, a_scale, use, "e4m3", b, b_scale, "e4m3", torch.bfloat16)
    )


BAD_CALLS = {
    "a_use": (dict(a_use="transposed"), "a_use must be one of"),
    "a_data": (dict(a_data=torch.zeros(32, 64)), "a_data must be uint8"),
    "a_scale": (dict(a_scale=torch.zeros(128, 8, dtype=torch.uint8)), "a_scale must have the compact shape"),
    "b": (dict(b=torch.zeros(63, 16)), "b must have K = 64 rows"),
    "b_scale": (dict(b_scale=torch.zeros(4, 16, dtype=torch.uint8)), "b with b_scale must be uint8"),
    "fp8_dtype": (dict(a_fp8_dtype="e3m4"), "fp8_dtype must be one of"),
    "out_dtype": (dict(out_dtype=torch.int32), "out_dtype must be"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_arguments_raise_naming_the_argument(name):
    args = dict(
        a_data=torch.zeros(32, 64, dtype=torch.uint8),
        a_scale=torch.zeros(128, 4, dtype=torch.uint8),
        a_use="rowwise",
        a_fp8_dtype="e4m3",
        b=torch.zeros(64, 16, dtype=torch.bfloat16),
        b_scale=None,
        b_fp8_dtype="e4m3",
        out_dtype=torch.bfloat16,
    )
    overrides, message = BAD_CALLS[name]
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        torch.ops.lowp.mxfp8_gemm(*args.values())
