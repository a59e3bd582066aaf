"""Public NVFP4 functions (thin wrappers over ``torch.ops.lowp``)."""

from __future__ import annotations

import torch

from . import library
from .formats import NVFP4GroupedTensor, NVFP4Tensor
from .meta.checks import check_bool, check_float_dtype, require, require_tensor
from .meta.nvfp4 import group_split_multiple

__all__ = ["nvfp4_dequantize", "nvfp4_group_quantize", "nvfp4_quantize"]


def _check_public_args(x, columnwise: bool, amax_columnwise, rowwise: bool, amax_rowwise) -> None:
    """What only the public functions check: x is a tensor, and no amax is given for a copy not asked
    for (it would be ignored)."""
    require_tensor(x, "x")
    require(amax_rowwise is None or rowwise, lambda: "amax_rowwise is given but rowwise=False")
    require(amax_columnwise is None or columnwise, lambda: "amax_columnwise is given but columnwise=False")


def _sr_seed(stochastic_rounding: bool, sr_seed: torch.Tensor | None, device) -> torch.Tensor | None:
    """The int64 [seed, offset] of stochastic rounding: the caller's, or drawn on the device from torch's
    generator (graph-safe: no host sync, captured like any random op)."""
    check_bool(stochastic_rounding, "stochastic_rounding")
    if not stochastic_rounding:
        require(sr_seed is None, lambda: "sr_seed is only used with stochastic_rounding=True")
        return None
    if sr_seed is None:
        sr_seed = torch.randint(0, 2**31 - 1, (2,), device=device, dtype=torch.int64)
    return sr_seed


