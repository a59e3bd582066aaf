"""The chunked cross-entropy forward and the single pass (``kernels/cross_entropy_single_pass.py``).

- ``interp``: the chunked forward (several chunks per row, partial row blocks and tiles) against the
  one-row-per-program forward, and the two-launch form of the single-pass ops (what CPU tensors run)
  against the forward and backward ops they stand for.
- ``gpu``: the cooperative kernel's bytes (the gradient in the logits' dtype, written over the logits,
  and the MXFP8 payload) equal the two-pass path's (the forward's statistics, then
  ``cross_entropy_bwd`` / ``cross_entropy_bwd_mxfp8``), with masked rows, ignored rows, label smoothing,
  per-row ``grad_rows``, large magnitudes and several chunk widths.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from lowp_ops.kernels import cross_entropy as ce_kernels
from lowp_ops.kernels import cross_entropy_single_pass as single_pass

NEG_INF = float("-inf")
IGNORE = -100


def inputs(n_rows: int, n_cols: int, device: str, seed: int = 0, offset: float = 0.0):
    """bf16 logits with sparse -inf, a row masked over its first 300 columns (and, with enough columns,
    its first 5000), an ignored all -inf row, every 7th row ignored; int64 targets; fp32 grad_rows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n_rows, n_cols, generator=gen, device=device) * 4 + offset
    logits[torch.rand(n_rows, n_cols, generator=gen, device=device) < 0.05] = NEG_INF
    logits[0, : min(n_cols - 1, 5000 if n_cols > 10000 else 300)] = NEG_INF
    target = torch.randint(0, n_cols, (n_rows,), generator=gen, device=device)
    target[::7] = IGNORE
    if n_rows > 3:
        logits[3] = NEG_INF
        target[3] = IGNORE
    grad_rows = torch.rand(n_rows, generator=gen, device=device) + 0.5
    return logits.to(torch.bfloat16), target, grad_rows


def same_outcome(a: torch.Tensor, b: torch.Tensor, rtol: float = 2e-6) -> None:
    """Equal within fp32 roundoff, with the same inf and NaN positions."""
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a[a.isinf()], b[b.isinf()])
    finite = a.isfinite()
    torch.testing.assert_close(a[finite], b[finite], rtol=rtol, atol=2e-6)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


# ------------------------------------------------------------------------------------------- interpreter

INTERP_CASES = [
    # rows, cols, chunk_cols, label_smoothing, z_loss, softcap
    (40, 300, 128, 0.0, 0.0, 0.0),
    (64, 512, 128, 0.1, 0.0, 0.0),
    (33, 700, 256, 0.1, 1e-3, 0.0),
    (32, 384, 128, 0.0, 0.0, 5.0),
    (5, 1000, None, 0.2, 0.0, 0.0),
]


@pytest.mark.interp
@pytest.mark.parametrize("case", INTERP_CASES)
def test_chunked_forward_matches_the_row_forward(case):
    rows, cols, chunk_cols, smoothing, z_loss, softcap = case
    logits, target, _ = inputs(rows, cols, "cpu")
    args = (logits, target, smoothing, IGNORE)
    want_loss, want_stats = ce_kernels.launch_cross_entropy_fwd(*args, None, z_loss, softcap, block=64)
    loss, stats = single_pass.launch_cross_entropy_fwd_chunks(*args, z_loss, softcap, chunk_cols=chunk_cols)
    same_outcome(loss, want_loss)
    same_outcome(stats, want_stats)


@pytest.mark.interp
def test_chunked_forward_at_large_offsets():
    """The partials' shift keeps the digits: logits near 1e4 and 1e8 give the offset-free losses."""
    base, target, _ = inputs(40, 300, "cpu")
    base = base.float()
    loss, _ = single_pass.launch_cross_entropy_fwd_chunks(base, target, 0.1, IGNORE, chunk_cols=128)
    for offset in (1e4, 1e8):
        shifted, _ = single_pass.launch_cross_entropy_fwd_chunks(
            base + offset, target, 0.1, IGNORE, chunk_cols=128
        )
        rows_ok = loss.isfinite()
        # Adding the offset rounds the fp32 logits themselves: the tolerance is that rounding.
        torch.testing.assert_close(shifted[rows_ok], loss[rows_ok], rtol=0, atol=offset * 2**-23 * 8)


