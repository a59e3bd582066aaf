"""Split sizes of the grouped (MoE) ops: the argument check, the host check of their values, and the one
rule that turns any sizes into valid expert boundaries.

``split_sizes`` is an int32 or int64 tensor of shape (E,), E >= 1, on the data's device; expert ``e``
owns the rows ``[start_e, end_e)`` of a tensor of T rows. Well-formed sizes are >= 0 and sum to T (an op
may allow a shorter total, or need multiples of some M: its docstring says so).

**Effective boundaries** (every implementation applies this rule, the references and the kernels):

- ``c_e = sum_{j <= e} clamp(s_j, 0, T + 1)`` in int64: negative sizes count as 0 (the clamp at T + 1
  changes no comparison below and keeps the sums from overflowing);
- ``end_e = M * floor(max({0} | {c_j : j <= e, c_j <= T}) / M)``, ``start_e = end_{e-1}`` (``start_0 = 0``).

So the experts take their rows in order; the first expert whose rows would reach past row T, and every
expert after it, get no rows (an expert is never cut); rows past the last end belong to no expert; with
a multiple M > 1 the boundaries are rounded down to multiples of M. For well-formed sizes this is the
identity. ``lowp::grouped_mm`` takes group ends ``offs`` instead: the same rule with ``c = offs`` (an end
outside [0, T] is replaced by the last valid end before it, and ends never decrease).

**Host check of the values.** CPU tensors can be read without a device sync, so on CPU the ops raise a
``ValueError`` naming ``split_sizes`` for sizes that are not well formed; on CUDA the values are never read
(no sync, CUDA graphs capture) and the effective boundaries apply. The mode (:func:`set_split_size_checks`,
environment variable ``LOWP_OPS_CHECK_SPLIT_SIZES`` read at import):

- ``"cpu"`` (default): check CPU tensors;
- ``"all"`` (``LOWP_OPS_CHECK_SPLIT_SIZES=1``): also CUDA tensors, on the host — a device sync per op
  call, a debugging aid; skipped while a CUDA graph is being captured;
- ``"off"`` (``LOWP_OPS_CHECK_SPLIT_SIZES=0``): never; every device gives the effective-boundary result.

Tensors being traced (fake or meta tensors, Dynamo) are never read: the ops check when they run. The
NVFP4 quantizers read their given amaxes (not negative) under the same mode (:func:`host_check_wanted`).
"""

from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import is_fake

from .checks import require

ENV_VAR = "LOWP_OPS_CHECK_SPLIT_SIZES"
CHECK_MODES = ("cpu", "all", "off")
_ENV_MODES = {"1": "all", "all": "all", "0": "off", "off": "off", "cpu": "cpu", "": "cpu"}


def _mode_from_env() -> str:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    require(value in _ENV_MODES, lambda: f"{ENV_VAR} must be 1 (all), 0 (off) or cpu, got {value!r}")
    return _ENV_MODES[value]


_mode = _mode_from_env()


def set_split_size_checks(mode: str) -> str:
    """Set when the ops read split sizes on the host to check them: ``"cpu"`` (default), ``"all"`` (CUDA
    too: a sync per call, for debugging) or ``"off"``. Returns the previous mode."""
    global _mode
    require(mode in CHECK_MODES, lambda: f"mode must be one of {CHECK_MODES}, got {mode!r}")
    previous, _mode = _mode, mode
    return previous


def split_size_checks() -> str:
    """The current mode of :func:`set_split_size_checks`."""
    return _mode


# ------------------------------------------------------------------------------------- argument check


def check_split_sizes(
    split_sizes, experts: int | None = None, device: torch.device | None = None, of: str = "x"
) -> None:
    """``split_sizes`` is an int32/int64 tensor of shape ``(experts,)`` (any E >= 1 when None) on
    ``device`` (the device of ``of``); raises TypeError (not a tensor) or ValueError naming it. Reads no
    value: safe under tracing and on CUDA."""
    if not isinstance(split_sizes, torch.Tensor):
        raise TypeError(
            f"split_sizes must be a torch.Tensor of int32/int64 sizes (one per expert) on the device of "
            f"{of}, got {type(split_sizes).__name__}"
        )
    require(
        split_sizes.dim() == 1 and split_sizes.dtype in (torch.int32, torch.int64),
        lambda: (
            f"split_sizes must be 1-D int32/int64 (an integer tensor, one size per expert), "
            f"got {split_sizes.dtype} {split_sizes.dim()}-D"
        ),
    )
    require(split_sizes.shape[0] >= 1, lambda: "split_sizes must have at least one expert")
    require(
        experts is None or split_sizes.shape[0] == experts,
        lambda: f"split_sizes must have one entry per expert ({experts}), got {split_sizes.shape[0]}",
    )
    require(
        device is None or split_sizes.device == device,
        lambda: f"split_sizes must be on the device of {of} ({device}), got {split_sizes.device}",
    )


# ---------------------------------------------------------------------------------- host value check


