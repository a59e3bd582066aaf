"""NVFP4 quantization with round-to-nearest, as TransformerEngine's pure-PyTorch reference
(docs/nvfp4.md).

For an operand ``t`` (rows, cols) quantized in 1x16 blocks along ``cols`` (or 16x16 tiles for 2-D
weights), with ``amax`` its fp32 global amax (computed, or given and used as is):

1. ``S_enc = min(2688 / amax, FLT_MAX)`` in fp32, 1 where ``amax == 0`` (the CUDA kernels' rule) or
   where it underflows to 0 (``amax = inf``); ``S_dec = 1 / S_enc``;
2. block scale ``s_b = e4m3_rn(min(vec_max * (S_enc * fp32(1/6)), 448))`` (vec_max = block max |t|);
3. ``enc = min(1 / (fp32(s_b) * S_dec), FLT_MAX)``; data ``q = e2m1_rn(clamp(t * enc, -6, 6))``: ties to
   even, a negative value that rounds to zero is -0 (code 8), an exact -0.0 input is +0 (code 0);
4. dequantized ``e2m1(q) * (fp32(s_b) * amax * fp32(1/2688))``, in that order; an amax of 2^64 or more
   is divided by 2^64 first and the result multiplied back, so ``s_b * amax`` cannot overflow (a round
   trip up to fp32's max stays finite) and every result that was finite before is bit-identical.

The column-wise copy is the row-wise quantization of ``x^T`` (or of ``RHT(x^T)``: 16-point Hadamard
with TE's sign vector, a bf16 matmul with fp32 accumulation rounded to bf16), stored transposed.
NaN input gives a NaN amax and NaN scales (byte 0x7F); its data encode as +0.
"""

from __future__ import annotations

import torch

from ..formats import (
    F4E2M1_MAX,
    F8E4M3_MAX,
    NVFP4_BLOCK_SIZE,
    NVFP4_GLOBAL_SCALE_NUMERATOR,
    RHT_SIGN_MASK,
    SCALE_TILE_COLS,
    ceil_div,
)
from ..meta.mxfp8 import flat_2d_dims
from ..meta.nvfp4 import (
    check_quantize_args,
    group_split_multiple,
    nvfp4_dequantize_output,
    nvfp4_group_dequantize_output,
    nvfp4_group_quantize_outputs,
    nvfp4_quantize_outputs,
)
from ..meta.split_sizes import effective_split_sizes, expert_of_rows

_BLOCK = NVFP4_BLOCK_SIZE
FLT_MAX = torch.finfo(torch.float32).max
STAGED_AMAX_UNIT = 2.0**64  # amaxes at or above it are dequantized in units of it (staged_amax)
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


_U32 = 0xFFFFFFFF


