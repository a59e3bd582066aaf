"""The two suites a kernel test runs in, and the hypothesis settings of kernel property tests.

``SUITES`` parametrizes a test as ``interp`` (CPU tensors under TRITON_INTERPRET=1) and ``gpu``; the
``kernel_device`` fixture (conftest.py) gives the device of each. Shrinking a failing example takes
minutes in the interpreter: there the first failing example is reported as drawn.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SUITES = [
    pytest.param("interp", marks=pytest.mark.interp, id="interp"),
    pytest.param("gpu", marks=pytest.mark.gpu, id="gpu"),
]


def kernel_property_settings(interp_examples: int, gpu_examples: int = 60) -> settings:
    """Hypothesis settings: ``interp_examples`` examples in the interpreter, ``gpu_examples`` on a GPU."""
    return settings(
        max_examples=interp_examples if INTERPRET else gpu_examples,
        deadline=None,
        phases=[phase for phase in Phase if phase != Phase.shrink or not INTERPRET],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
