"""The package as pip and a reader see it: one version, ``py.typed``, the license, dependencies that a
CPU-only install does not need left out, and ``from lowp_ops.<module> import *`` giving exactly the
documented names of each public module (no ``torch``, ``math`` or helpers)."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowp_ops

ROOT = Path(__file__).resolve().parents[1]

# The public names of each public module, as the README and the docstrings document them.
PUBLIC_NAMES: dict[str, set[str]] = {
    "lowp_ops": {
        "MXFP8Tensor",
        "NVFP4GroupedTensor",
        "NVFP4Tensor",
        "cross_entropy",
        "cross_entropy_with_mxfp8_grad",
        "dglu",
        "grouped_swiglu_mlp",
        "linear_cross_entropy",
        "log_softmax",
        "logsumexp",
        "mxfp8_dequantize",
        "mxfp8_quantize",
        "nn",
        "nvfp4_dequantize",
        "nvfp4_group_quantize",
        "nvfp4_quantize",
        "rms_norm",
        "softmax",
        "swiglu",
    },
    "lowp_ops.nn": {"CrossEntropyLoss", "GroupedSwiGLUMLP", "LinearCrossEntropyLoss", "RMSNorm"},
    "lowp_ops.functional": {
        "cross_entropy",
        "cross_entropy_with_mxfp8_grad",
        "dglu",
        "log_softmax",
        "logsumexp",
        "rms_norm",
        "softmax",
        "swiglu",
    },
    "lowp_ops.mxfp8": {"mxfp8_dequantize", "mxfp8_quantize"},
    "lowp_ops.nvfp4": {"nvfp4_dequantize", "nvfp4_group_quantize", "nvfp4_quantize"},
    "lowp_ops.moe": {"grouped_swiglu_mlp"},
    "lowp_ops.linear_cross_entropy": {"linear_cross_entropy"},
    "lowp_ops.losses": {"CrossEntropyLoss", "LinearCrossEntropyLoss"},
    "lowp_ops.formats": {
        "E2M1_MAGNITUDES",
        "E8M0_EXPONENT_BIAS",
        "E8M0_NAN",
        "F4E2M1_MAX",
        "F8E4M3_MAX",
        "F8E5M2_MAX",
        "FP8_DTYPES",
        "MXFP8Tensor",
        "MXFP8_BLOCK_SIZE",
        "NVFP4GroupedTensor",
        "NVFP4Tensor",
        "NVFP4_BLOCK_SIZE",
        "NVFP4_GLOBAL_SCALE_NUMERATOR",
        "RHT_SIGN_MASK",
        "SCALE_LAYOUTS",
        "SCALE_TILE_COLS",
        "SCALE_TILE_ROWS",
    },
    "lowp_ops.distributed": {
        "linear_vocab_parallel_cross_entropy_rows",
        "linear_vocab_parallel_cross_entropy_stats",
        "vocab_parallel_cross_entropy_rows",
        "vocab_parallel_cross_entropy_stats",
    },
    "lowp_ops.integrations.transformers": {"apply_lowp_ops"},
}


def star_import(module_name: str) -> set[str]:
    """The names ``from <module_name> import *`` binds in a fresh namespace."""
    namespace: dict[str, object] = {}
    exec(f"from {module_name} import *", namespace)
    return set(namespace) - {"__builtins__"}


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_star_import_gives_exactly_the_documented_names(module_name):
    assert star_import(module_name) == PUBLIC_NAMES[module_name]


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_every_exported_function_and_class_has_a_docstring(module_name):
    module = importlib.import_module(module_name)
    undocumented = [
        name
        for name in module.__all__
        if (inspect.isfunction(getattr(module, name)) or inspect.isclass(getattr(module, name)))
        and not inspect.getdoc(getattr(module, name))
    ]
    assert not undocumented


def test_nn_does_not_leak_its_imports():
    exported = star_import("lowp_ops.nn")
    assert not exported & {"math", "torch", "require", "RECIPES", "grouped_swiglu_mlp"}


def test_version_is_defined_once_and_matches_the_installed_metadata():
    version = lowp_ops.__version__
    assert isinstance(version, str) and version[:1].isdigit(), version
    pyproject = (ROOT / "pyproject.toml").read_text()
    # pyproject reads the version from the package: no second literal to drift.
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "lowp_ops.__version__" }' in pyproject
    assert f'"{version}"' not in pyproject
    try:
        installed = importlib.metadata.version("lowp_ops")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("lowp_ops is imported from the source tree, not installed")
    if Path(lowp_ops.__file__).resolve().parent != ROOT / "lowp_ops":
        pytest.skip("the installed lowp_ops is not this source tree")
    assert installed == version


def test_py_typed_and_license_ship_with_the_package():
    assert (ROOT / "lowp_ops" / "py.typed").is_file()
    assert "MIT License" in (ROOT / "LICENSE").read_text()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python >= 3.11")
def test_dependencies_and_extras():
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["package-data"]["lowp_ops"] == ["py.typed"]
    meta = project["project"]
    assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"]
    assert meta["authors"] and meta["classifiers"]
    assert meta["urls"] and all(url.startswith("https://") for url in meta["urls"].values())

    def names(requirements: list[str]) -> set[str]:
        return {Requirement(req).name for req in requirements}

    extras = meta["optional-dependencies"]
    # A CPU-only install needs torch alone: numpy serves the tests, triton the kernels (CUDA builds of
    # torch bring their own) and the interpreter tests.
    assert names(meta["dependencies"]) == {"torch"}
    assert {"numpy", "triton", "pytest", "hypothesis"} <= names(extras["test"])
    assert "ruff" in names(extras["dev"]) and "ruff" not in names(extras["test"])
    assert {"tqdm", "matplotlib"} <= names(extras["examples"])
    # The tests run the example, so the test extra installs the examples extra.
    assert "lowp_ops[examples]" in extras["test"]


def test_the_cpu_path_does_not_import_triton(tmp_path):
    """Import the package and run a quantize, a softmax and a loss on CPU with triton made unimportable."""
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, lowp_ops\n"
        "x = torch.randn(4, 64)\n"
        "lowp_ops.mxfp8_quantize(x)\n"
        "lowp_ops.softmax(x)\n"
        "lowp_ops.cross_entropy(x, torch.tensor([0, 1, 2, 3]))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOWP_OPS_CPU_KERNELS")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
