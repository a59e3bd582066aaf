"""``scripts/compare_bytes.py``: the bit comparison it rests on, and the shared calls of
``scripts/public_calls.py`` (every kernel family present, the same bytes on every run)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from compare_bytes import same_bytes
from public_calls import run_public_calls


def test_same_bytes_compares_bits_not_values():
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bytes(nan, nan.clone())  # NaN != NaN as values, equal as bits
    assert not same_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal as values
    assert not same_bytes(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not same_bytes(torch.zeros(2), torch.zeros(1, 2))
    assert same_bytes(torch.zeros(0, 3), torch.zeros(0, 3))
    transposed = torch.arange(6.0).reshape(2, 3).t()
    assert same_bytes(transposed, transposed.contiguous())
    assert same_bytes(torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16))
    assert not same_bytes(torch.ones(3, dtype=torch.bfloat16), torch.full((3,), 1.0078125).bfloat16())


def test_public_calls_cover_every_family_and_repeat_their_bytes():
    first, second = run_public_calls("cpu"), run_public_calls("cpu")
    families = {name.split(" ")[0] for name in first}
    assert {
        "mxfp8_quantize", "mxfp8_dequantize", "cross_entropy", "cross_entropy_with_mxfp8_grad", "softmax",
        "log_softmax", "logsumexp", "rms_norm", "nvfp4_quantize", "nvfp4_dequantize",
        "nvfp4_group_quantize", "grouped_swiglu_mlp", "linear_cross_entropy",
    } <= families  # fmt: skip
    assert first.keys() == second.keys()
    assert all(same_bytes(first[name], second[name]) for name in first)
    # Gradients are kept: the grouped MLP's four, for each recipe.
    assert sum(name.startswith("grouped_swiglu_mlp nvfp4") for name in first) == 5
