"""Composite ops: ``lowp::`` ops whose one implementation calls other ``lowp::`` ops (the grouped MoE
linear layers and their MXFP8 / NVFP4 recipes). They sit below the registry: ``lowp_ops.library``
imports them to define the ops, and they reach the ops they call through :func:`registry` at call time.
"""

from __future__ import annotations

import functools
import types


@functools.cache
def registry() -> types.ModuleType:
    """``lowp_ops.library``, imported on the first call (a module-level import would be a cycle: the
    registry imports the composite modules to define their ops)."""
    from .. import library

    return library


__all__ = ["registry"]
