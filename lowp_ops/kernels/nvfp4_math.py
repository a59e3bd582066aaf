"""NVFP4 numerics as ``@triton.jit`` helpers (docs/nvfp4.md; semantics in ``lowp_ops.reference.nvfp4``):
bf16 rounding that matches the GPU in the interpreter, the 16-point RHT butterfly, the global and E4M3
block scales, and E2M1 encoding (round to nearest even, stochastic rounding from a counter hash), each
bit-exact with the reference. The tile and kernel code that uses them is in ``kernels.nvfp4``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import RHT_SIGN_MASK, SCALE_TILE_COLS, round_to_fp32
from .bf16_pairs import round_pairs_to_bf16, round_to_bf16
from .launch import INTERPRETING_CONSTEXPR as INTERPRETING

FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(round_to_fp32(1.0 / 6.0))
SIGN_MASK = tl.constexpr(RHT_SIGN_MASK)
SCALE_COLS_MULTIPLE = tl.constexpr(SCALE_TILE_COLS)
EXPONENT_MASK = tl.constexpr(0x7F800000)
# e2m1_magnitude_rn: the shifter is binade * (2^22 + 1).
SHIFTER_FACTOR = tl.constexpr(4194305.0)


@triton.jit
def maximum_keep_nan(a, b):
    """Elementwise max, NaN where either is NaN (``max.NaN``)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_keep_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_keep_nan(values, axis: tl.constexpr):
    """Max of ``values`` along ``axis``, NaN where the reduced slice holds a NaN (PTX ``max.NaN``)."""
    if INTERPRETING:
        # numpy's nanmax with the NaN put back: the interpreter runs a combine function element by element.
        is_nan = values != values
        result = tl.max(tl.where(is_nan, float("-inf"), values), axis)
        result = tl.where(tl.max(is_nan.to(tl.int32), axis) != 0, float("nan"), result).to(values.dtype)
    else:
        result = tl.reduce(values, axis, maximum_keep_nan)
    return result


@triton.jit
def round_to_bf16_packed(x):
    """``round_to_bf16`` of a tensor whose elements pair up within a thread: on the GPU one
    ``cvt.rn.bf16x2.f32`` per pair (half the conversions of one F2F per element)."""
    return round_to_bf16(x) if INTERPRETING else round_pairs_to_bf16(x)


@triton.jit
def hadamard_stage(v, A: tl.constexpr, B: tl.constexpr):
    """``v`` viewed as [A, 2, B] (the middle axis is one bit of the row index): ``(a + b, a - b)``."""
    pairs = tl.reshape(v, [A, 2, B])
    bit = tl.arange(0, 2)
    signs = (1 - 2 * (bit[:, None] & bit[None, :])).to(tl.float32)
    # Sum over the input bit of [A, 2 in, 2 out, B]: one fp32 addition per output, a +- b.
    out = tl.sum(tl.expand_dims(pairs, 2) * signs[None, :, :, None], axis=1)
    return tl.reshape(out, [A * 2 * B])