def _mul_u32(v: torch.Tensor, constant: int) -> torch.Tensor:
    """``v * constant mod 2^32`` for int64 ``v`` in [0, 2^32), without int64 overflow."""
    low = v * (constant & 0xFFFF)
    high = ((v * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _U32


def hash32(v: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply, constants of C. Wellons' "lowbias32") on int64 tensors
    holding uint32 values. Also the Triton kernels' random-bit generator, so SR matches bit for bit."""
    v = v & _U32
    v = v ^ (v >> 16)
    v = _mul_u32(v, 0x7FEB352D)
    v = v ^ (v >> 15)
    v = _mul_u32(v, 0x846CA68B)
    return v ^ (v >> 16)


SR_STREAM_ROWWISE = 0
SR_STREAM_COLUMNWISE = 1


def sr_random_bits(sr_seed: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64) for the elements with linear ``index``: one 32-bit hash per element pair
    (one output byte), ``hash32(((index >> 1) + offset) ^ key)`` with ``key = hash32(seed + stream *
    0x9E3779B9)`` (mod 2^32, ``sr_seed = [seed, offset]``); the even element takes its low half, the odd
    one its high half. (TE's ``cvt.rs`` hardware spends 8 random bits per value.)"""
    seed, offset = sr_seed[0] & _U32, sr_seed[1] & _U32
    key = hash32(seed + stream * 0x9E3779B9)
    pair_bits = hash32((((index >> 1) + offset) & _U32) ^ key)
    return (pair_bits >> (16 * (index & 1))) & 0xFFFF


def e2m1_codes_stochastic(values: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of fp32 values in [-6, 6] rounded stochastically: |v| goes up to the next grid
    value with probability (|v| - lower) / step (to 2^-16), from 16 random bits ``r``:
    ``s = |v| + r * (step * 2^-16)`` (an exact product, one fp32 rounding), then ``s`` truncated onto the
    grid. Signs as in :func:`e2m1_codes`."""
    magnitude = values.abs()
    step_unit = torch.where(magnitude < 2, 2.0**-17, torch.where(magnitude < 4, 2.0**-16, 2.0**-15))
    shifted = magnitude + random_bits.float() * step_unit
    low = (shifted * 2).to(torch.int32)
    high = (shifted.view(torch.int32) >> 22) - 252
    code = torch.clamp(torch.where(shifted < 2, low, high), max=7)
    code = torch.where(values < 0, code + 8, code)
    return torch.where(torch.isnan(values), 0, code).to(torch.uint8)


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
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], 2 * packed.shape[1])


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


def rht_signs(device=None) -> torch.Tensor:
    """fp32 ``s_i / 4`` of the 16 inputs (``s_i = -1`` where bit i of 0xD7E8 is set)."""
    index = torch.arange(_BLOCK, device=device)
    return 0.25 - 0.5 * ((RHT_SIGN_MASK >> index) & 1).float()


def apply_rht(t: torch.Tensor) -> torch.Tensor:
    """``t`` (R, C) bf16 with C % 16 == 0: every 16-vector along the last dim times the RHT matrix, in
    fp32, rounded once to bf16.

    The 16 products ``t_i * s_i / 4`` are exact in fp32 (a bf16 times a power of two); their sum is
    not order-free (it is only when the 16 terms span at most 12 binades: 8 + 12 + 4 carry bits fit
    fp32's 24), so the order is fixed: the fast Walsh-Hadamard butterfly over index bits 0, 1, 2, 3,
    i.e. each output is the pairwise sum ((p0 +- p1) +- (p2 +- p3)) + ... in index order. The Triton
    kernels add in the same order, so reference and kernels agree bit for bit on every device; a bf16
    matmul (TE's reference) agrees whenever the sum is exact and can differ by one bf16 ulp otherwise.
    """
    rows, cols = t.shape
    values = t.float().reshape(-1, _BLOCK) * rht_signs(t.device)
    for bit in range(4):
        # Index bit `bit` is this axis of the (n, 2, ..., 2) view; replace it by the output bit.
        pairs = values.reshape(-1, 2 ** (3 - bit), 2, 2**bit)
        even, odd = pairs[:, :, 0], pairs[:, :, 1]
        values = torch.stack((even + odd, even - odd), dim=2)
    return values.reshape(rows, cols).to(t.dtype)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``min(2688 / amax, FLT_MAX)``, 1 where amax is 0 or the quotient underflows to 0."""
    # A true fp32 division: `number / tensor` in PyTorch is reciprocal-then-multiply (two roundings).
    numerator = torch.full_like(amax, NVFP4_GLOBAL_SCALE_NUMERATOR, dtype=torch.float32)
    scale = torch.clamp(numerator / amax.float(), max=FLT_MAX)
    return torch.where((amax == 0) | (scale == 0), torch.ones_like(scale), scale)


def quantize_blocks(
    t: torch.Tensor, amax: torch.Tensor, block_2d: bool, random_bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (R, C) uint8, E4M3 block scales (R, ceil(C/16)) as uint8) of ``t`` (R, C); stochastic
    rounding when ``random_bits`` (R, C) is given."""
    rows, cols = t.shape
    pad_rows = -rows % _BLOCK if block_2d else 0
    x = torch.nn.functional.pad(t.float(), (0, -cols % _BLOCK, 0, pad_rows))
    blocks = x.view(x.shape[0], x.shape[1] // _BLOCK, _BLOCK)
    vec_max = blocks.abs().amax(dim=2)
    if block_2d:
        tiles = vec_max.view(x.shape[0] // _BLOCK, _BLOCK, vec_max.shape[1]).amax(dim=1, keepdim=True)
        vec_max = tiles.expand(-1, _BLOCK, -1).reshape(vec_max.shape)
    encode = global_encode_scale(amax)
    decode = 1.0 / encode
    block_scale = torch.clamp(vec_max * (encode * (1.0 / 6.0)), max=F8E4M3_MAX).to(torch.float8_e4m3fn)
    block_encode = torch.clamp(1.0 / (block_scale.float() * decode), max=FLT_MAX)
    scaled = torch.clamp(blocks * block_encode.unsqueeze(2), -F4E2M1_MAX, F4E2M1_MAX)
    if random_bits is None:
        codes = e2m1_codes(scaled).view(x.shape)[:rows, :cols]
    else:
        scaled = scaled.view(x.shape)[:rows, :cols]
        codes = e2m1_codes_stochastic(scaled, random_bits)
    # NaN scales as 0x7F (the hardware cvt's NaN; a NaN's sign is not reproducible across devices).
    scale_bits = torch.where(block_scale.float().isnan(), 0x7F, block_scale.view(torch.uint8))
    return codes, scale_bits.to(torch.uint8)[:rows]


def _amax(t: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    if given is not None:
        return given.reshape(1).float()
    return t.abs().amax().float().reshape(1) if t.numel() else t.new_zeros((1,), dtype=torch.float32)


def _quantize_copies(
    x2d: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    block_2d: bool,
    sr_seed: torch.Tensor | None,
    row0: int = 0,
    total_rows: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Unpadded (row codes, row scales, col codes, col scales, amax_row, amax_col) of ``x2d`` (rows of a
    tensor of ``total_rows`` starting at ``row0``: the stochastic-rounding indices are global)."""
    rows, cols = x2d.shape
    total_rows = rows if total_rows is None else total_rows
    col_input = x2d.t().contiguous()
    if rht and columnwise:
        col_input = apply_rht(col_input)
    amax_row = _amax(x2d, amax_rowwise)
    amax_col = _amax(col_input, amax_columnwise) if columnwise else amax_row
    row_bits = col_bits = None
    if sr_seed is not None:
        token = row0 + torch.arange(rows, device=x2d.device)
        hidden = torch.arange(cols, device=x2d.device)
        row_bits = sr_random_bits(sr_seed, SR_STREAM_ROWWISE, token[:, None] * cols + hidden[None, :])
        col_index = hidden[:, None] * total_rows + token[None, :]
        col_bits = sr_random_bits(sr_seed, SR_STREAM_COLUMNWISE, col_index)
    row_codes = row_scales = col_codes = col_scales = None
    if rowwise:
        row_codes, row_scales = quantize_blocks(x2d, amax_row, block_2d, row_bits)
    if columnwise:
        col_codes, col_scales = quantize_blocks(col_input, amax_col, block_2d, col_bits)
    return row_codes, row_scales, col_codes, col_scales, amax_row, amax_col


def nvfp4_quantize(
    x: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    block_2d: bool,
    sr_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Reference of ``lowp::nvfp4_quantize``; outputs as ``meta.nvfp4.nvfp4_quantize_outputs``.
    ``sr_seed`` (int64 [seed, offset]): stochastic rounding of both copies, random bits from
    :func:`sr_random_bits` with linear indices ``row * K + col`` (row-wise) and ``col * M + row``
    (column-wise); None: round to nearest."""
    outputs = nvfp4_quantize_outputs(
        x, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d, sr_seed
    )
    row_data, row_scale, col_data, col_scale, amax_row, amax_col = outputs
    rows, cols = flat_2d_dims(x.shape)
    row_codes, row_scales, col_codes, col_scales, amax_r, amax_c = _quantize_copies(
        x.reshape(rows, cols), rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d, sr_seed
    )
    amax_row.copy_(amax_r)
    amax_col.copy_(amax_c)
    if rowwise:
        row_data.copy_(pack_fp4(row_codes))
        row_scale[:rows, : row_scales.shape[1]] = row_scales
    if columnwise:
        col_data.copy_(pack_fp4(col_codes))
        col_scale[:cols, : col_scales.shape[1]] = col_scales
    return outputs


def group_col_scale_starts(split_sizes: torch.Tensor) -> torch.Tensor:
    """First column of each expert's block in the grouped column-wise scale matrix (device, no sync):
    the exclusive cumsum of ``roundup(ceil(m_e / 16), 4)``."""
    widths = (split_sizes + _BLOCK - 1) // _BLOCK
    widths = (widths + SCALE_TILE_COLS - 1) // SCALE_TILE_COLS * SCALE_TILE_COLS
    return torch.cumsum(widths, 0) - widths


def nvfp4_group_quantize(
    x: torch.Tensor,
    split_sizes: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    sr_seed: torch.Tensor | None = None,
    block_2d: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Reference of ``lowp::nvfp4_group_quantize`` (layout: ``meta.nvfp4.nvfp4_group_quantize_outputs``):
    expert e's rows ``x[row0_e : row0_e + m_e]`` quantized as :func:`nvfp4_quantize` would with the
    expert's amaxes (given: ``amax_*[e]``; computed: over the expert's rows, 0 when empty). The split
    sizes are read on the host here (the CPU implementation); the CUDA kernel keeps them on the device.
    Every m_e must be even with ``columnwise`` and a multiple of 16 with ``rht`` (checked by the output
    function); the experts' rows are the effective boundaries of ``meta.split_sizes`` with that multiple,
    and the rows of no expert get data and row-wise scales 0."""
    outputs = nvfp4_group_quantize_outputs(
        x, split_sizes, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, sr_seed, block_2d
    )
    row_data, row_scale, col_data, col_scale, amax_row, amax_col = outputs
    tokens, hidden = x.shape
    effective = effective_split_sizes(split_sizes, tokens, group_split_multiple(columnwise, rht, block_2d))
    sizes = effective.tolist()
    scale_starts = group_col_scale_starts(effective).tolist()
    row0 = 0
    for expert, size in enumerate(sizes):
        given_row = None if amax_rowwise is None else amax_rowwise[expert]
        given_col = None if amax_columnwise is None else amax_columnwise[expert]
        rows = x[row0 : row0 + size]
        check_quantize_args(rows, rowwise, columnwise, rht, given_row, given_col, block_2d)
        row_codes, row_scales, col_codes, col_scales, amax_r, amax_c = _quantize_copies(
            rows, rowwise, columnwise, rht, given_row, given_col, block_2d, sr_seed, row0, tokens
        )
        amax_row[expert] = amax_r[0]
        amax_col[expert] = amax_c[0]
        if rowwise:
            row_data[row0 : row0 + size] = pack_fp4(row_codes)
            row_scale[row0 : row0 + size, : row_scales.shape[1]] = row_scales
        if columnwise and size:
            col_data[hidden * row0 // 2 : hidden * (row0 + size) // 2] = pack_fp4(col_codes).reshape(-1)
            start = scale_starts[expert]
            col_scale[:hidden, start : start + col_scales.shape[1]] = col_scales
        row0 += size
    if rowwise:
        row_data[row0:] = 0
    return outputs


def staged_amax(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax / 2^64 where amax >= 2^64, else amax; the power of two that undoes it), both fp32.

    ``s_b * amax`` overflows fp32 for amax above FLT_MAX / 448 (about 7.6e35). Scaled by 2^-64, every
    product of the dequantization stays normal and finite, and a power of two commutes with each of its
    roundings, so the value times 2^64 is bit-identical wherever the unstaged one was finite.
    """
    amax = amax.float()
    large = amax >= STAGED_AMAX_UNIT
    return torch.where(large, amax * (1.0 / STAGED_AMAX_UNIT), amax), torch.where(
        large, STAGED_AMAX_UNIT, 1.0
    )


def dequantized(codes: torch.Tensor, block_scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``e2m1(codes) * (fp32(s_b) * amax * fp32(1/2688))``, the amax staged as :func:`staged_amax`:
    ``block_scale`` (fp32 per element) and ``amax`` broadcast against ``codes``."""
    amax, unstage = staged_amax(amax)
    final_scale = block_scale * amax * (1.0 / NVFP4_GLOBAL_SCALE_NUMERATOR)
    return e2m1_values(codes) * final_scale * unstage


def nvfp4_dequantize(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Reference of ``lowp::nvfp4_dequantize``: ``(R, 2 * data.shape[1])`` values in ``dtype``,
    ``e2m1(q) * (fp32(s_b) * amax * fp32(1/2688))`` with the amax staged as :func:`staged_amax`."""
    out = nvfp4_dequantize_output(data, scale, amax, dtype)
    rows, cols = out.shape
    block_scale = scale[:rows].view(torch.float8_e4m3fn).float()
    element_scale = block_scale.repeat_interleave(_BLOCK, dim=1)[:, :cols]
    out.copy_(dequantized(unpack_fp4(data), element_scale, amax.reshape(1, 1)))
    return out


def group_column_codes(
    data: torch.Tensor,
    scale: torch.Tensor,
    sizes: torch.Tensor,
    expert: torch.Tensor,
    hidden: int,
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 codes, fp32 block scales), both ``(hidden, tokens)``, of the grouped column-wise copy (flat
    ``data``, ``scale`` as ``meta.nvfp4.nvfp4_group_quantize_outputs``) for effective ``sizes`` (E,) and
    each token's ``expert`` (clamped to a valid one). Token t of expert e (local index l = t - start_e) in
    channel h has its code in byte ``hidden * start_e / 2 + h * m_e / 2 + l / 2`` (high nibble for odd
    l) and its scale in ``scale[h, group_col_scale_starts[e] + l // 16]``."""
    ends = torch.cumsum(sizes, 0)
    start = (ends - sizes)[expert]
    local = torch.arange(tokens, device=data.device) - start
    channel = torch.arange(hidden, device=data.device)[:, None]
    byte = hidden * start // 2 + channel * (sizes[expert] // 2) + local // 2
    packed = data[byte.clamp(0, max(data.numel() - 1, 0))]
    codes = torch.where(local % 2 == 1, packed >> 4, packed & 0xF)
    scale_col = group_col_scale_starts(sizes)[expert] + local // _BLOCK
    scale_col = scale_col.clamp(0, scale.shape[1] - 1).expand(hidden, tokens)
    return codes, scale[:hidden].gather(1, scale_col).view(torch.float8_e4m3fn).float()


def nvfp4_group_dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    split_sizes: torch.Tensor,
    dtype: torch.dtype,
    use: str,
    tokens: int,
    hidden: int,
    multiple: int,
) -> torch.Tensor:
    """``lowp::nvfp4_group_dequantize`` (element-wise PyTorch on the device, no host sync: it serves CUDA
    too): one copy of ``lowp::nvfp4_group_quantize``'s outputs dequantized, every element with its
    expert's amax as :func:`nvfp4_dequantize` computes it, so expert e's rows (row-wise, ``(T, K)``) or
    columns (column-wise, ``(K, T)``: ``x^T``, or ``RHT(x^T)``) equal the dequantization of that expert
    quantized alone. The experts' rows are the effective boundaries with ``multiple``; the rows of no
    expert give 0."""
    out = nvfp4_group_dequantize_output(data, scale, amax, split_sizes, dtype, use, tokens, hidden, multiple)
    if out.numel() == 0:
        return out
    experts = split_sizes.shape[0]
    sizes = effective_split_sizes(split_sizes, tokens, multiple)
    expert = expert_of_rows(sizes, tokens)  # (tokens,), E for a row of no expert
    decodable = expert < experts
    expert = expert.clamp(max=experts - 1)
    if use == "rowwise":
        block_scale = scale[:tokens, : ceil_div(hidden, _BLOCK)].view(torch.float8_e4m3fn).float()
        element_scale = block_scale.repeat_interleave(_BLOCK, dim=1)[:, :hidden]
        values = dequantized(unpack_fp4(data), element_scale, amax[expert][:, None])
        out.copy_(torch.where(decodable[:, None], values, 0.0))
        return out
    codes, block_scale = group_column_codes(data, scale, sizes, expert, hidden, tokens)
    values = dequantized(codes, block_scale, amax[expert][None, :])
    out.copy_(torch.where(decodable[None, :], values, 0.0))
    return out