def host_check_wanted(t: torch.Tensor) -> bool:
    """Whether the values of ``t`` are to be read and checked now (see the module docstring)."""
    if _mode == "off" or (not t.is_cpu and _mode != "all"):  # the common CUDA call returns here
        return False
    if t.is_meta or torch.compiler.is_compiling() or is_fake(t):
        return False
    return t.is_cpu or not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_split_size_values(
    split_sizes: torch.Tensor, rows: int, *, total: str = "exact", multiple: int = 1, why: str = ""
) -> None:
    """Raise a ValueError unless every size is >= 0 and a multiple of ``multiple`` (``why`` says who
    needs it) and the sizes sum to ``rows`` (``total="exact"``), to at most ``rows`` (``"at_most"``) or to
    anything (``"any"``). Reads the values only when :func:`host_check_wanted`."""
    if not host_check_wanted(split_sizes):
        return
    sizes = split_sizes.tolist()
    negative = next((e for e, size in enumerate(sizes) if size < 0), None)
    require(
        negative is None, lambda: f"split_sizes must be >= 0, got {sizes[negative]} for expert {negative}"
    )
    ragged = next((e for e, size in enumerate(sizes) if size % multiple), None)
    require(
        ragged is None,
        lambda: (
            f"split_sizes must be multiples of {multiple} ({why}), got {sizes[ragged]} for expert {ragged}"
        ),
    )
    count = sum(sizes)
    if total == "exact":
        require(count == rows, lambda: f"split_sizes must sum to the row count {rows}, got {count}")
    elif total == "at_most":
        require(count <= rows, lambda: f"split_sizes must sum to at most the row count {rows}, got {count}")


def check_group_end_values(offs: torch.Tensor, rows: int, name: str = "offs") -> None:
    """Raise a ValueError naming ``name`` unless the group ends ``offs`` are non-decreasing and within
    ``[0, rows]``. Reads the values only when :func:`host_check_wanted`."""
    if not host_check_wanted(offs):
        return
    ends = offs.tolist()
    bounds = list(zip([0, *ends], ends, strict=False))
    bad = next((g for g, (before, end) in enumerate(bounds) if not before <= end <= rows), None)
    require(
        bad is None,
        lambda: (
            f"{name} must be non-decreasing group ends in [0, {rows}], got {bounds[bad][1]} after "
            f"{bounds[bad][0]} (group {bad})"
        ),
    )


# ------------------------------------------------------------------------------- effective boundaries


def clamped_prefix_sums(split_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 ``c_e = sum_{j <= e} clamp(s_j, 0, rows + 1)`` on the device (no sync): raw group ends
    whose valid part (:func:`valid_group_ends`) are the effective boundaries."""
    return torch.cumsum(split_sizes.clamp(0, rows + 1), 0, dtype=torch.int64)


def valid_group_ends(ends: torch.Tensor, rows: int, multiple: int = 1) -> torch.Tensor:
    """int64 ``M * floor(max({0} | {ends_j : j <= e, 0 <= ends_j <= rows}) / M)`` of group ends (device, no
    sync): non-decreasing, within ``[0, rows]``, multiples of ``multiple``."""
    ends = ends.long()
    kept = torch.where((ends >= 0) & (ends <= rows), ends, 0).cummax(0).values
    return kept - kept % multiple if multiple > 1 else kept


def group_ends(split_sizes: torch.Tensor, rows: int, multiple: int = 1) -> torch.Tensor:
    """int64 (E,) effective ``end_e`` of ``split_sizes`` over ``rows`` rows (module docstring)."""
    return valid_group_ends(clamped_prefix_sums(split_sizes, rows), rows, multiple)


def group_ends_output(split_sizes: torch.Tensor, rows: int, with_extended: bool = False) -> torch.Tensor:
    """``lowp::group_ends``'s int32 output, (E,) or with ``with_extended`` (2, E), allocated, after the
    checks of :func:`check_split_sizes` and ``rows >= 0``."""
    check_split_sizes(split_sizes, of="split_sizes")
    require(rows >= 0, lambda: f"rows must be >= 0, got {rows}")
    shape = (2, split_sizes.shape[0]) if with_extended else split_sizes.shape
    return split_sizes.new_empty(shape, dtype=torch.int32)


def effective_split_sizes(split_sizes: torch.Tensor, rows: int, multiple: int = 1) -> torch.Tensor:
    """int64 (E,) ``end_e - start_e``: well-formed sizes (>= 0, multiples of ``multiple``, sum <= rows)
    that every op maps to the same boundaries as ``split_sizes``."""
    ends = group_ends(split_sizes, rows, multiple)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def expert_of_rows(split_sizes: torch.Tensor, rows: int, multiple: int = 1) -> torch.Tensor:
    """int64 (rows,) expert of every row under the effective boundaries, ``E`` for a row of no expert."""
    ends = group_ends(split_sizes, rows, multiple)
    return torch.bucketize(torch.arange(rows, device=split_sizes.device), ends, right=True)
