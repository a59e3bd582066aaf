"""Grouped GEMM of MoE experts (``torch._grouped_mm`` semantics for bf16), as a loop over the groups.

Groups are given by ``offs``, the int32 cumulative sums of the split sizes (group ``e`` owns rows
``[offs[e-1], offs[e])``). Products accumulate in fp32 and are rounded once to bf16. Rows of a
(T, K) x (E, K, N) product past ``offs[-1]`` are zero here (``torch._grouped_mm`` leaves them
unwritten); an empty group of a (M, T) x (T, N) product gives a zero (M, N) block. This loop reads
``offs`` on the host: it is the CPU implementation; CUDA runs ``torch._grouped_mm`` (no host sync).
"""

from __future__ import annotations

import itertools

import torch

from ..meta.grouped_mlp import grouped_mm_output


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Reference of ``lowp::grouped_mm``: ``a`` (T, K) x ``b`` (E, K, N) -> (T, N), or ``a`` (M, T) x
    ``b`` (T, N) -> (E, M, N) with the groups along T."""
    out = grouped_mm_output(a, b, offs).zero_()
    bounds = list(itertools.pairwise([0, *offs.tolist()]))
    for group, (start, end) in enumerate(bounds):
        if b.dim() == 3:
            out[start:end] = a[start:end].float() @ b[group].float()
        else:
            out[group] = a[:, start:end].float() @ b[start:end].float()
    return out
