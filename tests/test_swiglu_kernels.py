"""Triton SwiGLU forward and dGLU kernels against the pure-PyTorch reference.

``interp``: the kernels on CPU tensors under TRITON_INTERPRET=1 against the CPU reference. numpy's
``exp`` differs from torch's by an fp32 ulp now and then, so h and dc may differ by one bf16 ulp and
dprobs / amax by fp32 rounding. ``gpu``: against the same reference run on CUDA, where the kernels use
torch's ``expf`` and IEEE division without FMA contraction: h, dc and amax must be bit-identical.
Either way the contract ``bf16(amax) == max |dc|`` per expert holds exactly for the kernel's own dc.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_suites import SUITES, kernel_property_settings

from lowp_ops.kernels import swiglu as kernels
from lowp_ops.reference import swiglu as reference

property_settings = kernel_property_settings(8)


def make(tokens: int, ffn: int, seed: int, device: str, probs_dtype=torch.float32, grad_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    c = (torch.randn(tokens, 2 * ffn, generator=gen) * 3).bfloat16()
    probs = torch.rand(tokens, generator=gen).to(probs_dtype)
    grad = torch.randn(tokens, ffn, generator=gen).to(grad_dtype)
    return c.to(device), probs.to(device), grad.to(device)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2**-126))) - 7)


def assert_close_or_identical(got: torch.Tensor, expected: torch.Tensor, exact: bool, name: str) -> None:
    got, expected = got.cpu(), expected.cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape, name
    if exact:
        differ = got.view(torch.int16) != expected.view(torch.int16)
        assert not differ.any(), f"{name}: {differ.sum().item()} of {got.numel()} values differ"
    else:
        error = (got.float() - expected.float()).abs()
        assert (error <= bf16_ulp(expected)).all(), f"{name}: max error {error.max().item()}"
        assert (got != expected).float().mean() < 0.02, name


def assert_amax_is_the_max_of_dc(dc: torch.Tensor, amax: torch.Tensor, split_sizes: list[int]) -> None:
    start = 0
    for expert, size in enumerate(split_sizes):
        rows = dc[start : start + size]
        expected = rows.float().abs().max() if size else torch.tensor(0.0)
        assert amax[expert].to(dc.dtype).float() == expected, f"expert {expert}"
        start += size


def check_kernels(tokens, ffn, split_sizes, interleave, probs_dtype, grad_dtype, seed, device):
    c, probs, grad = make(tokens, ffn, seed, device, probs_dtype, grad_dtype)
    splits = torch.tensor(split_sizes, device=device)
    exact = device == "cuda"  # the reference runs where the kernel runs: CUDA torch on the GPU
    h = kernels.launch_swiglu_fwd(c, probs, interleave)
    h_ref = reference.swiglu_fwd(c, probs, interleave)
    assert_close_or_identical(h, h_ref, exact, "h")

    dc, dprobs, amax = kernels.launch_dglu(grad, c, probs, splits, interleave)
    dc_ref, dprobs_ref, amax_ref = reference.dglu(grad, c, probs, splits, interleave)
    assert_close_or_identical(dc, dc_ref, exact, "dc")
    assert dprobs.dtype == amax.dtype == torch.float32
    # dprobs: fp32 sums in another order; bound by the fp32 rounding of the sum of |terms|.
    g, (gate, linear) = grad.float(), reference.split_glu(c, interleave)
    magnitude = (g * gate * reference.sigmoid(gate) * linear).abs().sum(dim=1)
    assert ((dprobs - dprobs_ref).abs() <= 1e-5 * magnitude + 1e-30).all()
    if exact:
        assert torch.equal(amax, amax_ref)
    else:
        assert torch.allclose(amax, amax_ref, rtol=2e-6, atol=0)
    assert_amax_is_the_max_of_dc(dc.cpu(), amax.cpu(), split_sizes)


def splits_of(tokens: int, experts: int, draw) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, tokens), min_size=experts - 1, max_size=experts - 1)))
    bounds = [0, *cuts, draw(st.integers(max(cuts, default=0), tokens))]
    return [b - a for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("suite", SUITES)
@property_settings
@given(
    data=st.data(),
    interleave=st.sampled_from([0, 32]),
    probs_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    grad_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    experts=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernels_match_reference(
    suite, kernel_device, data, interleave, probs_dtype, grad_dtype, experts, seed
):
    """Uneven splits with empty experts, rows past the last expert, partial tiles."""
    max_tokens = 40 if suite == "interp" else 3000
    tokens = data.draw(st.integers(1, max_tokens), label="tokens")
    ffn_choices = [32, 64, 96] if interleave else [1, 24, 32, 100]
    if suite == "gpu":
        ffn_choices += [1536, 2048 + 32]
    ffn = data.draw(st.sampled_from(ffn_choices), label="ffn")
    split_sizes = splits_of(tokens, experts, data.draw)
    check_kernels(tokens, ffn, split_sizes, interleave, probs_dtype, grad_dtype, seed, kernel_device)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("interleave", [0, 32])
def test_kernels_on_even_tiles_and_an_empty_expert(suite, kernel_device, interleave):
    """Shapes where every tile is in bounds (the maskless path)."""
    check_kernels(64, 256, [16, 0, 40, 8], interleave, torch.float32, torch.bfloat16, 3, kernel_device)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("config", [(4, 32, 2), (16, 64, 4), (2, 32, 1)])
@pytest.mark.parametrize("interleave", [0, 32])
def test_dglu_launch_configs_agree(suite, kernel_device, config, interleave):
    """Other tile shapes: dc and the amaxes bit-identical to the default's, dprobs within the fp32 bound."""
    tokens, ffn, split_sizes = 40, 96 if interleave else 100, [8, 0, 25, 7]
    c, probs, grad = make(tokens, ffn, 9, kernel_device, torch.float32, torch.bfloat16)
    splits = torch.tensor(split_sizes, device=kernel_device)
    dc, dprobs, amax = kernels.launch_dglu(grad, c, probs, splits, interleave, config)
    dc_one, dprobs_one, amax_one = kernels.launch_dglu(grad, c, probs, splits, interleave)
    assert torch.equal(dc, dc_one) and torch.equal(amax, amax_one)
    g, (gate, linear) = grad.float(), reference.split_glu(c, interleave)
    magnitude = (g * gate * reference.sigmoid(gate) * linear).abs().sum(dim=1)
    assert ((dprobs - dprobs_one).abs() <= 1e-5 * magnitude + 1e-30).all()


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("even", [True, False])
def test_dglu_rows_of_no_expert_get_zeros_whatever_they_hold(suite, kernel_device, even):
    """Rows past the last end hold NaN, Inf and large values (an unwritten GEMM output): dc and dprobs
    are 0 there, the other rows and the amaxes as without those rows."""
    tokens, ffn = (64, 256) if even else (45, 100)
    c, probs, grad = make(tokens, ffn, 11, kernel_device)
    live = 37
    grad[live:] = 3e4
    grad[live + 1, :5], c[live + 2, :7], probs[live + 3] = float("nan"), float("nan"), float("inf")
    splits = torch.tensor([20, 0, 17], device=kernel_device)
    dc, dprobs, amax = kernels.launch_dglu(grad, c, probs, splits, 0)
    dc_live, dprobs_live, amax_live = kernels.launch_dglu(grad[:live], c[:live], probs[:live], splits, 0)
    assert torch.equal(dc[live:], torch.zeros_like(dc[live:]))
    assert torch.equal(dprobs[live:], torch.zeros_like(dprobs[live:]))
    assert torch.equal(dc[:live], dc_live) and torch.equal(amax, amax_live)
    assert torch.equal(dprobs[:live], dprobs_live)
    dc_ref, _, amax_ref = reference.dglu(grad, c, probs, splits, 0)
    assert_close_or_identical(dc, dc_ref, kernel_device == "cuda", "dc")
    assert torch.allclose(amax, amax_ref, rtol=2e-6, atol=0)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("even", [True, False])