def _container_fields(outputs: tuple[torch.Tensor, ...], rowwise: bool, columnwise: bool) -> dict:
    """The container fields of a quantize op's six outputs; the copies not asked for are None (the op
    returns empty placeholders for them)."""
    row_data, row_scale, col_data, col_scale, amax_row, amax_col = outputs
    return {
        "row_data": row_data if rowwise else None,
        "row_scale": row_scale if rowwise else None,
        "col_data": col_data if columnwise else None,
        "col_scale": col_scale if columnwise else None,
        "amax_rowwise": amax_row,
        "amax_columnwise": amax_col,
    }


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    rht: bool = False,
    amax_rowwise: torch.Tensor | None = None,
    amax_columnwise: torch.Tensor | None = None,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    sr_seed: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` (viewed as ``(M, K)``) to NVFP4 with round-to-nearest, as TransformerEngine's reference.

    Args:
        rowwise / columnwise: the copies to write; the column-wise copy quantizes ``x^T`` (K, M).
        rht: apply the 16-point random Hadamard transform to the column-wise operand (bf16 ``x``,
            ``M % 16 == 0``); the row-wise copy is never transformed (``q.rht`` is False without a
            column-wise copy).
        amax_rowwise / amax_columnwise: fp32 global amaxes to use as is (no amax pass runs for them).
        block_2d: one scale per 16x16 tile (weights); not with ``rht``.
        stochastic_rounding: round the E2M1 data of both copies stochastically (unbiased: up with
            probability proportional to the distance from the lower grid value), from a counter-based
            hash of ``sr_seed`` = int64 ``[seed, offset]`` on the device (drawn from torch's generator
            when None). The scales and amaxes do not change.

    Numerics (see ``lowp_ops.reference.nvfp4``): global scale ``2688 / amax``, E4M3 block scales, E2M1
    data with ties to even; ``x_hat = e2m1(q) * fp32(s_b) * amax / 2688``. Triton kernels on CUDA (bit
    for bit the reference, stochastic rounding included), the pure-PyTorch reference on CPU; no host sync.
    """
    _check_public_args(x, columnwise, amax_columnwise, rowwise, amax_rowwise)
    sr_seed = _sr_seed(stochastic_rounding, sr_seed, x.device)
    # The op checks its arguments before it allocates (meta.nvfp4.check_quantize_args).
    outputs = library.nvfp4_quantize(
        x, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d, sr_seed
    )
    return NVFP4Tensor(
        **_container_fields(outputs, rowwise, columnwise),
        rht=rht and columnwise,
        block_2d=block_2d,
        shape=x.shape,
    )


def nvfp4_group_quantize(
    x: torch.Tensor,
    split_sizes: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    rht: bool = False,
    amax_rowwise: torch.Tensor | None = None,
    amax_columnwise: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    sr_seed: torch.Tensor | None = None,
    block_2d: bool = False,
) -> NVFP4GroupedTensor:
    """Quantize tokens ``x`` (T, K) grouped by expert: rows ``[row0_e, row0_e + m_e)`` (``split_sizes``,
    E int32/int64 on the device, may hold zeros) are quantized as ``nvfp4_quantize`` would quantize them
    alone, with the expert's amaxes (``amax_*``: fp32 (E,) used as is; computed per expert otherwise).

    The split sizes never leave the device, so output shapes depend on T, K, E only (layout:
    :class:`~lowp_ops.formats.NVFP4GroupedTensor`). Preconditions: ``sum(m_e) == T``, every m_e even
    with ``columnwise`` and a multiple of 16 with ``rht`` (TE needs 128); checked on CPU (ValueError),
    on CUDA malformed sizes follow :mod:`lowp_ops.meta.split_sizes`'s effective-boundary rule (no host
    sync; ``LOWP_OPS_CHECK_SPLIT_SIZES=1`` checks on the host). ``block_2d``: 16x16 blocks (each
    expert's weight rows stacked, as the grouped MLP's NVFP4 recipe quantizes its weights in one call),
    every m_e a multiple of 16, no RHT; otherwise 1x16 blocks.
    """
    _check_public_args(x, columnwise, amax_columnwise, rowwise, amax_rowwise)
    sr_seed = _sr_seed(stochastic_rounding, sr_seed, x.device)
    # The op checks its arguments before it allocates (meta.nvfp4.check_group_quantize_args).
    outputs = library.nvfp4_group_quantize(
        x, split_sizes, rowwise, columnwise, rht, amax_rowwise, amax_columnwise, sr_seed, block_2d
    )
    return NVFP4GroupedTensor(
        **_container_fields(outputs, rowwise, columnwise),
        split_sizes=split_sizes,
        rht=rht and columnwise,
        shape=x.shape,
        block_2d=block_2d,
    )


def nvfp4_dequantize(
    q: NVFP4Tensor | NVFP4GroupedTensor, dtype: torch.dtype = torch.bfloat16, use: str = "rowwise"
) -> torch.Tensor:
    """Dequantize one copy of ``q``: ``"rowwise"`` gives ``q.shape``; ``"columnwise"`` gives the 2-D
    transposed operand ``(K, M)`` (in the Hadamard domain when ``q.rht``).

    An :class:`~lowp_ops.formats.NVFP4GroupedTensor` (tokens ``(T, K)``) gives ``(T, K)`` / ``(K, T)``:
    each expert's rows / columns with its own amax, equal to dequantizing that expert quantized alone
    (element-wise PyTorch, no host sync, on CUDA too); the rows of no expert are 0."""
    if not isinstance(q, (NVFP4Tensor, NVFP4GroupedTensor)):
        raise TypeError(f"q must be an NVFP4Tensor or an NVFP4GroupedTensor, got {type(q).__name__}")
    require(use in ("rowwise", "columnwise"), lambda: f"use must be 'rowwise' or 'columnwise', got {use!r}")
    check_float_dtype(dtype)
    if isinstance(q, NVFP4GroupedTensor):
        return _group_dequantize(q, dtype, use)
    if use == "rowwise":
        require(q.row_data is not None, lambda: "use='rowwise' but q holds no rowwise copy")
        values = library.nvfp4_dequantize(q.row_data, q.row_scale, q.amax_rowwise, dtype)
        return values if values.shape == q.shape else values.view(q.shape)
    require(q.col_data is not None, lambda: "use='columnwise' but q holds no columnwise copy")
    return library.nvfp4_dequantize(q.col_data, q.col_scale, q.amax_columnwise, dtype)


def _group_dequantize(q: NVFP4GroupedTensor, dtype: torch.dtype, use: str) -> torch.Tensor:
    tokens, hidden = q.shape
    data = q.row_data if use == "rowwise" else q.col_data
    require(data is not None, lambda: f"use={use!r} but q holds no {use} copy")
    # The boundaries the quantization used: its split-size multiple (meta.nvfp4.group_split_multiple).
    multiple = group_split_multiple(q.col_data is not None, q.rht, q.block_2d)
    scale, amax = (q.row_scale, q.amax_rowwise) if use == "rowwise" else (q.col_scale, q.amax_columnwise)
    return library.nvfp4_group_dequantize(
        data, scale, amax, q.split_sizes, dtype, use, tokens, hidden, multiple
    )
