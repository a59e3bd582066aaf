"""Argument checks that work eagerly, under fake tensors and under Dynamo.

``torch._check`` message closures that capture tensors or floats cannot be traced by Dynamo (the public
functions run inside user graphs), so checks raise plain ``ValueError``s; the message is only built
when the check fails.
"""

from __future__ import annotations

from collections.abc import Callable


def require(condition, message: Callable[[], str]) -> None:
    """Raise ``ValueError(message())`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(message())
