"""bf16 rounding: fp32 element pairs that share a thread, as inline PTX (GPU only), and a conversion
that rounds to nearest even on the GPU and in the interpreter alike.

Triton's own fp32 -> bf16 -> fp32 round trip costs one F2F per element on the quarter-rate conversion
pipe (which the exp also uses); ``cvt.rn.bf16x2.f32`` rounds two elements at once and two ALU ops widen
them back. The Triton interpreter cannot run inline PTX: callers keep a plain form for it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import INTERPRETING_CONSTEXPR as INTERPRETING


@triton.jit
def round_pairs_to_bf16(x):
    """fp32 ``x`` rounded to bf16 (RNE) and widened back to fp32, one packed conversion per two elements
    (``pack=2``: elements paired within a thread's registers). GPU only."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $3, $2; shl.b32 $0, p, 16; and.b32 $1, p, 0xffff0000; }",
        "=r,=r,r,r",
        [x],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def to_dtype_rne(x, DTYPE: tl.constexpr):
    """fp32 ``x`` converted to ``DTYPE`` with round-to-nearest-even, as on the GPU. The interpreter
    (triton 3.9) truncates fp32 -> bf16, so there bf16 is rounded on the bits (NaN kept NaN)."""
    if INTERPRETING and DTYPE == tl.bfloat16:  # noqa: SIM300 (DTYPE is a constexpr)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        rounded = tl.where(x != x, bits | 0x00400000, rounded) >> 16
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to bf16 (ties to even), returned as fp32."""
    return to_dtype_rne(x, tl.bfloat16).to(tl.float32)
