"""The two suites a kernel test runs in, and the hypothesis settings of kernel property tests.

``SUITES`` parametrizes a test as ``interp`` (CPU tensors under TRITON_INTERPRET=1) and ``gpu``; the
``kernel_device`` fixture (conftest.py) gives the device of each. Shrinking a failing example takes
minutes in the interpreter: there the first failing example is reported as drawn.
"""

from __future__ import annotations

import os

import pytest
import torch
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


def assert_mxfp8_scale_padding_is_zero(row_scale, col_scale, rows: int, cols: int, scale_layout: str) -> None:
    """The scale codes outside the data's blocks (rows and columns padded to 128) are 0, in either
    layout; a 0-element scale tensor (a copy not asked for) is skipped."""
    import math

    from lowp_ops.reference import mxfp8 as reference

    swizzled = scale_layout == "swizzled"
    if row_scale.numel():
        compact = reference.unswizzle_scales(row_scale.cpu()) if swizzled else row_scale.cpu()
        assert not compact[rows:].any(), "row-wise scales: rows past the data are not 0"
        assert not compact[:, math.ceil(cols / 32) :].any(), "row-wise scales: blocks past the data are not 0"
    if col_scale.numel():
        compact = reference.unswizzle_col_scales(col_scale.cpu()) if swizzled else col_scale.cpu()
        assert not compact[math.ceil(rows / 32) :].any(), "column-wise scales: blocks past the data are not 0"
        assert not compact[:, cols:].any(), "column-wise scales: columns past the data are not 0"


def assert_plans_follow(outputs_of, variants: list[dict], device: str) -> None:
    """Launchers that keep one plan per specialization: ``outputs_of(variant, device)`` (the outputs of
    calls of one shape with the variant's layouts and options, as bit patterns) made for every variant
    in sequence, each finding the plans of the calls before it, equals the same calls made with no plan
    stored."""
    from lowp_ops.kernels.launch import clear_plans

    in_sequence = [outputs_of(variant, device) for variant in variants]
    for variant, got_outputs in zip(variants, in_sequence, strict=True):
        clear_plans()
        fresh = outputs_of(variant, device)
        assert len(got_outputs) == len(fresh), variant
        for index, (got, want) in enumerate(zip(got_outputs, fresh, strict=True)):
            assert got.shape == want.shape and torch.equal(got, want), (variant, index)
