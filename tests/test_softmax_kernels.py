"""The Triton softmax / log-softmax / logsumexp kernels against the pure-PyTorch reference (fp32 formula
in float64, one ulp of the output dtype plus fp32 roundoff), and the public softmax through the kernels.

- ``interp``: CPU tensors under ``TRITON_INTERPRET=1`` (small shapes; run with
  ``TRITON_INTERPRET=1 LOWP_OPS_CPU_KERNELS=triton pytest -m interp``).
- ``gpu``: CUDA at real sizes (up to 4096 x 32000 bf16, 64 x 129280).
"""

from __future__ import annotations

import math

import pytest
import torch
from ce_softmax_oracles import FP32_UNIT, assert_close_fp32, assert_within_ulps, masked_softmax_inputs

import lowp_ops
from lowp_ops.reference import softmax as softmax_ref

triton = pytest.importorskip("triton")
from lowp_ops.kernels import softmax as softmax_kernels  # noqa: E402

NEG_INF = float("-inf")


def row_scales(x: torch.Tensor):
    x64 = x.double()
    lse = torch.logsumexp(x64, dim=1, keepdim=True)
    finite = lambda t: torch.where(torch.isfinite(t), t.abs(), 0.0)
    p = torch.where(torch.isfinite(lse), torch.exp(x64 - lse), 0.0).nan_to_num(0.0)
    return p, 8 * FP32_UNIT * (2 + finite(x64) + finite(lse)), finite(lse)


def check_softmax_kernels(x: torch.Tensor):
    n_cols = x.shape[1]
    p, rel, _ = row_scales(x)
    lse = softmax_kernels.launch_logsumexp(x)
    finite_max = torch.where(torch.isfinite(x.double()), x.double().abs(), 0.0).amax(dim=1)
    assert_close_fp32(
        lse,
        softmax_ref.logsumexp(x).double(),
        rtol=1e-6,
        atol=8 * FP32_UNIT * (2 + finite_max + math.log(n_cols)),
        what="logsumexp",
    )
    gen = torch.Generator(device=x.device).manual_seed(7)
    dy = torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype)
    dy64 = dy.double()
    log_n = 2 + math.log2(n_cols)
    for log in (False, True):
        for masked_rows in ("nan", "zero"):
            out = softmax_kernels.launch_softmax_fwd(x, log, masked_rows)
            assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
            # Same fp32 formula, different reduction order and exp: fp32 roundoff, then one ulp of dtype.
            want = softmax_fwd_fp32(x, log, masked_rows)
            assert_within_ulps(out, want, slack=rel if log else p * rel, what=f"softmax_fwd log={log}")
        # Backward from the same (rounded) output: only the reduction order and exp differ.
        got = softmax_kernels.launch_softmax_bwd(out, dy, log)
        want = softmax_bwd_fp32(out, dy, log)
        y64 = out.double()
        if log:
            e_y = torch.exp(y64).nan_to_num(0.0)
            slack = 4 * FP32_UNIT * (dy64.abs() + e_y * log_n * dy64.abs().sum(1, keepdim=True))
        else:
            y = y64.nan_to_num(0.0)
            weighted = (dy64.abs() * y).sum(1, keepdim=True)
            slack = 4 * FP32_UNIT * y * (dy64.abs() + log_n * weighted)
        assert_within_ulps(got, want, slack=slack, what=f"softmax_bwd log={log}")


def softmax_fwd_fp32(x, log, masked_rows):
    """The reference's fp32 values before rounding to x's dtype (float64 for comparing)."""
    lse = softmax_ref.masked_safe_logsumexp(x).unsqueeze(1)
    values = x.float() - lse if log else torch.exp(x.float() - lse)
    if masked_rows == "zero":
        values = torch.where(lse == NEG_INF, NEG_INF if log else 0.0, values)
    return values.double()


def softmax_bwd_fp32(out, dy, log):
    return softmax_ref.softmax_bwd(out.float(), dy.float(), log).double()


@pytest.mark.interp
@pytest.mark.parametrize(
    ("n_rows", "n_cols", "dtype"),
    [
        (5, 300, torch.float32),
        (4, softmax_kernels.MAX_BLOCK, torch.bfloat16),  # exactly one block
        (3, softmax_kernels.MAX_BLOCK + 50, torch.float32),  # two blocks, the first all -inf in row 0
        (3, 2 * softmax_kernels.MAX_BLOCK + 9, torch.float16),
        (40, 37, torch.bfloat16),
    ],
)
def test_interp_softmax_kernels_match_reference(n_rows, n_cols, dtype):
    check_softmax_kernels(masked_softmax_inputs(n_rows, n_cols, dtype, "cpu", softmax_kernels.MAX_BLOCK))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n_rows", "n_cols", "dtype"),
    [
        (4096, 32000, torch.bfloat16),
        (64, 129280, torch.bfloat16),
        (1000, 50257, torch.float32),
        (333, 4096, torch.float16),
        (7, 77, torch.bfloat16),
    ],
)
def test_gpu_softmax_kernels_match_reference(n_rows, n_cols, dtype):
    check_softmax_kernels(masked_softmax_inputs(n_rows, n_cols, dtype, "cuda", softmax_kernels.MAX_BLOCK))


@pytest.mark.interp
def test_interp_public_softmax_runs_the_kernels(spy_launchers):
    assert lowp_ops.library.cpu_runs_triton(), "the interp suite needs LOWP_OPS_CPU_KERNELS=triton"
    x = masked_softmax_inputs(
        6, softmax_kernels.MAX_BLOCK + 50, torch.float32, "cpu", softmax_kernels.MAX_BLOCK
    )
    leaf = x.clone().requires_grad_()
    out = lowp_ops.softmax(leaf, masked_rows="zero")
    out.backward(torch.ones_like(out))
    assert {"launch_softmax_fwd", "launch_softmax_bwd"} <= set(spy_launchers)
    want = torch.softmax(x.double(), -1).nan_to_num(0.0)
    p, rel, _ = row_scales(x)
    assert_within_ulps(out.detach(), want, slack=p * rel, what="softmax")
    assert (leaf.grad[1] == 0).all()
    lse = lowp_ops.logsumexp(x)
    assert "launch_logsumexp" in spy_launchers
    torch.testing.assert_close(lse.double(), torch.logsumexp(x.double(), -1), rtol=1e-6, atol=1e-5)