def test_swiglu_rows_past_the_last_end_are_zero_whatever_they_hold(suite, kernel_device, even):
    """With ``ends``, rows at or past ``ends[-1]`` hold NaN, Inf and large values (the last expert's product
    on the extended ends): h is +0 there, the other rows as without ``ends``, and the reference agrees."""
    tokens, ffn = (64, 256) if even else (45, 100)
    c, probs, _ = make(tokens, ffn, 12, kernel_device)
    live = 37
    c[live:] = 3e4
    c[live + 1, :5], probs[live + 3] = float("nan"), float("inf")
    ends = torch.tensor([20, 20, live], dtype=torch.int32, device=kernel_device)
    h = kernels.launch_swiglu_fwd(c, probs, 0, ends)
    assert torch.equal(h[live:].view(torch.int16), torch.zeros_like(h[live:]).view(torch.int16))
    assert torch.equal(h[:live], kernels.launch_swiglu_fwd(c, probs, 0)[:live])
    assert_close_or_identical(h, reference.swiglu_fwd(c, probs, 0, ends), kernel_device == "cuda", "h")


@pytest.mark.parametrize("suite", SUITES)
def test_kernels_handle_no_tokens(suite, kernel_device):
    c, probs, grad = make(0, 32, 0, kernel_device)
    assert kernels.launch_swiglu_fwd(c, probs, 0).shape == (0, 32)
    dc, dprobs, amax = kernels.launch_dglu(grad, c, probs, torch.tensor([0, 0], device=kernel_device), 0)
    assert dc.shape == (0, 64) and dprobs.shape == (0,)
    assert torch.equal(amax.cpu(), torch.zeros(2))


@pytest.mark.parametrize("suite", SUITES)
def test_dglu_kernel_reads_strided_rows(suite, kernel_device):
    c, probs, grad = make(24, 64, 5, kernel_device)
    wide_grad = torch.zeros(24, 128, dtype=grad.dtype, device=kernel_device)
    wide_grad[:, :64] = grad
    one_expert = torch.tensor([24], device=kernel_device)
    got = kernels.launch_dglu(wide_grad[:, :64], c.t().contiguous().t(), probs, one_expert, 0)
    expected = kernels.launch_dglu(grad, c, probs, one_expert, 0)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [0, 32])
def test_kernels_match_reference_at_moe_shape(interleave):
    """T=16384 tokens, F=1536, 8 experts with one empty (the benchmark shape)."""
    splits = [2048, 4096, 0, 1024, 3072, 2048, 2560, 1536]
    check_kernels(16384, 1536, splits, interleave, torch.float32, torch.bfloat16, 11, "cuda")
