"""Effective expert boundaries inside Triton kernels, the rule of ``lowp_ops.meta.split_sizes`` (the
PyTorch form there is the reference these must equal): sizes clamped to ``[0, T + 1]``, int64 prefix sums
``c``, ``end_e = M * floor(max({0} | {c_j : j <= e, c_j <= T}) / M)``. Any sizes give non-negative
effective sizes with a total of at most T, so no kernel indexes outside its tensors, whatever the
sizes hold. The sizes are read on the device: no host sync. Group ends of ``lowp::grouped_mm`` (any
order) get the same rule with ``c`` the given ends, in a one-program kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import next_power_of_2
from ..meta.split_sizes import group_ends_output
from .launch import PlanCache, cached_launch


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def valid_group_ends(raw_ends, rows):
    """int64 ``max({0} | {raw_j : j <= e, 0 <= raw_j <= rows})`` of int64 group ends in any order."""
    kept = tl.where((raw_ends >= 0) & (raw_ends <= rows), raw_ends, 0)
    return tl.associative_scan(kept, 0, _maximum)


@triton.jit
def effective_bounds(split_ptr, experts, rows, EXPERTS_POW2: tl.constexpr, MULTIPLE: tl.constexpr):
    """int64 (start, end) [EXPERTS_POW2] of the experts whose int32/int64 sizes are at ``split_ptr``;
    lanes past ``experts`` hold empty ranges at the last end. One prefix sum: the sums are
    non-decreasing, so the valid ones are a prefix of the lanes and the running maximum of the rule is
    their largest, ``last``; an expert within it keeps its size, the others get none."""
    idx = tl.arange(0, EXPERTS_POW2)
    raw = tl.load(split_ptr + idx, mask=idx < experts, other=0).to(tl.int64)
    sizes = tl.minimum(tl.maximum(raw, 0), rows + 1)
    prefix = tl.cumsum(sizes, 0)
    valid = prefix <= rows
    last = tl.max(tl.where(valid, prefix, 0), 0)
    end = tl.where(valid, prefix, last)
    start = end - tl.where(valid, sizes, 0)
    if MULTIPLE > 1:
        start = start // MULTIPLE * MULTIPLE
        end = end // MULTIPLE * MULTIPLE
    return start, end


@triton.jit
def effective_sizes(split_ptr, experts, rows, EXPERTS_POW2: tl.constexpr, MULTIPLE: tl.constexpr):
    """int32 [EXPERTS_POW2] effective sizes (0 past ``experts``): >= 0, multiples of MULTIPLE, with a
    total of at most ``rows``."""
    start, end = effective_bounds(split_ptr, experts, rows, EXPERTS_POW2, MULTIPLE)
    return (end - start).to(tl.int32)


@triton.jit
def expert_of_rows(ends, rows):
    """int32 expert of each of ``rows`` (a block of row indices): the number of group ``ends`` at or below
    it, ``experts`` for a row past the last end; padding lanes of ``ends`` must lie past every row."""
    return tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)


@triton.jit
def tile_owner(sizes, tile, TILE: tl.constexpr):
    """(TILE-row tiles per expert, their inclusive prefix sums, the expert owning tile number ``tile``)
    when every expert's ``sizes`` rows are cut into TILE-row tiles in order; ``expert >= experts`` for a
    tile past the last expert."""
    tiles = (sizes + TILE - 1) // TILE
    tile_ends = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_ends <= tile).to(tl.int32), 0)
    return tiles, tile_ends, expert


@triton.jit
def scale_col_start(sizes, before, MULTIPLE: tl.constexpr):
    """First column of an expert's column-wise NVFP4 scales: each expert ``before`` it (a lane mask)
    takes ``ceil(size / 16)`` 16-row blocks padded to a multiple of MULTIPLE columns."""
    blocks = (sizes + 15) // 16
    padded = (blocks + MULTIPLE - 1) // MULTIPLE * MULTIPLE
    return tl.sum(tl.where(before, padded, 0), 0)


@cached_launch
@triton.jit
def valid_group_ends_kernel(offs_ptr, out_ptr, groups, rows, GROUPS_POW2: tl.constexpr):
    """int32 valid group ends of the int32/int64 ends ``offs``: one program."""
    idx = tl.arange(0, GROUPS_POW2)
    raw = tl.load(offs_ptr + idx, mask=idx < groups, other=0).to(tl.int64)
    tl.store(out_ptr + idx, valid_group_ends(raw, rows).to(tl.int32), mask=idx < groups)


@cached_launch
@triton.jit
def group_ends_kernel(split_ptr, out_ptr, experts, rows, EXPERTS_POW2: tl.constexpr, EXTENDED: tl.constexpr):
    """int32 effective group ends of the int32/int64 split sizes: one program. EXTENDED: also the same
    ends with the last one ``rows``, at ``out_ptr + experts``."""
    _, end = effective_bounds(split_ptr, experts, rows, EXPERTS_POW2, 1)
    idx = tl.arange(0, EXPERTS_POW2)
    tl.store(out_ptr + idx, end.to(tl.int32), mask=idx < experts)
    if EXTENDED:
        extended = tl.where(idx == experts - 1, rows, end)
        tl.store(out_ptr + experts + idx, extended.to(tl.int32), mask=idx < experts)


def launch_group_ends(split_sizes: torch.Tensor, rows: int, with_extended: bool = False) -> torch.Tensor:
    """``lowp::group_ends`` on the device: int32 (E,) effective ends of ``split_sizes``, or with
    ``with_extended`` (2, E) with the extended row (one launch either way), from a plan per
    specialization."""
    key = ("ends", split_sizes.shape, split_sizes.stride(), split_sizes.dtype, split_sizes.device, rows)
    key += (with_extended,)
    return _PLANS.get(key, _group_ends_plan, split_sizes, rows, with_extended)(split_sizes)


# The launchers' plans, one per specialization (shapes, strides, dtypes, devices, row counts).
_PLANS = PlanCache()


def _group_ends_plan(split_sizes: torch.Tensor, rows: int, with_extended: bool):
    shape = group_ends_output(split_sizes, rows, with_extended).shape  # the checks
    experts = split_sizes.shape[0]
    copy = not split_sizes.is_contiguous()
    launch = group_ends_kernel.bind(
        (1,), EXPERTS_POW2=max(2, next_power_of_2(experts)), EXTENDED=with_extended
    )

    def call(split_sizes):
        out = split_sizes.new_empty(shape, dtype=torch.int32)
        launch(split_sizes.contiguous() if copy else split_sizes, out, experts, rows)
        return out

    return call


def launch_valid_group_ends(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 (G,) valid group ends of ``offs`` (G,) over ``rows`` rows, on the device (one launch)."""
    groups = offs.shape[0]
    out = torch.empty(groups, dtype=torch.int32, device=offs.device)
    if groups:
        pow2 = max(2, next_power_of_2(groups))
        valid_group_ends_kernel[(1,)](offs.contiguous(), out, groups, rows, GROUPS_POW2=pow2)
    return out
