"""Backward graphs of C++ autograd nodes for eager calls (docs/dispatch.md#recorded-backward).

A Python ``autograd.Function`` runs its backward on autograd's device worker thread, which on the H200
machines costs ~60-200 us of host time per node more than torch's C++ nodes (benchmarks/RESULTS.md, "The
floor of a Python autograd node"). Where a loss's gradient is aten arithmetic on a tensor its forward
kernels already made (``grad = saved * factor``), the eager call records aten ops whose autograd formulas
compute exactly that, under a dispatch mode that runs none of their kernels and returns the values the
forward already has: autograd stores its own C++ nodes (``MulBackward0``, ``SumBackward0``), and the
backward runs no Python.

The recorded ops' forward values are never computed, so only the gradient formulas matter; each recording
below states the gradient it yields. Eager only: tracers (Dynamo, AOTAutograd, ``make_fx``) see the
registered ops and their Python formulas instead.
"""

from __future__ import annotations

import functools

import torch
import torch.autograd.forward_ad as forward_ad
from torch._C import _pop_torch_dispatch_stack, _push_on_torch_dispatch_stack

_aten = torch.ops.aten


class _Recording:
    """A dispatch mode that answers a chain of ops, in order, with ``results``, running nothing: op ``k``
    is ``ops[k]`` called with ``first`` (``k = 0``) or the previous answer among its arguments. Other
    calls run as usual: a saved-tensor hook (``save_on_cpu``, checkpointing) may call ops on the tensors
    autograd saves, which are never the chain's. Every op of the chain must be answered (checked
    after)."""

    __slots__ = ("ops", "position", "previous", "results")

    def __init__(self, ops: tuple, results: tuple, first: torch.Tensor) -> None:
        self.ops, self.results, self.position, self.previous = ops, results, 0, first

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        position = self.position
        if position >= len(self.ops) or func is not self.ops[position] or not _holds(args, self.previous):
            return func(*args, **(kwargs or {}))  # the mode is off inside this call
        self.position = position + 1
        self.previous = self.results[position]
        return self.previous


def _holds(args: tuple, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` itself is one of ``args``."""
    return any(arg is tensor for arg in args)


def available() -> bool:
    """Whether a recording may replace an op's Python autograd node: not under forward-mode AD, whose
    tangents the recorded ops would compute from values they never had. (Callers check the rest with
    :func:`lowp_ops.library.eager_call_allowed`.)"""
    return forward_ad._current_level < 0


def _record(program, args: tuple, ops: tuple, results: tuple, name: str) -> torch.Tensor:
    recording = _Recording(ops, results, args[0])
    _push_on_torch_dispatch_stack(recording)
    try:
        out = program(*args)
    finally:
        _pop_torch_dispatch_stack(None)
    if recording.position != len(ops):
        raise RuntimeError(f"lowp_ops.recorded: {ops[recording.position :]} were not called")
    _refuse_second_order(args[1], name)
    return out


def _refuse_second_order(term: torch.Tensor, name: str) -> None:
    """Make a gradient through ``term`` raise, so that differentiating the recorded backward (whose
    ``term`` is a constant to autograd: its second-order terms would be silently 0) is an error.

    ``term`` did not require grad when the ops were recorded, so the first backward computes nothing for
    it and calls no Python. Autograd saved the tensor itself (a leaf input): under ``create_graph=True``
    the backward's product with it now requires grad, and a second backward reaching it calls the hook."""
    term.requires_grad_()
    term.register_hook(functools.partial(_raise_second_order, name))


def _raise_second_order(name: str, _grad: torch.Tensor) -> None:
    raise RuntimeError(
        f"lowp::{name} does not support double backward: its gradient cannot be differentiated "
        "(create_graph=True through it)"
    )


def _placeholder(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` backed by one element: the value of a recorded intermediate, never read."""
    return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)


# where's derivative masks in one kernel (masked_fill's clones, then fills); a tensor, not a Python 0.0,
# which torch.where would turn into a scalar_tensor call first.
_ZERO = torch.zeros(())


def _rows_of(x, term, ignored):
    return torch.where(ignored, _ZERO, (x * term).sum(-1))


def _total_of(x, term, ignored):
    return _rows_of(x, term, ignored).sum()


def _scaled_total_of(x, term, ignored, scale_rows):
    return torch.dot(_rows_of(x, term, ignored), scale_rows)


_PRODUCT, _ROW_SUM, _MASK = _aten.mul.Tensor, _aten.sum.dim_IntList, _aten.where.self
_ROWS = (_PRODUCT, _ROW_SUM, _MASK)


def _row_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        _placeholder(x.shape, torch.float32, x.device),
        _placeholder(x.shape[:1], torch.float32, x.device),
    )


def rows_times_term(
    x: torch.Tensor, term: torch.Tensor, ignored: torch.Tensor, rows: torch.Tensor, name: str
) -> torch.Tensor:
    """``rows`` (N,), differentiable w.r.t. ``x`` (N, V) with ``dx = cast(term * r[:, None])``, ``r`` the
    rows' upstream gradient with ``+0`` where ``ignored`` (N,) bool: one fp32 product with ``term`` (N, V)
    fp32, rounded once to x's dtype. (A masked row's factor is +0 whatever its upstream gradient, so a
    term of +0 there stays +0.) ``name``: the op named by the error a second-order gradient raises."""
    inner, masked = _row_values(x)
    return _record(_rows_of, (x, term, ignored), _ROWS, (inner, masked, rows), name)


def total_times_term(
    x: torch.Tensor, term: torch.Tensor, ignored: torch.Tensor, total: torch.Tensor, name: str
) -> torch.Tensor:
    """0-d ``total``, differentiable w.r.t. ``x`` with ``dx = cast(term * r[:, None])``, ``r`` the
    upstream gradient broadcast to the rows, ``+0`` where ``ignored``."""
    inner, rows = _row_values(x)
    return _record(
        _total_of, (x, term, ignored), (*_ROWS, _aten.sum.default), (inner, rows, rows, total), name
    )


def scaled_total_times_term(
    x: torch.Tensor,
    term: torch.Tensor,
    ignored: torch.Tensor,
    scale: torch.Tensor,
    total: torch.Tensor,
    name: str,
) -> torch.Tensor:
    """0-d ``total``, differentiable w.r.t. ``x`` with ``dx = cast(term * r[:, None])``, ``r`` the
    upstream gradient times the 0-d fp32 ``scale`` (one fp32 product per row, ``dot``'s derivative),
    ``+0`` where ``ignored``."""
    inner, rows = _row_values(x)
    scale_rows = scale.expand(x.shape[0])
    return _record(
        _scaled_total_of,
        (x, term, ignored, scale_rows),
        (*_ROWS, _aten.dot.default),
        (inner, rows, rows, total),
        name,
    )
