"""NVFP4 quantization with round-to-nearest, as TransformerEngine's pure-PyTorch reference
(te_grouped_mlp_nvfp4.md §3-4, §8).

For an operand ``t`` (rows, cols) quantized in 1x16 blocks along ``cols`` (or 16x16 tiles for 2-D
weights), with ``amax`` its fp32 global amax (computed, or given and used as is):

1. ``S_enc = min(2688 / amax, FLT_MAX)`` in fp32, 1 where ``amax == 0`` (the CUDA kernels' rule) or
   where it underflows to 0 (``amax = inf``); ``S_dec = 1 / S_enc``;
2. block scale ``s_b = e4m3_rn(min(vec_max * (S_enc * fp32(1/6)), 448))`` (vec_max = block max |t|);
3. ``enc = min(1 / (fp32(s_b) * S_dec), FLT_MAX)``; data ``q = e2m1_rn(clamp(t * enc, -6, 6))``: ties to
   even, a negative value that rounds to zero is -0 (code 8), an exact -0.0 input is +0 (code 0);
4. dequantized ``e2m1(q) * (fp32(s_b) * amax * fp32(1/2688))``.

The column-wise copy is the row-wise quantization of ``x^T`` (or of ``RHT(x^T)``: 16-point Hadamard
with TE's sign vector, a bf16 matmul with fp32 accumulation rounded to bf16), stored transposed.
NaN input gives a NaN amax and NaN scales; its data encode as +0.
"""

from __future__ import annotations

import torch

from ..formats import F4E2M1_MAX, F8E4M3_MAX, NVFP4_BLOCK_SIZE, NVFP4_GLOBAL_SCALE_NUMERATOR, RHT_SIGN_MASK
from ..meta.mxfp8 import flat_2d_dims
from ..meta.nvfp4 import nvfp4_dequantize_output, nvfp4_quantize_outputs

_BLOCK = NVFP4_BLOCK_SIZE
FLT_MAX = torch.finfo(torch.float32).max
# RNE bins of |v| on the E2M1 grid: code k covers (threshold k-1, threshold k]; ties go to the even code.
_E2M1_UPPER_EXCLUSIVE = (0.25, 1.25, 2.5, 5.0)  # |v| above these (strictly) moves up one code
_E2M1_UPPER_INCLUSIVE = (0.75, 1.75, 3.5)  # |v| at or above these moves up one code


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) of fp32 values already clamped to [-6, 6], round-to-nearest-even."""
    magnitude = values.abs()
    code = torch.zeros_like(values, dtype=torch.uint8)
    for threshold in _E2M1_UPPER_EXCLUSIVE:
        code += magnitude > threshold
    for threshold in _E2M1_UPPER_INCLUSIVE:
        code += magnitude >= threshold
    return code + (values < 0).to(torch.uint8) * 8


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 E2M1 codes (computed, not looked up: no host-to-device copy in a CUDA graph)."""
    exponent = ((codes >> 1) & 3).float()
    mantissa = (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1) * (1.0 + 0.5 * mantissa))
    return torch.where(codes >= 8, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) codes -> (R, C/2) bytes, element 2i in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/2) bytes -> (R, C) codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


def rht_matrix(dtype: torch.dtype = torch.bfloat16, device=None) -> torch.Tensor:
    """``diag(s) @ H16 / 4``: Sylvester Hadamard ``H[i, j] = (-1)^popcount(i & j)``, ``s_i = -1`` where bit
    i of 0xD7E8 is set. Entries are +-1/4 (exact in bf16); the matrix is orthogonal."""
    index = torch.arange(_BLOCK, device=device)
    parity = torch.zeros(_BLOCK, _BLOCK, dtype=torch.long, device=device)
    both = index[:, None] & index[None, :]
    for bit in range(4):
        parity += (both >> bit) & 1
    hadamard = 1.0 - 2.0 * (parity % 2).float()
    signs = 1.0 - 2.0 * ((RHT_SIGN_MASK >> index) & 1).float()
    return (signs[:, None] * hadamard * 0.25).to(dtype)