@triton.jit
def hadamard16_rows(x, R: tl.constexpr, BC: tl.constexpr):
    """The RHT of every 16-row block of the fp32 tile ``x`` [R, BC] along its rows, unrounded fp32:
    exact products ``x_i * s_i / 4``, then the butterfly over row bits 0..3 (the reference's order)."""
    row = tl.arange(0, R) % 16
    negate = (tl.full([R], SIGN_MASK, tl.int32) >> row) & 1
    signs = tl.where(negate == 1, -0.25, 0.25)
    # Row bit 0 with the sign products fused: x0 s0 +- x1 s1 as fma(x0, s0, +-(x1 s1)) (exact products).
    x0, x1 = tl.split(tl.permute(tl.reshape(x, [R // 2, 2, BC]), (0, 2, 1)))
    s0, s1 = tl.split(tl.reshape(signs, [R // 2, 2]))
    p1 = x1 * s1[:, None]
    pair = tl.join(tl.fma(x0, s0[:, None], p1), tl.fma(x0, s0[:, None], -p1))
    v = tl.reshape(tl.permute(pair, (0, 2, 1)), [R * BC])
    v = hadamard_stage(v, R // 4, 2 * BC)
    v = hadamard_stage(v, R // 8, 4 * BC)
    v = hadamard_stage(v, R // 16, 8 * BC)
    return tl.reshape(v, [R, BC])


@triton.jit
def global_encode_scale(amax):
    """``S_enc = min(2688 / amax, FLT_MAX)``, 1 where amax is 0 or the quotient is 0 (amax = inf)."""
    scale = _min_keep_nan(tl.math.div_rn(2688.0, amax), FLT_MAX)
    return tl.where((amax == 0) | (scale == 0), 1.0, scale)


@triton.jit
def e4m3_block_scale(vec_max, encode):
    """(fp32 value, uint8 code, fp32 unrounded scale) of ``e4m3_rn(min(vec_max * (S_enc * fp32(1/6)),
    448))``; NaN -> 0x7F. The unrounded scale is NaN exactly where the value (and so the block's encode
    factor) is NaN: callers take the per-block NaN mask from it, never from the fp8 scale (see
    ``quantize_rowwise_tile``)."""
    v = _min_keep_nan(vec_max * (encode * ONE_SIXTH), 448.0)
    if INTERPRETING:
        # Round to 3 mantissa bits (subnormal ulp 2^-9) in fp32; the cast then only sees exact values.
        exponent = (v.to(tl.int32, bitcast=True) >> 23) - 127
        shifter = ((tl.maximum(exponent - 3, -9) + 150) << 23).to(tl.float32, bitcast=True)
        value = (v + shifter) - shifter
        code = tl.where(v != v, 0x7F, value.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    else:
        fp8 = v.to(tl.float8e4nv)
        value = fp8.to(tl.float32)
        code = fp8.to(tl.uint8, bitcast=True)
    return value, code.to(tl.uint8), v


@triton.jit
def block_encode_factor(scale_value, decode):
    """``min(1 / (fp32(s_b) * S_dec), FLT_MAX)``."""
    return _min_keep_nan(tl.math.div_rn(1.0, scale_value * decode), FLT_MAX)


@triton.jit
def e2m1_magnitude_rn(v):
    """E2M1 code of ``|v|`` (fp32) in the low 8 bits of the int32 result, 0..7 (bits 8+ are junk):
    ties to even, saturating at 6. NaN gives 7: the callers zero the bytes of blocks whose encode factor
    is NaN, the only blocks holding a NaN (one saves a max(|v|, 0) per element)."""
    magnitude = tl.minimum(tl.abs(v), 6.0)
    # binade = 2^e, the power of two at or below max(|v|, 1) (e = 0, 1 or 2); step = 2^(e - 1).
    binade_bits = tl.maximum(magnitude, 1.0).to(tl.int32, bitcast=True) & EXPONENT_MASK
    binade = binade_bits.to(tl.float32, bitcast=True)
    # |v| + (2^22 + 1) 2^e (an exact product, one rounding) lands in the binade of 2^(e + 22), whose ulp is
    # the E2M1 step: the sum rounds |v| to the grid with ties to even (the shifter is 2^23 + 2 steps, an
    # even count), and its low bits are 2 + steps.
    steps_bits = tl.fma(binade, SHIFTER_FACTOR, magnitude).to(tl.int32, bitcast=True)
    # code = steps + 2e = (2 + steps) + (binade_bits >> 22) mod 256, as binade_bits >> 22 = 2e + 254.
    return steps_bits + (binade_bits >> 22)


@triton.jit
def hash32(v):
    """The reference's 32-bit mix (``reference.nvfp4.hash32``) on uint32 lanes."""
    v = v ^ (v >> 16)
    v = v * 0x7FEB352D
    v = v ^ (v >> 15)
    v = v * 0x846CA68B
    return v ^ (v >> 16)


@triton.jit
def sr_pair_bits(sr_ptr, STREAM: tl.constexpr, pair_index):
    """32 random bits per element pair (int64 ``pair_index`` = linear index >> 1), as
    ``reference.nvfp4.sr_random_bits``; ``sr_ptr`` holds int64 [seed, offset]."""
    seed = tl.load(sr_ptr).to(tl.uint32)
    offset = tl.load(sr_ptr + 1).to(tl.uint32)
    key = hash32(seed + (STREAM * 0x9E3779B9))
    return hash32((pair_index.to(tl.uint32) + offset) ^ key)


@triton.jit
def e2m1_magnitude_sr(v, random_bits):
    """E2M1 code (0..7) of ``|v|`` with stochastic rounding, as ``reference.nvfp4.e2m1_codes_stochastic``:
    up to the next grid value with probability (|v| - lower) / step, from 16 random bits (NaN: 0)."""
    magnitude = tl.minimum(tl.maximum(tl.abs(v), 0.0), 6.0)
    step_unit = tl.where(magnitude < 2.0, 2.0**-17, tl.where(magnitude < 4.0, 2.0**-16, 2.0**-15))
    shifted = magnitude + random_bits.to(tl.float32) * step_unit
    low = (shifted * 2.0).to(tl.int32)
    high = (shifted.to(tl.int32, bitcast=True) >> 22) - 252
    return tl.minimum(tl.where(shifted < 2.0, low, high), 7)


@triton.jit
def not_nan_mask(v):
    """int32 -1 where fp32 ``v`` is not NaN, 0 where it is (integer steps: no predicates to keep live)."""
    return ((v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) - 0x7F800001) >> 31


@triton.jit
def e2m1_bytes(low, high, low_bits, high_bits, STOCHASTIC: tl.constexpr):
    """int32 whose low 8 bits hold the E2M1 codes of fp32 ``low`` (bits 0-3) and ``high`` (bits 4-7), with
    round to nearest (ties to even) or stochastic rounding from 16 random bits each. A negative value
    keeps its sign bit even when it rounds to 0; -0.0 gives code 0 (the reference's ``v < 0``); NaN
    gives 0 with stochastic rounding, junk with round to nearest (see ``e2m1_magnitude_rn``)."""
    if STOCHASTIC:
        low_code = e2m1_magnitude_sr(low, low_bits)
        high_code = e2m1_magnitude_sr(high, high_bits)
    else:
        low_code = e2m1_magnitude_rn(low)
        high_code = e2m1_magnitude_rn(high)
    low_code = tl.where(low < 0, low_code | 8, low_code)
    # The high sign after the shift-add: one instruction for the add, one predicated or per sign.
    byte = low_code + (high_code << 4)
    byte = tl.where(high < 0, byte | 128, byte)
    return byte
