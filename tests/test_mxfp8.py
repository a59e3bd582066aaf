"""MXFP8 semantics on CPU: E8M0 scale codes, multipliers, the public quantize/dequantize against an
independent per-block oracle written from docs/mxfp8.md#quantization, scale layouts, round-trip
error, NaN/Inf, argument errors, opcheck and torch.compile.

Every expected value here is derived in this file (exact fractions, integer bit rules, explicit loops),
never by calling the code under test.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import struct
from fractions import Fraction

import pytest
import torch
import torch._dynamo.testing
import torch._dynamo.utils
from cudagraph_checks import PAYLOAD_FIELDS, ce_inputs
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import lowp_ops
from lowp_ops.meta.checks import check_float_dtype
from lowp_ops.meta.mxfp8 import check_fp8_dtype, normalize_fp8_dtype
from lowp_ops.meta.split_sizes import set_split_size_checks
from lowp_ops.reference.mxfp8 import dequantize_multiplier, e8m0_from_amax, quantize_multiplier

# Independent constants (docs/mxfp8.md#format): max normal, mantissa bits, exponent of the smallest subnormal.
FP8_SPEC = {
    "e4m3": {"max": 448.0, "mantissa_bits": 3, "min_subnormal_exp": -9, "torch": torch.float8_e4m3fn},
    "e5m2": {"max": 57344.0, "mantissa_bits": 2, "min_subnormal_exp": -16, "torch": torch.float8_e5m2},
}
# Closed-form shift S with max_norm = 1.75 * 2^S (docs/mxfp8.md#quantization step 3).
CLOSED_FORM_SHIFT = {"e4m3": 8, "e5m2": 15}
FP8_DTYPES = ("e4m3", "e5m2")
BLOCK = 32
# Argument errors: what matters is the message naming the argument, not the exception class.
ARG_ERRORS = (ValueError, RuntimeError)


def fp32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def fp32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def fp32_round(value: float) -> float:
    """Round a Python float to the nearest fp32 (RNE), as an exact Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def max_norm_rcp(fp8_dtype: str) -> float:
    """R = fp32(1 / max_norm), the constant TE multiplies by (docs/mxfp8.md#quantization step 2)."""
    return fp32_round(1.0 / FP8_SPEC[fp8_dtype]["max"])


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def exact_e8m0(amax: float, fp8_dtype: str) -> int:
    """Smallest e >= 0 with 2^(e - 127) >= amax / max_norm, in exact rational arithmetic."""
    if math.isnan(amax):
        return 255
    if math.isinf(amax):
        return 254
    if amax == 0:
        return 0
    ratio = Fraction(amax) / Fraction(FP8_SPEC[fp8_dtype]["max"])
    k = ratio.numerator.bit_length() - ratio.denominator.bit_length() - 1
    while Fraction(2) ** k < ratio:
        k += 1
    while Fraction(2) ** (k - 1) >= ratio:
        k -= 1
    return max(0, k + 127)


def closed_form_e8m0(amax_bits: int, fp8_dtype: str) -> int:
    """docs/mxfp8.md step 3, integer closed form on the fp32 amax bits: max(0, E_a - S + [M_a > 0x600000])."""
    exponent, mantissa = amax_bits >> 23, amax_bits & 0x7FFFFF
    if exponent == 0xFF:
        return 255 if mantissa else 254
    if amax_bits == 0:
        return 0
    return max(0, exponent - CLOSED_FORM_SHIFT[fp8_dtype] + (mantissa > 0x600000))


def spec_e8m0(v: float) -> int:
    """docs/mxfp8.md#quantization step 3, the software float_to_e8m0 on the fp32 value v = amax * R."""
    if math.isnan(v):
        return 0xFF
    if math.isinf(v):
        return 0xFE
    if v == 0:
        return 0
    bits = fp32_bits(v)
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    rounds_up = mantissa > 0 and exponent != 0xFE and not (exponent == 0 and mantissa <= 0x400000)
    return exponent + 1 if rounds_up else exponent


def spec_multiplier(code: int) -> float:
    """docs/mxfp8.md#quantization step 4: 2^(127 - e); e = 254 -> 2^-127; e = 255 -> NaN."""
    if code == 255:
        return math.nan
    return 2.0 ** (127 - code)


def c_fmaxf(a: float, b: float) -> float:
    """C's fmaxf: the larger operand; when one operand is NaN, the other one."""
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def te_block_amax(values: list[float]) -> float:
    """TE's block amax: ``amax = fmaxf(amax, fabsf(x))`` over the block, starting from 0."""
    amax = 0.0
    for v in values:
        amax = c_fmaxf(amax, abs(v))
    return amax


def oracle_block(values: torch.Tensor, fp8_dtype: str) -> tuple[int, torch.Tensor]:
    """(E8M0 code, FP8 bytes) of one block of fp32 values, step by step as docs/mxfp8.md#quantization."""
    as_float = [float(v) for v in values.tolist()]
    amax = te_block_amax(as_float)
    v = fp32_round(amax * max_norm_rcp(fp8_dtype))  # exact product, one fp32 rounding
    code = spec_e8m0(v)
    multiplier = spec_multiplier(code)
    fp8_max = FP8_SPEC[fp8_dtype]["max"]
    scaled = torch.tensor([x * multiplier for x in as_float], dtype=torch.float64).float()
    scaled = scaled.clamp(-fp8_max, fp8_max)  # satfinite; clamp keeps NaN
    data = scaled.to(FP8_SPEC[fp8_dtype]["torch"]).view(torch.uint8)
    data = torch.where(torch.isnan(scaled), torch.tensor(0x7F, dtype=torch.uint8), data)
    return code, data