def apply_rht(t: torch.Tensor) -> torch.Tensor:
    """``t`` (R, C) bf16 with C % 16 == 0: every 16-vector along the last dim times the RHT matrix (bf16
    matmul, fp32 accumulation, one rounding to bf16)."""
    rows, cols = t.shape
    return (t.reshape(-1, _BLOCK) @ rht_matrix(t.dtype, t.device)).view(rows, cols)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``min(2688 / amax, FLT_MAX)``, 1 where amax is 0 or the quotient underflows to 0."""
    # A true fp32 division: `number / tensor` in PyTorch is reciprocal-then-multiply (two roundings).
    numerator = torch.full_like(amax, NVFP4_GLOBAL_SCALE_NUMERATOR, dtype=torch.float32)
    scale = torch.clamp(numerator / amax.float(), max=FLT_MAX)
    return torch.where((amax == 0) | (scale == 0), torch.ones_like(scale), scale)


def quantize_blocks(t: torch.Tensor, amax: torch.Tensor, block_2d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (R, C) uint8, E4M3 block scales (R, ceil(C/16)) as uint8) of ``t`` (R, C)."""
    rows, cols = t.shape
    pad_rows = -rows % _BLOCK if block_2d else 0
    x = torch.nn.functional.pad(t.float(), (0, -cols % _BLOCK, 0, pad_rows))
    blocks = x.view(x.shape[0], x.shape[1] // _BLOCK, _BLOCK)
    vec_max = blocks.abs().amax(dim=2)
    if block_2d:
        tiles = vec_max.view(-1, _BLOCK, vec_max.shape[1]).amax(dim=1, keepdim=True)
        vec_max = tiles.expand(-1, _BLOCK, -1).reshape(vec_max.shape)
    encode = global_encode_scale(amax)
    decode = 1.0 / encode
    block_scale = torch.clamp(vec_max * (encode * (1.0 / 6.0)), max=F8E4M3_MAX).to(torch.float8_e4m3fn)
    block_encode = torch.clamp(1.0 / (block_scale.float() * decode), max=FLT_MAX)
    scaled = torch.clamp(blocks * block_encode.unsqueeze(2), -F4E2M1_MAX, F4E2M1_MAX)
    codes = e2m1_codes(scaled).view(x.shape)[:rows, :cols]
    return codes, block_scale.view(torch.uint8)[:rows]


def _amax(t: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    if given is not None:
        return given.reshape(1).float()
    return t.abs().amax().float().reshape(1) if t.numel() else t.new_zeros((1,), dtype=torch.float32)


def nvfp4_quantize(
    x: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    block_2d: bool,
) -> tuple[torch.Tensor, ...]:
    """Reference of ``lowp::nvfp4_quantize``; outputs as ``meta.nvfp4.nvfp4_quantize_outputs``."""
    row_data, row_scale, col_data, col_scale, amax_row, amax_col = nvfp4_quantize_outputs(
        x, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d
    )
    rows, cols = flat_2d_dims(x.shape)
    x2d = x.reshape(rows, cols)
    col_input = x2d.t().contiguous()
    if rht and columnwise:
        col_input = apply_rht(col_input)
    amax_row.copy_(_amax(x2d, amax_rowwise))
    amax_col.copy_(_amax(col_input, amax_columnwise) if columnwise else amax_row)
    if rowwise:
        codes, scales = quantize_blocks(x2d, amax_row, block_2d)
        row_data.copy_(pack_fp4(codes))
        row_scale[:rows, : scales.shape[1]] = scales
    if columnwise:
        codes, scales = quantize_blocks(col_input, amax_col, block_2d)
        col_data.copy_(pack_fp4(codes))
        col_scale[:cols, : scales.shape[1]] = scales
    return row_data, row_scale, col_data, col_scale, amax_row, amax_col


def nvfp4_dequantize(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Reference of ``lowp::nvfp4_dequantize``: ``(R, 2 * data.shape[1])`` values in ``dtype``."""
    out = nvfp4_dequantize_output(data, scale, amax, dtype)
    rows, cols = out.shape
    block_scale = scale[:rows].view(torch.float8_e4m3fn).float()
    final_scale = block_scale * amax.float().reshape(1, 1) * (1.0 / NVFP4_GLOBAL_SCALE_NUMERATOR)
    values = e2m1_values(unpack_fp4(data)) * final_scale.repeat_interleave(_BLOCK, dim=1)[:, :cols]
    out.copy_(values)
    return out
