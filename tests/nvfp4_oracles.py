"""Pure-PyTorch oracles of the NVFP4 recipe's operands (tests only)."""

from __future__ import annotations

import torch

from lowp_ops.formats import NVFP4_BLOCK_SIZE
from lowp_ops.reference import nvfp4 as nvfp4_ref


def local_values(t: torch.Tensor, amax: torch.Tensor, block_2d: bool = False) -> torch.Tensor:
    """``e2m1(q) * s_b`` (exact in bf16) of ``t`` (R, C) quantized in 1x16 blocks along C (16x16 when
    ``block_2d``) with the global amax ``amax``, broadcastable to the (R, ceil(C/16)) blocks (pure
    PyTorch: the oracle of the recipe's op-based operands, ``composite.grouped_nvfp4.*_operand``)."""
    cols = t.shape[1]
    codes, scales = nvfp4_ref.quantize_blocks(t, amax, block_2d)
    block_scale = scales.view(torch.float8_e4m3fn).float().repeat_interleave(NVFP4_BLOCK_SIZE, dim=1)
    return (nvfp4_ref.e2m1_values(codes) * block_scale[:, :cols]).to(torch.bfloat16)