def oracle_quantize(x: torch.Tensor, fp8_dtype: str):
    """Compact (row_data, row_scale, col_data, col_scale) from a per-block loop, all uint8."""
    rows = math.prod(x.shape[:-1])
    cols = x.shape[-1]
    x2d = x.reshape(rows, cols).float()
    row_blocks, col_blocks = -(-cols // BLOCK), -(-rows // BLOCK)
    row_data = torch.zeros(rows, cols, dtype=torch.uint8)
    col_data = torch.zeros(rows, cols, dtype=torch.uint8)
    row_scale = torch.zeros(round_up(rows, 128), round_up(row_blocks, 4), dtype=torch.uint8)
    col_scale = torch.zeros(round_up(col_blocks, 4), round_up(cols, 128), dtype=torch.uint8)
    for r in range(rows):
        for b in range(row_blocks):
            code, data = oracle_block(x2d[r, b * BLOCK : (b + 1) * BLOCK], fp8_dtype)
            row_scale[r, b] = code
            row_data[r, b * BLOCK : (b + 1) * BLOCK] = data
    for c in range(cols):
        for b in range(col_blocks):
            code, data = oracle_block(x2d[b * BLOCK : (b + 1) * BLOCK, c], fp8_dtype)
            col_scale[b, c] = code
            col_data[b * BLOCK : (b + 1) * BLOCK, c] = data
    return row_data.view(x.shape), row_scale, col_data.view(x.shape), col_scale


def spread_values(shape, dtype, seed: int, max_exp: int = 30) -> torch.Tensor:
    """randn with each column multiplied by 2^k, k uniform in [-max_exp, max_exp]."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64)
    exponents = torch.randint(-max_exp, max_exp + 1, (shape[-1],), generator=gen, dtype=torch.float64)
    return (values * torch.exp2(exponents)).to(dtype)


def extreme_values(shape, dtype, seed: int) -> torch.Tensor:
    """randn * 2^(k_row + k_col): k_row in [-150, 117] (down to subnormals), k_col in [-8, 8]."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64)
    exponents = torch.randint(-150, 118, (*shape[:-1], 1), generator=gen) + torch.randint(
        -8, 9, (shape[-1],), generator=gen
    )
    return (values * torch.exp2(exponents.double())).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------------- E8M0 codes

BF16_MIN_SUBNORMAL = 2.0**-133
BF16_MAX = (2 - 2**-7) * 2.0**127
FP32_ULP_AT_448 = 2.0**-15  # 448 lies in [256, 512): ulp 2^(8 - 23)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize(
    "amax",
    [
        0.0,
        1.0,
        448.0,
        449.0,
        57344.0,
        448.0 * 2**-20,
        448.0 * 2**5,
        448.0 * 2**100,
        448.0 + FP32_ULP_AT_448,
        448.0 - FP32_ULP_AT_448 / 2,
        BF16_MIN_SUBNORMAL,
        BF16_MAX,
        2.0**-100,
        3.0,
    ],
)
def test_e8m0_code_is_smallest_power_of_two_at_or_above_amax_over_max(amax, fp8_dtype):
    code = e8m0_from_amax(torch.tensor([amax], dtype=torch.float32), fp8_dtype)
    assert code.item() == exact_e8m0(amax, fp8_dtype)


@pytest.mark.parametrize(
    ("amax", "fp8_dtype", "expected"),
    [
        (0.0, "e4m3", 0),
        (0.0, "e5m2", 0),
        (448.0, "e4m3", 127),
        (448.0 * 2**3, "e4m3", 130),
        (448.0 * 2**-3, "e4m3", 124),
        (449.0, "e4m3", 128),
        (1.0, "e4m3", 119),
        (1.0, "e5m2", 112),
        (57344.0, "e5m2", 127),
        (BF16_MAX, "e4m3", 247),
        (BF16_MAX, "e5m2", 240),
        (BF16_MIN_SUBNORMAL, "e4m3", 0),
        (BF16_MIN_SUBNORMAL, "e5m2", 0),
        (math.nan, "e4m3", 255),
        (math.nan, "e5m2", 255),
        (math.inf, "e4m3", 254),
        (math.inf, "e5m2", 254),
    ],
)
def test_e8m0_code_spec_examples(amax, fp8_dtype, expected):
    code = e8m0_from_amax(torch.tensor([amax], dtype=torch.float32), fp8_dtype)
    assert code.dtype == torch.int32
    assert code.item() == expected


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_e8m0_code_matches_closed_form_for_every_bf16_magnitude(fp8_dtype):
    patterns = list(range(0x8000))  # every non-negative bf16: zero, subnormals, normals, Inf, NaNs
    amax = torch.tensor(patterns, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    expected = [closed_form_e8m0(bits << 16, fp8_dtype) for bits in patterns]
    got = e8m0_from_amax(amax, fp8_dtype).tolist()
    mismatches = [(hex(p), e, g) for p, e, g in zip(patterns, expected, got, strict=True) if e != g]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:5]}"


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_closed_form_equals_exact_rounding_for_every_finite_bf16(fp8_dtype):
    """Guards the test's own closed form: it is the exact round-up for every finite bf16 amax."""
    for bits in range(0x7F80):
        amax = fp32_from_bits(bits << 16)
        assert closed_form_e8m0(bits << 16, fp8_dtype) == exact_e8m0(amax, fp8_dtype), hex(bits)


# ---------------------------------------------------------------------------------------- multipliers


@pytest.mark.parametrize(
    ("code", "quantize_bits", "dequantize_bits"),
    [
        (0, 0x7F000000, 0x00400000),  # 2^127 / 2^-127 (fp32 denormal)
        (1, 0x7E800000, 0x00800000),  # 2^126 / 2^-126
        (127, 0x3F800000, 0x3F800000),  # 1.0 / 1.0
        (253, 0x00800000, 0x7E800000),  # 2^-126 / 2^126
        (254, 0x00400000, 0x7F000000),  # 2^-127 / 2^127
        (255, 0x7FFFFFFF, 0x7FFFFFFF),  # NaN / NaN
    ],
)
def test_multiplier_bit_patterns(code, quantize_bits, dequantize_bits):
    codes = torch.tensor([code], dtype=torch.int32)
    assert quantize_multiplier(codes).view(torch.int32).item() == quantize_bits
    assert dequantize_multiplier(codes).view(torch.int32).item() == dequantize_bits


def test_max_norm_reciprocals_are_te_constants():
    assert fp32_bits(max_norm_rcp("e4m3")) == 0x3B124925
    assert fp32_bits(max_norm_rcp("e5m2")) == 0x37924925


# ------------------------------------------------------------------------ quantize against the oracle

ORACLE_SHAPES = [(1, 16), (33, 45), (70, 97), (3, 5, 33)]