@pytest.mark.interp
def test_two_launch_forms_equal_the_ops_they_stand_for():
    logits, target, grad_rows = inputs(40, 300, "cpu")
    loss, stats = ce_kernels.launch_cross_entropy_fwd(logits, target, 0.1, IGNORE)
    payload = ce_kernels.launch_cross_entropy_bwd_mxfp8(
        logits, target, stats, grad_rows, 0.1, IGNORE, "e4m3", True, True, "compact"
    )
    fused = ce_kernels.launch_cross_entropy_fwd_bwd_mxfp8(
        logits, target, grad_rows, 0.1, IGNORE, "e4m3", True, True, "compact"
    )
    for got, want in zip(fused, (loss, stats, *payload), strict=True):
        assert torch.equal(bits(got), bits(want))
    dlogits = ce_kernels.launch_cross_entropy_bwd(logits, target, stats, grad_rows, 0.1, IGNORE)
    overwritten = logits.clone()
    ce_kernels.launch_cross_entropy_fwd_overwrite(overwritten, target, grad_rows, 0.1, IGNORE)
    assert torch.equal(bits(overwritten), bits(dlogits))


# ------------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [(4096, 129280), (1000, 50304), (77, 32000), (256, 4224), (64, 262144)]
GPU_OPTIONS = [  # label_smoothing, z_loss, softcap
    (0.0, 0.0, 0.0),
    (0.1, 0.0, 0.0),
    (0.1, 1e-4, 30.0),
]


def _two_pass_and_single_pass(shape, options, chunk_cols=None, offset=0.0, **mxfp8):
    logits, target, grad_rows = inputs(*shape, "cuda", seed=shape[0], offset=offset)
    smoothing, z_loss, softcap = options
    stats = ce_kernels.launch_cross_entropy_fwd(logits, target, smoothing, IGNORE, None, z_loss, softcap)[1]
    feature = (None, z_loss, softcap)
    if mxfp8:
        fmt = (mxfp8["fp8_dtype"], mxfp8["rowwise"], mxfp8["columnwise"], mxfp8["scale_layout"])
        want = ce_kernels.launch_cross_entropy_bwd_mxfp8(
            logits, target, stats, grad_rows, smoothing, IGNORE, *fmt, 0, 0, *feature
        )
        got = ce_kernels.launch_cross_entropy_fwd_bwd_mxfp8(
            logits, target, grad_rows, smoothing, IGNORE, *fmt, *feature, chunk_cols=chunk_cols
        )[2:]
        return want, got
    want = ce_kernels.launch_cross_entropy_bwd(
        logits, target, stats, grad_rows, smoothing, IGNORE, 0, 0, *feature
    )
    got = logits.clone()
    _, got_stats = ce_kernels.launch_cross_entropy_fwd_overwrite(
        got, target, grad_rows, smoothing, IGNORE, *feature, chunk_cols=chunk_cols
    )
    assert torch.equal(bits(got_stats), bits(stats))
    return (want,), (got,)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("options", GPU_OPTIONS)
def test_gpu_single_pass_gradient_in_place_equals_the_two_pass_bytes(shape, options):
    want, got = _two_pass_and_single_pass(shape, options)
    assert torch.equal(bits(got[0]), bits(want[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("options", GPU_OPTIONS[:2])
@pytest.mark.parametrize("fp8_dtype, scale_layout", [("e4m3", "compact"), ("e5m2", "swizzled")])
def test_gpu_single_pass_mxfp8_equals_the_two_pass_bytes(shape, options, fp8_dtype, scale_layout):
    want, got = _two_pass_and_single_pass(
        shape, options, fp8_dtype=fp8_dtype, rowwise=True, columnwise=True, scale_layout=scale_layout
    )
    for w, g in zip(want, got, strict=True):
        assert torch.equal(bits(g), bits(w))


@pytest.mark.gpu
@pytest.mark.parametrize("copies", [(True, False), (False, True)])
@pytest.mark.parametrize("chunk_cols", [1024, 4096])
def test_gpu_single_pass_one_copy_and_chunk_widths(copies, chunk_cols):
    want, got = _two_pass_and_single_pass(
        (512, 32768), (0.1, 0.0, 0.0), chunk_cols, fp8_dtype="e4m3", rowwise=copies[0], columnwise=copies[1],
        scale_layout="compact",
    )  # fmt: skip
    for w, g in zip(want, got, strict=True):
        assert torch.equal(bits(g), bits(w))


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [1e4, -3e5])
def test_gpu_single_pass_at_large_magnitudes(offset):
    want, got = _two_pass_and_single_pass((256, 32000), (0.1, 0.0, 0.0), offset=offset)
    assert torch.equal(bits(got[0]), bits(want[0]))


@pytest.mark.gpu
def test_gpu_single_pass_runs_back_to_back_on_many_row_blocks():
    """Many row blocks per SM (the tickets order them): 16384 x 32768, chunks of 1024 columns."""
    want, got = _two_pass_and_single_pass((16384, 32768), (0.0, 0.0, 0.0), 1024)
    assert torch.equal(bits(got[0]), bits(want[0]))
