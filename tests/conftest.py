"""Test layers: plain = CPU (references, opcheck, compile); ``interp`` = Triton kernels on CPU tensors
under TRITON_INTERPRET=1 (its own pytest run, see README); ``gpu`` / ``cudagraph`` = need CUDA."""

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("gpu", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if HAS_CUDA else "ci"))


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_interp = pytest.mark.skip(reason="runs only under TRITON_INTERPRET=1 (the interpreter suite)")
    skip_non_interp = pytest.mark.skip(reason="not part of the interpreter suite")
    for item in items:
        if ("gpu" in item.keywords or "cudagraph" in item.keywords) and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "interp" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)
        if INTERPRET and "interp" not in item.keywords:
            item.add_marker(skip_non_interp)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """The launchers' plans start empty: one built by an earlier test would keep the configuration or
    kernel that a test patches (only where a test imported the kernels: the CPU suite never does)."""
    launch = sys.modules.get("lowp_ops.kernels.launch")
    if launch is not None:
        launch.clear_plans()


@pytest.fixture(autouse=True)
def _in_gradient_schedule_at_test_sizes(request, monkeypatch):
    """The LM head's in-gradient schedule serves calls of at least 2^25 logits
    (``IN_GRADIENT_MIN_LOGITS``); the tests' shapes are far smaller, so the suite lowers the threshold to
    0 and its N <= H calls run that schedule as large calls do, except in tests that request
    ``real_in_gradient_threshold``."""
    if "real_in_gradient_threshold" not in request.fixturenames:
        from lowp_ops.meta import linear_cross_entropy as lce_meta

        monkeypatch.setattr(lce_meta, "IN_GRADIENT_MIN_LOGITS", 0)


@pytest.fixture
def real_in_gradient_threshold():
    """Requested by a test that needs the library's own ``IN_GRADIENT_MIN_LOGITS`` (not lowered)."""


@pytest.fixture
def poisoned_empty():
    """While the test runs, ``torch.empty`` / ``new_empty`` fill their memory (0xFF bytes, NaN floats;
    torch's deterministic mode): an output byte a kernel leaves unwritten then fails a byte comparison
    instead of passing on memory that happened to hold zeros."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture
def kernel_device() -> str:
    """Where the Triton kernels run: CUDA on a GPU machine, CPU tensors under the interpreter."""
    return "cuda" if HAS_CUDA and not INTERPRET else "cpu"


@pytest.fixture
def spy_launchers(monkeypatch) -> list[str]:
    """Names of the Triton launchers (``launch_*`` of the CE, MXFP8 and softmax kernel modules) that the
    ops dispatch to, one entry per call."""
    from lowp_ops.kernels import cross_entropy, mxfp8, softmax  # here: the CPU suite never imports triton

    calls = []
    for module in (cross_entropy, mxfp8, softmax):
        for name in dir(module):
            if name.startswith("launch_"):
                launcher = getattr(module, name)
                monkeypatch.setattr(
                    module,
                    name,
                    lambda *args, _launch=launcher, _name=name: calls.append(_name) or _launch(*args),
                )
    return calls