@pytest.mark.parametrize("shape", ORACLE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_matches_per_block_oracle(shape, dtype, fp8_dtype):
    x = spread_values(shape, dtype, seed=sum(shape) * 7 + FP8_DTYPES.index(fp8_dtype))
    x.view(-1, shape[-1])[0, :] = 0  # an all-zero row-wise block (code 0, zero data)
    q = lowp_ops.mxfp8_quantize(x, fp8_dtype)
    row_data, row_scale, col_data, col_scale = oracle_quantize(x, fp8_dtype)
    assert q.row_data.dtype == q.col_data.dtype == FP8_SPEC[fp8_dtype]["torch"]
    assert q.row_data.shape == q.col_data.shape == x.shape
    assert torch.equal(q.row_scale, row_scale)  # shape, codes and zero padding
    assert torch.equal(q.col_scale, col_scale)
    assert torch.equal(as_bytes(q.row_data), row_data)
    assert torch.equal(as_bytes(q.col_data), col_data)


@pytest.mark.parametrize("shape", [(33, 45), (70, 97)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_matches_per_block_oracle_at_extreme_magnitudes(shape, dtype, fp8_dtype):
    """Down to fp32/bf16 subnormals (scale code 0, v = amax * R an fp32 denormal) and up to 2^127."""
    x = extreme_values(shape, dtype, seed=sum(shape))
    q = lowp_ops.mxfp8_quantize(x, fp8_dtype)
    row_data, row_scale, col_data, col_scale = oracle_quantize(x, fp8_dtype)
    valid_codes = row_scale[: shape[0], : -(-shape[1] // BLOCK)]
    assert (valid_codes == 0).any() and (valid_codes > 200).any(), "should reach both ends of the codes"
    assert torch.equal(q.row_scale, row_scale)
    assert torch.equal(q.col_scale, col_scale)
    assert torch.equal(as_bytes(q.row_data), row_data)
    assert torch.equal(as_bytes(q.col_data), col_data)


@pytest.mark.parametrize(
    ("shape", "row_scale_shape", "col_scale_shape"),
    [
        ((1, 16), (128, 4), (4, 128)),
        ((33, 45), (128, 4), (4, 128)),
        ((129, 129), (256, 8), (8, 256)),
        ((256, 4096), (256, 128), (8, 4096)),
        ((3, 5, 33), (128, 4), (4, 128)),
        ((4, 64, 160), (256, 8), (8, 256)),
    ],
)
def test_compact_scale_shapes(shape, row_scale_shape, col_scale_shape):
    q = lowp_ops.mxfp8_quantize(torch.ones(shape))
    assert tuple(q.row_scale.shape) == row_scale_shape
    assert tuple(q.col_scale.shape) == col_scale_shape
    assert q.row_scale.dtype == q.col_scale.dtype == torch.uint8


def test_ties_round_to_nearest_even_in_e4m3():
    # amax 448 gives code 127 and multiplier 1, so the bytes are the E4M3 RNE encodings of the inputs.
    values = [448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 0.0, -448.0]
    expected = [0x7E, 0x38, 0x3A, 0xB8, 0x00, 0x02, 0x00, 0xFE]
    x = torch.tensor([values * 4])
    q = lowp_ops.mxfp8_quantize(x, "e4m3", columnwise=False)
    assert q.row_scale[0, 0].item() == 127
    assert as_bytes(q.row_data)[0].tolist() == expected * 4


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_single_copies_equal_the_matching_copy_of_both(fp8_dtype):
    x = spread_values((40, 70), torch.bfloat16, seed=3)
    both = lowp_ops.mxfp8_quantize(x, fp8_dtype)
    row = lowp_ops.mxfp8_quantize(x, fp8_dtype, rowwise=True, columnwise=False)
    col = lowp_ops.mxfp8_quantize(x, fp8_dtype, rowwise=False, columnwise=True)
    assert row.col_data is None and row.col_scale is None
    assert col.row_data is None and col.row_scale is None
    assert torch.equal(as_bytes(row.row_data), as_bytes(both.row_data))
    assert torch.equal(row.row_scale, both.row_scale)
    assert torch.equal(as_bytes(col.col_data), as_bytes(both.col_data))
    assert torch.equal(col.col_scale, both.col_scale)


# ------------------------------------------------------------------------------------ swizzled layout


def te_swizzle_index(i: int, j: int, n_tiles_x: int) -> int:
    """TE gemm_swizzled_scale_idx (docs/mxfp8.md#scale-layouts)."""
    return (i // 128 * n_tiles_x + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4


def swizzle_row_scales_by_loop(compact: torch.Tensor) -> torch.Tensor:
    rows, cols = compact.shape
    flat = torch.zeros(rows * cols, dtype=torch.uint8)
    for i in range(rows):
        for j in range(cols):
            flat[te_swizzle_index(i, j, cols // 4)] = compact[i, j]
    return flat.view(rows, cols)


def swizzle_col_scales_by_loop(compact: torch.Tensor) -> torch.Tensor:
    """Column-wise scales: the row-wise swizzle of the transpose (i = column, j = 32-row block,
    n_tiles_x = padded scale rows / 4), in the compact tensor's shape."""
    return swizzle_row_scales_by_loop(compact.t().contiguous()).view(compact.shape)


@pytest.mark.parametrize("shape", [(200, 300), (33, 45), (2, 3, 129)], ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_swizzled_scales_are_compact_scales_moved_by_te_index(shape, fp8_dtype):
    x = spread_values(shape, torch.float32, seed=7)
    compact = lowp_ops.mxfp8_quantize(x, fp8_dtype, scale_layout="compact")
    swizzled = lowp_ops.mxfp8_quantize(x, fp8_dtype, scale_layout="swizzled")
    assert swizzled.row_scale.shape == compact.row_scale.shape
    assert swizzled.col_scale.shape == compact.col_scale.shape
    assert torch.equal(swizzled.row_scale, swizzle_row_scales_by_loop(compact.row_scale))
    assert torch.equal(swizzled.col_scale, swizzle_col_scales_by_loop(compact.col_scale))
    assert torch.equal(as_bytes(swizzled.row_data), as_bytes(compact.row_data))
    assert torch.equal(as_bytes(swizzled.col_data), as_bytes(compact.col_data))


def test_swizzle_index_loop_puts_tile_rows_in_te_order():
    # Within a 128x4 tile, four-byte rows are stored in the order 0, 32, 64, 96, 1, 33, ... (docs/mxfp8.md).
    compact = torch.arange(128, dtype=torch.uint8).repeat_interleave(4).view(128, 4)
    swizzled = swizzle_row_scales_by_loop(compact)
    order = swizzled.view(-1, 4)[:, 0].tolist()
    assert order[:6] == [0, 32, 64, 96, 1, 33]


@pytest.mark.parametrize("use", ["rowwise", "columnwise"])
def test_dequantize_reads_swizzled_scales(use):
    x = spread_values((130, 70), torch.float32, seed=11)
    compact = lowp_ops.mxfp8_quantize(x, scale_layout="compact")
    swizzled = lowp_ops.mxfp8_quantize(x, scale_layout="swizzled")
    expected = lowp_ops.mxfp8_dequantize(compact, torch.float32, use=use)
    got = lowp_ops.mxfp8_dequantize(swizzled, torch.float32, use=use)
    assert torch.equal(got, expected)


# ------------------------------------------------------------------------------------------ round trip


def block_amax(x2d: torch.Tensor, use: str) -> torch.Tensor:
    """Per element, the amax of its block (float64), computed with the test's own reshapes."""
    rows, cols = x2d.shape
    padded = torch.nn.functional.pad(x2d.abs(), (0, -cols % BLOCK, 0, -rows % BLOCK))
    if use == "rowwise":
        amax = padded.view(padded.shape[0], -1, BLOCK).amax(2, keepdim=True).expand(-1, -1, BLOCK)
    else:
        amax = padded.view(-1, BLOCK, padded.shape[1]).amax(1, keepdim=True).expand(-1, BLOCK, -1)
    return amax.reshape(padded.shape)[:rows, :cols]


@given(
    rows=st.integers(1, 80),
    cols=st.integers(1, 80),
    lead=st.sampled_from([(), (2,)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fp8_dtype=st.sampled_from(FP8_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_error_is_within_half_ulp(rows, cols, lead, dtype, fp8_dtype, seed):
    shape = (*lead, rows, cols)
    x = spread_values(shape, dtype, seed, max_exp=20)
    q = lowp_ops.mxfp8_quantize(x, fp8_dtype)
    spec = FP8_SPEC[fp8_dtype]
    x2d = x.double().reshape(-1, cols)
    for use in ("rowwise", "columnwise"):
        deq = lowp_ops.mxfp8_dequantize(q, torch.float32, use=use)
        assert deq.shape == x.shape and deq.dtype == torch.float32
        err = (deq.double().reshape(-1, cols) - x2d).abs()
        # Normal range: RNE to m mantissa bits, |err| <= 2^-(m+1) |x|. Subnormal range: half the
        # smallest subnormal times the block scale, and the scale is < 2 * amax / max_norm.
        relative = 2.0 ** -(spec["mantissa_bits"] + 1) * x2d.abs()
        absolute = 2.0 ** spec["min_subnormal_exp"] * block_amax(x2d, use) / spec["max"]
        bound = torch.maximum(relative, absolute)
        assert (err <= bound).all(), f"{use}: worst excess {(err - bound).max().item()}"
        # An FP8 value times a power of two is exact in the input dtype, so dequantizing to it is exact.
        deq_in_dtype = lowp_ops.mxfp8_dequantize(q, dtype, use=use)
        assert deq_in_dtype.dtype == dtype
        assert torch.equal(deq_in_dtype.float(), deq)


# ---------------------------------------------------------------------------------------- NaN and Inf


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_nan_encodes_alone_and_its_block_keeps_the_scale_of_its_finite_elements(fp8_dtype):
    x = spread_values((64, 96), torch.float32, seed=5, max_exp=4)
    x[3, 40] = math.nan  # row-wise block (3, 1); column-wise block (0, 40)
    x[50, 7] = -math.nan  # a negative NaN: row-wise block (50, 0); column-wise block (1, 7)
    q = lowp_ops.mxfp8_quantize(x, fp8_dtype)
    row_bytes, col_bytes = as_bytes(q.row_data), as_bytes(q.col_data)
    assert row_bytes[3, 40] == col_bytes[3, 40] == row_bytes[50, 7] == col_bytes[50, 7] == 0x7F
    finite_row = [float(v) for v in x[3, 32:64] if not math.isnan(v)]
    finite_col = [float(v) for v in x[0:32, 40] if not math.isnan(v)]
    assert q.row_scale[3, 1].item() == exact_e8m0(max(abs(v) for v in finite_row), fp8_dtype) < 255
    assert q.col_scale[0, 40].item() == exact_e8m0(max(abs(v) for v in finite_col), fp8_dtype) < 255
    assert_matches_oracle(x, q, fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_nan_changes_only_its_own_byte(fp8_dtype, dtype):
    """Quantizing with NaNs equals quantizing with those elements zeroed (zeros never raise an amax),
    except that the NaN elements' bytes are 0x7F: the oracle-free form of TE's fmaxf amax."""
    x = spread_values((70, 97), dtype, seed=8, max_exp=20)
    gen = torch.Generator().manual_seed(9)
    is_nan = torch.rand(x.shape, generator=gen) < 0.05
    is_nan[0:32, 0:32] = True  # an all-NaN block in both copies
    with_nan = lowp_ops.mxfp8_quantize(x.masked_fill(is_nan, math.nan), fp8_dtype)
    with_zero = lowp_ops.mxfp8_quantize(x.masked_fill(is_nan, 0.0), fp8_dtype)
    assert torch.equal(with_nan.row_scale, with_zero.row_scale)
    assert torch.equal(with_nan.col_scale, with_zero.col_scale)
    assert (with_nan.row_scale[0:32, 0] == 0).all() and (with_nan.col_scale[0, 0:32] == 0).all()
    for name in ("row_data", "col_data"):
        nan_bytes, zero_bytes = as_bytes(getattr(with_nan, name)), as_bytes(getattr(with_zero, name))
        assert (nan_bytes[is_nan] == 0x7F).all(), name
        assert torch.equal(nan_bytes[~is_nan], zero_bytes[~is_nan]), name


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_nan_dequantizes_to_nan_and_its_neighbours_to_their_values(fp8_dtype):
    x = torch.linspace(-3.0, 3.0, 64).view(2, 32)
    x[0, 5] = math.nan
    q = lowp_ops.mxfp8_quantize(x, fp8_dtype)
    for use in ("rowwise", "columnwise"):
        deq = lowp_ops.mxfp8_dequantize(q, torch.float32, use=use)
        assert torch.isnan(deq).nonzero().tolist() == [[0, 5]], use
        finite = ~torch.isnan(x)
        assert torch.allclose(deq[finite], x[finite], rtol=2.0 ** -FP8_SPEC[fp8_dtype]["mantissa_bits"]), use


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_scale_code_255_dequantizes_to_nan(fp8_dtype):
    q = lowp_ops.mxfp8_quantize(torch.ones(4, 64), fp8_dtype, columnwise=False)
    q.row_scale[1, 1] = 255
    deq = lowp_ops.mxfp8_dequantize(q, torch.float32)
    assert torch.isnan(deq[1, 32:64]).all()
    assert torch.equal(torch.isnan(deq).sum(), torch.tensor(32))


@pytest.mark.parametrize(("fp8_dtype", "pos_max", "neg_max"), [("e4m3", 0x7E, 0xFE), ("e5m2", 0x7B, 0xFB)])
def test_inf_saturates_to_max_in_a_block_with_code_254(fp8_dtype, pos_max, neg_max):
    x = spread_values((64, 96), torch.bfloat16, seed=6, max_exp=4)
    x[40, 5] = math.inf  # row-wise block (40, 0); column-wise block (1, 5)
    x[10, 70] = -math.inf  # row-wise block (10, 2); column-wise block (0, 70)
    q = lowp_ops.mxfp8_quantize(x, fp8_dtype)
    row_bytes, col_bytes = as_bytes(q.row_data), as_bytes(q.col_data)
    assert q.row_scale[40, 0].item() == 254 and q.row_scale[10, 2].item() == 254
    assert q.col_scale[1, 5].item() == 254 and q.col_scale[0, 70].item() == 254
    assert row_bytes[40, 5].item() == pos_max and col_bytes[40, 5].item() == pos_max
    assert row_bytes[10, 70].item() == neg_max and col_bytes[10, 70].item() == neg_max
    # The finite neighbours are scaled by 2^-127: they become (signed) zeros.
    neighbours = torch.cat([row_bytes[40, 6:32], col_bytes[41:64, 5]])
    assert ((neighbours & 0x7F) == 0).all()


@pytest.mark.parametrize(("fp8_dtype", "max_byte"), [("e4m3", 0x7E), ("e5m2", 0x7B)])
def test_inf_sets_the_scale_of_a_block_that_also_holds_nan(fp8_dtype, max_byte):
    x = torch.ones(1, 32)
    x[0, 3], x[0, 9] = math.inf, math.nan
    q = lowp_ops.mxfp8_quantize(x, fp8_dtype)
    assert q.row_scale[0, 0].item() == 254
    row = as_bytes(q.row_data)[0]
    assert row[3] == max_byte and row[9] == 0x7F
    assert (row[[i for i in range(32) if i not in (3, 9)]] == 0).all()  # 1 * 2^-127 rounds to +0
    assert_matches_oracle(x, q, fp8_dtype)


def assert_matches_oracle(x, q, fp8_dtype):
    row_data, row_scale, col_data, col_scale = oracle_quantize(x, fp8_dtype)
    assert torch.equal(q.row_scale, row_scale)
    assert torch.equal(q.col_scale, col_scale)
    assert torch.equal(as_bytes(q.row_data), row_data)
    assert torch.equal(as_bytes(q.col_data), col_data)


# ----------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"x": torch.ones(4, 32, dtype=torch.int32)},
            "x must be float32, bfloat16 or float16, got torch.int32",
        ),
        ({"x": torch.tensor(1.0)}, "x must have at least one dimension"),
        ({"fp8_dtype": "e3m4"}, "fp8_dtype must be one of .*got 'e3m4'"),
        ({"scale_layout": "weird"}, "scale_layout must be one of .*got 'weird'"),
        ({"rowwise": False, "columnwise": False}, "at least one of rowwise and columnwise"),
    ],
)
def test_quantize_rejects_bad_arguments_naming_them(kwargs, match):
    args = {"x": torch.ones(4, 32)} | kwargs
    with pytest.raises(ARG_ERRORS, match=match):
        lowp_ops.mxfp8_quantize(**args)


@pytest.mark.parametrize(("name", "value"), [("rowwise", "no"), ("columnwise", 0)])
def test_quantize_rejects_flags_that_are_not_bools(name, value):
    """A truthy string would otherwise write the copy it seems to turn off."""
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        lowp_ops.mxfp8_quantize(torch.ones(4, 32), **{name: value})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": torch.ones(4, 32, dtype=torch.int64)}, "x must be float32"),
        ({"x": torch.tensor(1.0)}, "x must have at least one dimension"),
        ({"fp8_dtype": "e3m4"}, "fp8_dtype"),
        ({"scale_layout": "weird"}, "scale_layout"),
        ({"rowwise": False, "columnwise": False}, "rowwise and columnwise"),
    ],
)
def test_quantize_op_rejects_bad_arguments_naming_them(kwargs, match):
    args = {
        "x": torch.ones(4, 32),
        "fp8_dtype": "e4m3",
        "rowwise": True,
        "columnwise": True,
        "scale_layout": "compact",
    } | kwargs
    with pytest.raises(ARG_ERRORS, match=match):
        torch.ops.lowp.mxfp8_quantize(**args)


def test_dequantize_rejects_unknown_use():
    q = lowp_ops.mxfp8_quantize(torch.ones(4, 32))
    with pytest.raises(ValueError, match="use must be 'rowwise' or 'columnwise', got 'diagonal'"):
        lowp_ops.mxfp8_dequantize(q, use="diagonal")


@pytest.mark.parametrize(("kept", "missing"), [("rowwise", "columnwise"), ("columnwise", "rowwise")])
def test_dequantize_rejects_a_missing_copy(kept, missing):
    q = lowp_ops.mxfp8_quantize(torch.ones(4, 32), rowwise=kept == "rowwise", columnwise=kept == "columnwise")
    with pytest.raises(ValueError, match=f"use='{missing}' but q holds no {missing} copy"):
        lowp_ops.mxfp8_dequantize(q, use=missing)


def test_dequantize_rejects_a_non_mxfp8_argument():
    with pytest.raises(TypeError, match="q must be an MXFP8Tensor, got Tensor"):
        lowp_ops.mxfp8_dequantize(torch.ones(4, 32))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"use": "diagonal"}, "use must be one of .*got 'diagonal'"),
        ({"fp8_dtype": "e3m4"}, "fp8_dtype must be one of .*got 'e3m4'"),
        ({"scale_layout": "weird"}, "scale_layout must be one of .*got 'weird'"),
        ({"dtype": torch.int32}, "dtype must be float32, bfloat16 or float16, got torch.int32"),
        ({"data": torch.zeros(4, 32)}, "data must be uint8 FP8 bit patterns, got torch.float32"),
        ({"scale": torch.zeros(4, 128, dtype=torch.uint8)}, r"scale must have shape \(128, 4\)"),
        ({"scale": torch.zeros(128, 4, dtype=torch.int32)}, "scale must be uint8"),
    ],
)
def test_dequantize_op_rejects_bad_arguments_naming_them(overrides, match):
    q = lowp_ops.mxfp8_quantize(torch.ones(4, 32))
    args = {
        "data": as_bytes(q.row_data),
        "scale": q.row_scale,
        "fp8_dtype": "e4m3",
        "use": "rowwise",
        "scale_layout": "compact",
        "dtype": torch.float32,
    } | overrides
    with pytest.raises(ARG_ERRORS, match=match):
        torch.ops.lowp.mxfp8_dequantize(**args)


# ------------------------------------------------------------------------------------------- opcheck


def opcheck_input(dtype: torch.dtype, permuted: bool) -> torch.Tensor:
    x = spread_values((45, 70), dtype, seed=13, max_exp=8)
    return x.t().contiguous().t() if permuted else x


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("scale_layout", ["compact", "swizzled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("copies", [(True, True), (True, False), (False, True)], ids=["both", "row", "col"])
def test_opcheck_quantize(dtype, scale_layout, permuted, copies):
    x = opcheck_input(dtype, permuted)
    assert x.is_contiguous() != permuted
    torch.library.opcheck(torch.ops.lowp.mxfp8_quantize.default, (x, "e4m3", *copies, scale_layout))


@pytest.mark.parametrize("scale_layout", ["compact", "swizzled"])
@pytest.mark.parametrize("use", ["rowwise", "columnwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_dequantize(dtype, use, scale_layout):
    q = lowp_ops.mxfp8_quantize(opcheck_input(torch.float32, False), "e5m2", scale_layout=scale_layout)
    data, scale = (q.row_data, q.row_scale) if use == "rowwise" else (q.col_data, q.col_scale)
    data = as_bytes(data).t().contiguous().t()  # permuted layout
    torch.library.opcheck(
        torch.ops.lowp.mxfp8_dequantize.default, (data, scale, "e5m2", use, scale_layout, dtype)
    )


# ------------------------------------------------------------------------------------- torch.compile


def quantize_round_trip(x: torch.Tensor):
    q = lowp_ops.mxfp8_quantize(x, "e4m3", scale_layout="swizzled")
    row = lowp_ops.mxfp8_dequantize(q, torch.float32, use="rowwise")
    col = lowp_ops.mxfp8_dequantize(q, torch.float32, use="columnwise")
    return row, col, q.row_scale, q.col_scale


def assert_compiles_once_without_breaks(backend: str):
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(quantize_round_trip, backend=counter, fullgraph=True, dynamic=True)
    shapes = [(40, 70), (65, 33), (3, 130)]
    for index, shape in enumerate(shapes):
        x = spread_values(shape, torch.bfloat16, seed=index, max_exp=10)
        if index == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(x)
        finally:
            torch.compiler.set_stance("default")
        for g, e in zip(got, quantize_round_trip(x), strict=True):
            assert torch.equal(g, e)
    assert counter.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_compile_aot_eager_one_graph_no_recompiles():
    assert_compiles_once_without_breaks("aot_eager")


@pytest.mark.slow
def test_compile_inductor_one_graph_no_recompiles():
    assert_compiles_once_without_breaks("inductor")


# ---------------------------------------------------------------------------------------- data layout


@pytest.mark.parametrize("shape", [(5, 50), (3, 4, 33), (40, 64), (2, 17), (50,)], ids=str)
def test_data_rows_are_padded_to_16_bytes_and_hold_the_contiguous_bytes(shape):
    """Rows of MXFP8 data are ``ceil(cols / 16) * 16`` bytes apart (an FP8 GEMM's leading dimension),
    from the quantizer and the fused cross-entropy backward alike; the last row's padding is allocated;
    the values are those of unpadded data (the copy ``.contiguous()`` makes)."""
    x = spread_values(shape, torch.bfloat16, seed=1, max_exp=10)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    pitch = -(-cols // 16) * 16
    q = lowp_ops.mxfp8_quantize(x)
    target = torch.randint(0, cols, (rows,))
    _, grad = lowp_ops.cross_entropy_with_mxfp8_grad(x.reshape(rows, cols), target)
    for data in (q.row_data, q.col_data, grad.row_data, grad.col_data):
        assert data.stride(-1) == 1
        if rows > 1:  # one row (1-D x) needs no padding
            assert data.stride(-2) == pitch and data.untyped_storage().nbytes() >= rows * pitch
    for use in ("rowwise", "columnwise"):
        data = q.row_data if use == "rowwise" else q.col_data
        compact = dataclasses.replace(
            q, **{"row_data" if use == "rowwise" else "col_data": data.contiguous()}
        )
        assert torch.equal(
            lowp_ops.mxfp8_dequantize(q, torch.float32, use=use),
            lowp_ops.mxfp8_dequantize(compact, torch.float32, use=use),
        )


# --------------------------------------------------------------------------------------- empty input


@pytest.mark.parametrize(
    ("shape", "row_scale_shape", "col_scale_shape"),
    [((0, 32), (0, 4), (0, 128)), ((4, 0), (128, 0), (4, 0)), ((2, 0, 5), (0, 4), (0, 128))],
    ids=str,
)
def test_empty_input_gives_empty_data_and_zero_scales(shape, row_scale_shape, col_scale_shape):
    q = lowp_ops.mxfp8_quantize(torch.ones(shape))
    assert q.row_data.shape == q.col_data.shape == shape
    assert tuple(q.row_scale.shape) == row_scale_shape and tuple(q.col_scale.shape) == col_scale_shape
    assert not q.row_scale.any() and not q.col_scale.any()
    for use in ("rowwise", "columnwise"):
        assert lowp_ops.mxfp8_dequantize(q, torch.float32, use=use).shape == shape


# ------------------------------------------------------------------- argument normalizers, container


@pytest.mark.parametrize(
    ("value", "expected"),
    [("e4m3", "e4m3"), ("e5m2", "e5m2"), (torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")],
    ids=str,
)
def test_normalize_fp8_dtype_accepts_names_and_torch_dtypes(value, expected):
    assert normalize_fp8_dtype(value) == expected


@pytest.mark.parametrize(
    "value", ["e3m4", "E4M3", torch.float16, torch.float8_e4m3fnuz, ["e4m3"], None], ids=str
)
def test_normalize_fp8_dtype_rejects_anything_else_naming_the_argument(value):
    with pytest.raises(ValueError, match=r"b_fp8_dtype must be one of \['e4m3', 'e5m2'\].*got"):
        normalize_fp8_dtype(value, "b_fp8_dtype")


def test_check_fp8_dtype_wants_the_name_the_ops_take():
    check_fp8_dtype("e5m2")
    with pytest.raises(
        ValueError, match=r"fp8_dtype must be the format name .e4m3. here, got torch\.float8_e4m3fn"
    ):
        check_fp8_dtype(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a_fp8_dtype must be one of"):
        check_fp8_dtype("e3m4", "a_fp8_dtype")


@pytest.mark.parametrize("dtype", ["bf16", torch.int32, torch.float8_e4m3fn, None], ids=str)
def test_dequantize_dtype_check_names_dtype_before_any_op_runs(dtype, monkeypatch):
    q = lowp_ops.mxfp8_quantize(torch.ones(4, 32))

    def must_not_run(*args):
        raise AssertionError("the op ran")

    monkeypatch.setattr(lowp_ops.library, "mxfp8_dequantize", must_not_run)
    with pytest.raises((TypeError, ValueError), match="dtype must be"):
        check_float_dtype(dtype)
    with pytest.raises((TypeError, ValueError), match="dtype must be"):
        lowp_ops.mxfp8_dequantize(q, dtype)


def test_repr_shows_shapes_and_dtypes_not_values():
    q = lowp_ops.mxfp8_quantize(torch.randn(300, 70), "e5m2", columnwise=False, scale_layout="swizzled")
    assert repr(q) == (
        "MXFP8Tensor(shape=(300, 70), fp8_dtype='e5m2', scale_layout='swizzled', "
        "row_data=float8_e5m2[300, 70], row_scale=uint8[384, 4], col_data=None, col_scale=None)"
    )


@pytest.mark.parametrize("wrong", ["row_data", "col_data"])
def test_container_whose_fp8_dtype_disagrees_with_its_data_raises_at_construction(wrong):
    q = lowp_ops.mxfp8_quantize(torch.randn(40, 70), "e4m3")
    fields = {name: getattr(q, name) for name in ("row_data", "row_scale", "col_data", "col_scale")}
    fields[wrong] = fields[wrong].view(torch.uint8).view(torch.float8_e5m2)
    with pytest.raises(ValueError, match=f"{wrong} has dtype torch.float8_e5m2 but fp8_dtype is 'e4m3'"):
        lowp_ops.MXFP8Tensor(**fields, fp8_dtype="e4m3", scale_layout="compact", shape=q.shape)
    fields[wrong] = fields[wrong].view(torch.uint8)  # raw bit patterns are not FP8 data either
    with pytest.raises(ValueError, match=f"{wrong} has dtype torch.uint8"):
        lowp_ops.MXFP8Tensor(**fields, fp8_dtype="e4m3", scale_layout="compact", shape=q.shape)


def test_container_checks_its_other_fields():
    q = lowp_ops.mxfp8_quantize(torch.randn(40, 70), "e5m2")
    fields = dict(row_data=q.row_data, row_scale=q.row_scale, col_data=q.col_data, col_scale=q.col_scale)
    same = lowp_ops.MXFP8Tensor(**fields, fp8_dtype=torch.float8_e5m2, scale_layout="compact", shape=q.shape)
    assert same.fp8_dtype == "e5m2"  # a torch dtype is stored as its name
    bad = {
        "fp8_dtype must be one of": dict(fp8_dtype="e3m4"),
        "scale_layout must be one of": dict(scale_layout="tiled"),
        "col_data and col_scale must both be given or both be None": dict(col_scale=None),
        "row_scale must hold uint8 E8M0 codes": dict(row_scale=q.row_scale.float()),
    }
    for match, override in bad.items():
        kwargs = {**fields, "fp8_dtype": "e5m2", "scale_layout": "compact", "shape": q.shape} | override
        with pytest.raises(ValueError, match=match):
            lowp_ops.MXFP8Tensor(**kwargs)


def test_op_outputs_container_is_built_by_the_constructor_under_dynamo(monkeypatch):
    """Eagerly the op's outputs skip the field checks; under Dynamo the dataclass constructor builds the
    container (torch 2.11's Dynamo, the GPU image's, breaks the graph on the unchecked path's instance
    dict update; torch 2.13's traces both, so the branch itself is what is tested here)."""
    q = lowp_ops.mxfp8_quantize(torch.randn(40, 70), "e5m2")
    fields = (q.row_data, q.row_scale, q.col_data, None, "e5m2", "compact", q.shape)  # col_scale missing
    assert lowp_ops.MXFP8Tensor.of_op_outputs(*fields).col_scale is None  # eager: not checked
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="col_data and col_scale must both be given"):
        lowp_ops.MXFP8Tensor.of_op_outputs(*fields)


def test_compiled_function_returns_the_container_without_recompiles():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda x: lowp_ops.mxfp8_quantize(x, torch.float8_e5m2), backend=counter, fullgraph=True, dynamic=True
    )
    for index, shape in enumerate([(40, 70), (65, 33), (3, 130)]):
        x = spread_values(shape, torch.bfloat16, seed=index, max_exp=10)
        if index == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(x)
        finally:
            torch.compiler.set_stance("default")
        want = lowp_ops.mxfp8_quantize(x, "e5m2")
        assert isinstance(got, lowp_ops.MXFP8Tensor) and got.fp8_dtype == "e5m2"
        assert repr(got) == repr(want)
        assert torch.equal(as_bytes(got.col_data), as_bytes(want.col_data))
    assert counter.frame_count == 1


# ------------------------------------------------------------------ CUDA graphs (one process per test)


@pytest.mark.cudagraph
def test_reduce_overhead_mxfp8_quantize_and_mxfp8_grad_never_skip_cudagraphs():
    def quantize(x):
        return lowp_ops.mxfp8_quantize(x, "e4m3", True, True, "swizzled")

    def loss_and_payload(logits, target, grad_loss):
        # reduction="sum": the per-row gradient is grad_loss itself, so the payload bytes must match eager.
        return lowp_ops.cross_entropy_with_mxfp8_grad(
            logits, target, grad_loss, label_smoothing=0.1, reduction="sum", fp8_dtype="e5m2"
        )

    counters.clear()
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        compiled_quantize = torch.compile(quantize, mode="reduce-overhead", fullgraph=True)
        compiled_ce = torch.compile(loss_and_payload, mode="reduce-overhead", fullgraph=True)
        for seed in range(3):
            logits, target = ce_inputs(seed)
            grad_loss = torch.rand((), device="cuda") + 0.5
            torch.compiler.cudagraph_mark_step_begin()
            payload = compiled_quantize(logits)
            got_q = [getattr(payload, field).view(torch.uint8).clone() for field in PAYLOAD_FIELDS]
            torch.compiler.cudagraph_mark_step_begin()
            loss, ce_payload = compiled_ce(logits, target, grad_loss)
            loss = loss.clone()
            got_ce = [getattr(ce_payload, field).view(torch.uint8).clone() for field in PAYLOAD_FIELDS]

            want_q = quantize(logits)
            want_loss, want_ce = loss_and_payload(logits, target, grad_loss)
            for field, got, want_data in zip(
                PAYLOAD_FIELDS, got_q, [getattr(want_q, f) for f in PAYLOAD_FIELDS], strict=True
            ):
                assert torch.equal(got, want_data.view(torch.uint8)), (
                    f"quantize {field} differs at step {seed}"
                )
            for field, got, want_data in zip(
                PAYLOAD_FIELDS, got_ce, [getattr(want_ce, f) for f in PAYLOAD_FIELDS], strict=True
            ):
                assert torch.equal(got, want_data.view(torch.uint8)), (
                    f"mxfp8 grad {field} differs at step {seed}"
                )
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    assert counters["inductor"]["cudagraph_skips"] == 0


# ---------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("fp8_dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_idempotent_and_within_half_an_fp8_step(fp8_dtype, dtype):
    """Values already on a block's MXFP8 grid come back unchanged (same amax, same scale), and one trip
    moves each finite value by at most half a step of its block's grid: 2^(e - 127) * ulp_fp8 / 2."""
    gen = torch.Generator().manual_seed(7)
    magnitudes = torch.exp2(torch.randint(-20, 20, (97,), generator=gen).float())
    x = (torch.randn(70, 97, generator=gen) * magnitudes).to(dtype)
    row, col = torch.ops.lowp.mxfp8_round_trip(x, fp8_dtype, True, True)
    assert row.dtype == dtype and row.shape == x.shape and col.shape == x.shape
    assert torch.equal(torch.ops.lowp.mxfp8_round_trip(row, fp8_dtype, True, False)[0], row)
    assert torch.equal(torch.ops.lowp.mxfp8_round_trip(col, fp8_dtype, False, True)[1], col)
    mantissa_bits = 3 if fp8_dtype == "e4m3" else 2
    for values, original in ((row.float(), x.float()), (col.float().t(), x.float().t())):
        blocks = torch.nn.functional.pad(original.abs(), (0, -original.shape[1] % 32))
        amax = blocks.view(original.shape[0], -1, 32).amax(dim=2).clamp_min(2**-120)
        step = torch.exp2(torch.floor(torch.log2(amax)) - mantissa_bits)
        bound = step.repeat_interleave(32, dim=1)[:, : original.shape[1]] / 2
        assert ((values - original).abs() <= bound).all()


@pytest.mark.parametrize(
    "ends", [[20, 65, 65, 90], [32, 64], [0, 0], [90], [], [70, 10, 120], [-5, 33], [40, 101, 80]], ids=str
)
def test_grouped_round_trip_blocks_each_group_as_its_own_tensor(ends):
    """With ``group_ends`` the column-wise copy of each group of rows (the effective ends of every grouped
    op: an end outside [0, rows] is the last valid end before it; then the rows past the last end) is
    that group's own column-wise round trip, bit for bit; the row-wise copy does not change. Groups 2^20
    apart in magnitude: a 32-row block shared by two groups flushes the smaller one's values (checked
    against the ungrouped copy)."""
    rows = 100
    gen = torch.Generator().manual_seed(len(ends))
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    effective = [0]
    for end in ends:
        effective.append(max(end, effective[-1]) if 0 <= end <= rows else effective[-1])
    effective.append(rows)
    groups = [(start, stop) for start, stop in itertools.pairwise(effective) if stop > start]
    for group, (start, stop) in enumerate(groups):
        x[start:stop] *= 2.0 ** (20 * (group % 2))
    group_ends = torch.tensor(ends, dtype=torch.int32)
    if effective[1:-1] == ends:
        row, col = torch.ops.lowp.mxfp8_round_trip(x, "e4m3", True, True, group_ends)
    else:  # malformed: a CPU call raises, unless the host checks are off (as on CUDA)
        with pytest.raises(ValueError, match="group_ends must be non-decreasing group ends in"):
            torch.ops.lowp.mxfp8_round_trip(x, "e4m3", True, True, group_ends)
        previous = set_split_size_checks("off")
        try:
            row, col = torch.ops.lowp.mxfp8_round_trip(x, "e4m3", True, True, group_ends)
        finally:
            set_split_size_checks(previous)
    assert torch.equal(row, torch.ops.lowp.mxfp8_round_trip(x, "e4m3", True, False)[0])
    for start, stop in groups:
        own = torch.ops.lowp.mxfp8_round_trip(x[start:stop], "e4m3", False, True)[1]
        assert torch.equal(col[start:stop].view(torch.int16), own.view(torch.int16)), (start, stop)
    shared_blocks = any(start % 32 for start, _ in groups)
    ungrouped = torch.ops.lowp.mxfp8_round_trip(x, "e4m3", False, True)[1]
    assert torch.equal(col, ungrouped) != shared_blocks


def test_round_trip_op_checks_its_arguments_and_passes_opcheck():
    x = torch.randn(40, 70)
    with pytest.raises(ValueError, match="at least one of rowwise and columnwise"):
        torch.ops.lowp.mxfp8_round_trip(x, "e4m3", False, False)
    with pytest.raises(ValueError, match="fp8_dtype"):
        torch.ops.lowp.mxfp8_round_trip(x, "e3m4", True, False)
    row, col = torch.ops.lowp.mxfp8_round_trip(x, "e4m3", True, False)
    assert row.shape == x.shape and col.numel() == 0
    torch.library.opcheck(torch.ops.lowp.mxfp8_round_trip.default, (x.bfloat16(), "e5m2", True, True))
    ends = torch.tensor([7, 33], dtype=torch.int32)
    torch.library.opcheck(torch.ops.lowp.mxfp8_round_trip.default, (x, "e4m3", True, True, ends))
    for wrong in (ends.long(), ends.view(1, 2)):
        with pytest.raises(ValueError, match="group_ends must be"):
            torch.ops.lowp.mxfp8_round_trip(x, "e4m3", False, True, wrong)
