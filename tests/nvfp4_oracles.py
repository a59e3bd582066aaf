"""Pure-PyTorch oracles of the NVFP4 recipe's operands (tests only)."""

from __future__ import annotations

import torch

from lowp_ops.formats import NVFP4_BLOCK_SIZE
from lowp_ops.meta.split_sizes import expert_of_rows
from lowp_ops.reference import nvfp4 as nvfp4_ref


def local_values(t: torch.Tensor, amax: torch.Tensor, block_2d: bool = False) -> torch.Tensor:
    """``e2m1(q) * s_b`` (exact in bf16) of ``t`` (R, C) quantized in 1x16 blocks along C (16x16 when
    ``block_2d``) with the global amax ``amax``, broadcastable to the (R, ceil(C/16)) blocks (pure
    PyTorch: the oracle of the recipe's op-based operands, ``composite.grouped_nvfp4.*_operand``)."""
    cols = t.shape[1]
    codes, scales = nvfp4_ref.quantize_blocks(t, amax, block_2d)
    block_scale = scales.view(torch.float8_e4m3fn).float().repeat_interleave(NVFP4_BLOCK_SIZE, dim=1)
    return (nvfp4_ref.e2m1_values(codes) * block_scale[:, :cols]).to(torch.bfloat16)


def per_expert_amax(values_abs_max: torch.Tensor, split_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """(E,) fp32 max of per-row ``values_abs_max`` (rows,) over each expert's rows (effective boundaries
    of ``meta.split_sizes``); 0 for an expert with no row."""
    experts = split_sizes.shape[0]
    out = values_abs_max.new_zeros(experts + 1, dtype=torch.float32)
    out.scatter_reduce_(0, expert_of_rows(split_sizes, rows), values_abs_max.float(), reduce="amax")
    return out[:experts]


def row_values(per_expert: torch.Tensor, split_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) the value of each row's expert, 0 for a row of no expert."""
    return torch.cat((per_expert, per_expert.new_zeros(1)))[expert_of_rows(split_sizes, rows)]
