"""Grouped GEMM of MoE experts (``torch._grouped_mm`` semantics for bf16), as a loop over the groups.

Groups are given by ``offs``, group ends (int32/int64): group ``e`` owns rows ``[end_{e-1}, end_e)``
of the grouped dim, with ``end = valid_group_ends(offs)`` (``meta.split_sizes``: an end outside [0, T]
is replaced by the last valid end before it, ends never decrease; the identity for valid ends).
Products accumulate in fp32 and are rounded once to bf16. Rows of a (T, K) x (E, K, N) product past
the last end are zero; an empty group of a (M, T) x (T, N) product gives a zero (M, N) block, and
tokens past the last end count for no group. This loop reads ``offs`` on the host: it is the CPU
implementation (which raises for invalid ends unless the checks are off); CUDA runs
``torch._grouped_mm`` on the same valid ends (no host sync).
"""

from __future__ import annotations

import itertools

import torch

from ..meta.checks import require
from ..meta.grouped_mm import grouped_mm_output
from ..meta.split_sizes import group_ends as effective_group_ends
from ..meta.split_sizes import group_ends_output, host_check_wanted, valid_group_ends


def group_ends(split_sizes: torch.Tensor, rows: int, with_extended: bool = False) -> torch.Tensor:
    """Reference of ``lowp::group_ends``: int32 (E,) effective group ends of ``split_sizes`` over ``rows``
    rows (``meta.split_sizes``): non-decreasing, within [0, rows], valid ``offs`` of ``grouped_mm``.
    ``with_extended``: (2, E), those ends and below them the same with the last one ``rows`` (the last
    group extended over the rows of no expert; ``grouped_mm``'s ``last_end_is_rows``)."""
    out = group_ends_output(split_sizes, rows, with_extended)
    ends = effective_group_ends(split_sizes, rows)
    if not with_extended:
        return out.copy_(ends)
    out.copy_(ends.expand(2, -1))
    out[1, -1] = rows
    return out


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    ends_valid: bool = False,
    last_end_is_rows: bool = False,
) -> torch.Tensor:
    """Reference of ``lowp::grouped_mm``: ``a`` (T, K) x ``b`` (E, K, N) -> (T, N), or ``a`` (M, T) x
    ``b`` (T, N) -> (E, M, N) with the groups along T; rows past the last valid end belong to no group
    (their output rows are 0). ``ends_valid`` (ends from ``lowp::group_ends``) lets the CUDA kernel skip
    making the ends valid, and ``last_end_is_rows`` (the caller's promise that ``offs[-1]`` is T, as the
    extended row of ``group_ends`` is) skip zeroing the rows past the last end; valid ends are their
    own validation, so neither changes a result here, and the promise is checked on the host."""
    out = grouped_mm_output(a, b, offs, ends_valid, last_end_is_rows).zero_()
    grouped_len = a.shape[0] if b.dim() == 3 else a.shape[1]
    ends = valid_group_ends(offs, grouped_len).tolist()
    if last_end_is_rows and ends and host_check_wanted(offs):
        require(
            ends[-1] == grouped_len,
            lambda: (
                f"last_end_is_rows=True needs offs[-1] == {grouped_len} (the grouped rows), got {ends[-1]}"
            ),
        )
    bounds = list(itertools.pairwise([0, *ends]))
    for group, (start, end) in enumerate(bounds):
        if b.dim() == 3:
            out[start:end] = a[start:end].float() @ b[group].float()
        else:
            out[group] = a[:, start:end].float() @ b[start:end].float()
    return out
