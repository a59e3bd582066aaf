"""Local values of NVFP4 copies: ``e2m1(code) * fp32(E4M3 block scale)`` in bf16, the operands of the
emulated NVFP4 GEMMs (docs/nvfp4.md#gemm-emulation). The product of a 2-bit and a 4-bit significand is
exact in fp32 and in bf16 (magnitudes 2^-10 .. 2688), so the result has one value whatever the order of
the operations. The global scale ``amax / 2688`` is not applied: it scales the GEMM output, by both
operands' scales per expert (:func:`nvfp4_scale_rows`).

Element-wise PyTorch on the device, no host sync: the CPU implementation and the kernels' oracle.
"""

from __future__ import annotations

import torch

from ..formats import NVFP4_BLOCK_SIZE, NVFP4_GLOBAL_SCALE_NUMERATOR, ceil_div
from ..meta.nvfp4_decode import (
    DECODE_SPLIT_MULTIPLE,
    nvfp4_decode_rows_output,
    nvfp4_group_decode_columns_output,
    nvfp4_scale_rows_output,
)
from ..meta.split_sizes import effective_split_sizes, expert_of_rows
from .nvfp4 import e2m1_values, group_column_codes


def nvfp4_decode_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference of ``lowp::nvfp4_decode_rows``: bf16 ``(..., R, C)`` local values of a row-wise copy,
    packed codes ``data`` ``(..., R, C/2)`` (element 2i in the low nibble) with one E4M3 scale per 16
    columns in ``scale[..., :R, :ceil(C/16)]`` (1x16 blocks, or the row-wise copy of 16x16 blocks)."""
    out = nvfp4_decode_rows_output(data, scale)
    rows, cols = out.shape[-2:]
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)
    blocks = ceil_div(cols, NVFP4_BLOCK_SIZE)
    block_scale = scale[..., :rows, :blocks].view(torch.float8_e4m3fn).float()
    element_scale = block_scale.repeat_interleave(NVFP4_BLOCK_SIZE, dim=-1)[..., :cols]
    out.copy_(e2m1_values(codes) * element_scale)
    return out


def nvfp4_group_decode_columns(
    col_data: torch.Tensor, col_scale: torch.Tensor, split_sizes: torch.Tensor, hidden: int, tokens: int
) -> torch.Tensor:
    """Reference of ``lowp::nvfp4_group_decode_columns``: bf16 ``(hidden, tokens)`` local values of the
    grouped column-wise copy of ``lowp::nvfp4_group_quantize``. Token t of expert e (local index
    ``l = t - start_e``, ``start_e = sum_{i<e} m_i``) in channel h has its code in byte
    ``hidden * start_e / 2 + h * m_e / 2 + l / 2`` (high nibble for odd l) and its scale in
    ``col_scale[h, group_col_scale_starts[e] + l // 16]``. Every m_e must be even (checked by the output
    function); the experts' tokens are the effective boundaries of ``meta.split_sizes`` with multiple 2,
    so tokens past ``sum(split_sizes)``, and those of an expert reaching past ``tokens`` (and of every
    expert after it), decode as 0."""
    out = nvfp4_group_decode_columns_output(col_data, col_scale, split_sizes, hidden, tokens)
    if out.numel() == 0:
        return out
    experts = split_sizes.shape[0]
    sizes = effective_split_sizes(split_sizes, tokens, DECODE_SPLIT_MULTIPLE)
    expert = expert_of_rows(sizes, tokens)
    decodable = expert < experts
    expert = expert.clamp(max=experts - 1)
    codes, scale = group_column_codes(col_data, col_scale, sizes, expert, hidden, tokens)
    values = e2m1_values(codes) * scale
    out.copy_(torch.where(decodable, values, 0.0))
    return out


def global_scale_factors(amax_a: torch.Tensor, amax_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert, two fp32 factors whose product, applied in turn, is ``alpha = (amax_a / 2688)(amax_b /
    2688)``: ``(alpha, 1)`` (the result bit-identical to one multiply by alpha) where alpha is finite, and
    the two quotients where it overflows (a product that overflows alone can still give finite outputs)."""
    a, b = amax_a * (1.0 / NVFP4_GLOBAL_SCALE_NUMERATOR), amax_b * (1.0 / NVFP4_GLOBAL_SCALE_NUMERATOR)
    alpha = a * b
    overflows = torch.isinf(alpha) & torch.isfinite(a) & torch.isfinite(b)
    return torch.where(overflows, a, alpha), torch.where(overflows, b, 1.0)


def nvfp4_scale_rows(
    y: torch.Tensor, amax_a: torch.Tensor, amax_b: torch.Tensor, ends: torch.Tensor | None
) -> torch.Tensor:
    """Reference of ``lowp::nvfp4_scale_rows``: bf16 ``fp32(y) * first_e * second_e`` (two fp32 roundings,
    in that order, then one to bf16) for the rows of expert e (:func:`global_scale_factors`); rows past
    the last end are multiplied by 0 (NaN stays NaN)."""
    out = nvfp4_scale_rows_output(y, amax_a, amax_b, ends)
    rows, experts = y.shape[0], amax_a.shape[0]
    row = torch.arange(rows, device=y.device)
    expert = row // (rows // experts) if ends is None else torch.bucketize(row, ends, right=True)
    no_expert = torch.zeros(1, dtype=torch.float32, device=y.device)
    first, second = (torch.cat((f, no_expert))[expert][:, None] for f in global_scale_factors(amax_a, amax_b))
    out.copy_(y.float().mul_(first).mul_(second))
    return out
