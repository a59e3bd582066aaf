"""NVFP4 recipe of the grouped linear layers (te_grouped_mlp_nvfp4.md §2.7, §3.10): pending the grouped
NVFP4 quantizer."""

from __future__ import annotations

import torch


def nvfp4_fprop(x: torch.Tensor, weight: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("recipe='nvfp4' needs nvfp4_group_quantize, which is not merged yet")


def nvfp4_backward(grad, x, weight, split_sizes, grad_amax):
    raise NotImplementedError("recipe='nvfp4' needs nvfp4_group_quantize, which is not merged yet")
