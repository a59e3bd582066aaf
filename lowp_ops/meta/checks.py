"""Argument checks that work eagerly, under fake tensors and under Dynamo.

``torch._check`` message closures that capture tensors or floats cannot be traced by Dynamo (the public
functions run inside user graphs), so checks raise plain ``ValueError``s; the message is only built
when the check fails.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..formats import HIGH_PRECISION_DTYPES


def require(condition, message: Callable[[], str]) -> None:
    """Raise ``ValueError(message())`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(message())


def check_int(value, name: str) -> None:
    """``value`` is an int (a bool or a float is not), or raise a TypeError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def check_bool(value, name: str) -> None:
    """``value`` is a bool (an int, a string or a tensor is not), or raise a TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_real(value, name: str) -> None:
    """``value`` is an int or a float (not a bool, a string or a tensor), or raise a TypeError naming
    ``name``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")


def check_float_dtype(dtype, name: str = "dtype") -> None:
    """``dtype`` is torch.float32, bfloat16 or float16, or raise naming ``name`` (a string such as
    ``"bf16"`` is a TypeError, before any op schema sees it)."""
    if dtype in HIGH_PRECISION_DTYPES:  # the common call returns here
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{name} must be a torch.dtype (torch.float32, torch.bfloat16 or torch.float16), got {dtype!r}"
        )
    require(
        dtype in HIGH_PRECISION_DTYPES, lambda: f"{name} must be float32, bfloat16 or float16, got {dtype}"
    )


def require_tensor(value, name: str) -> None:
    """``value`` is a torch.Tensor, or raise a TypeError naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(value).__name__}")
