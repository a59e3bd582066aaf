"""Triton kernels of the cross-entropy loss features (z-loss, final-logit soft-capping) against the
references (``interp``: CPU tensors under the interpreter; ``gpu``: CUDA at real sizes), and the MXFP8
byte contract with the features on."""

from __future__ import annotations

import pytest
import torch

from lowp_ops.reference import cross_entropy as ce_ref
from lowp_ops.reference import vocab_parallel as vp_ref

IGNORE = -100
# (z_loss, softcap, label_smoothing, class weights)
COMBOS = [(1e-2, 0.0, 0.0, False), (0.0, 4.0, 0.1, False), (1e-2, 4.0, 0.1, True), (1e-3, 2.0, 0.0, True)]


def inputs(rows, vocab, device, dtype=torch.bfloat16, seed=0, masked_cols=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4 + 1
    logits[:, :masked_cols] = float("-inf")  # a leading masked block (whole forward blocks)
    target = masked_cols + torch.randint(0, vocab - masked_cols, (rows,), generator=gen)
    target[::7] = IGNORE
    weight = torch.rand(vocab, generator=gen) + 0.5
    grad_rows = torch.rand(rows, generator=gen) + 0.5
    return logits.to(dtype).to(device), target.to(device), weight.to(device), grad_rows.to(device)


def check_fwd_bwd(rows, vocab, device, z, cap, ls, weighted, masked_cols=0, block=None):
    from lowp_ops.kernels import cross_entropy as ce_kernels

    logits, target, weight, grad_rows = inputs(rows, vocab, device, masked_cols=masked_cols)
    weight = weight if weighted else None
    args = (logits, target, ls, IGNORE, weight, z, cap)
    loss, stats = ce_kernels.launch_cross_entropy_fwd(*args, block=block)
    want_loss, want_stats = ce_ref.cross_entropy_fwd(*[a.cpu() if torch.is_tensor(a) else a for a in args])
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(stats.cpu(), want_stats, rtol=2e-6, atol=2e-5)
    valid = target != IGNORE
    # Smoothing spreads mass over the masked (-inf) classes too: +inf, as torch's loss.
    expected_inf = masked_cols > 0 and ls > 0
    assert (loss[valid] == float("inf")).all() if expected_inf else torch.isfinite(loss).all()
    bwd = (logits, target, stats, grad_rows, ls, IGNORE, 0, 0, weight, z, cap)
    grad = ce_kernels.launch_cross_entropy_bwd(*bwd)
    want = ce_ref.cross_entropy_grad_fp32(*[a.cpu() if torch.is_tensor(a) else a for a in bwd])
    # Within a bf16 rounding of the fp32 reference (the tanh differs by fp32 roundoff).
    torch.testing.assert_close(grad.cpu().float(), want, rtol=1e-2, atol=1e-5)
    if masked_cols:
        assert torch.equal(grad[:, :masked_cols].float().cpu(), torch.zeros(rows, masked_cols))
    return logits, target, stats, grad_rows, weight, grad


def check_mxfp8_contract(rows, vocab, device, z, cap, ls, weighted, fp8_dtype, scale_layout, **launch):
    from lowp_ops.kernels import cross_entropy as ce_kernels
    from lowp_ops.kernels import mxfp8 as mxfp8_kernels

    logits, target, stats, grad_rows, weight, grad = check_fwd_bwd(rows, vocab, device, z, cap, ls, weighted)
    payload = ce_kernels.launch_cross_entropy_bwd_mxfp8(
        logits,
        target,
        stats,
        grad_rows,
        ls,
        IGNORE,
        fp8_dtype,
        True,
        True,
        scale_layout,
        0,
        0,
        weight,
        z,
        cap,
        **launch,
    )
    want = mxfp8_kernels.launch_mxfp8_quantize(grad, fp8_dtype, True, True, scale_layout)
    for name, got, expected in zip(
        ("row_data", "row_scale", "col_data", "col_scale"), payload, want, strict=True
    ):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name


@pytest.mark.interp
@pytest.mark.parametrize(("z", "cap", "ls", "weighted"), COMBOS)
def test_interp_fwd_bwd_with_features_match_reference(z, cap, ls, weighted):
    check_fwd_bwd(37, 200, "cpu", z, cap, ls, weighted)


@pytest.mark.interp
@pytest.mark.parametrize("cap", [0.05, 1.0, 30.0, 1e3, 1e5, 1e8, 1e30])
def test_interp_softcap_matches_float64_at_any_cap(cap):
    # Large caps put x / c where 1 - exp(-2|y|) cancels: the interpreter's tanh must not lose it.
    from lowp_ops.kernels import cross_entropy as ce_kernels

    logits, target, _, _ = inputs(16, 96, "cpu", dtype=torch.float32)
    loss, _ = ce_kernels.launch_cross_entropy_fwd(logits, target, 0.0, IGNORE, None, 0.0, cap)
    capped = torch.tanh(logits.double() / cap) * cap
    want = torch.nn.functional.cross_entropy(capped, target, ignore_index=IGNORE, reduction="none")
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.interp
def test_interp_softcap_keeps_leading_masked_blocks_masked():
    # block=64: the first two forward blocks of every row are all -inf.
    check_fwd_bwd(9, 300, "cpu", 1e-2, 3.0, 0.0, False, masked_cols=130, block=64)
    check_fwd_bwd(9, 300, "cpu", 0.0, 3.0, 0.0, True, masked_cols=130, block=64)
    check_fwd_bwd(9, 300, "cpu", 0.0, 3.0, 0.1, True, masked_cols=130, block=64)  # ls > 0: +inf loss


@pytest.mark.interp
@pytest.mark.parametrize(("z", "cap", "ls", "weighted"), COMBOS[1:3])
@pytest.mark.parametrize("scale_layout", ["compact", "swizzled"])
def test_interp_mxfp8_kernel_with_features_is_bytes_of_quantized_grad(z, cap, ls, weighted, scale_layout):
    check_mxfp8_contract(40, 160, "cpu", z, cap, ls, weighted, "e4m3", scale_layout)


def check_vocab_parallel(device, z, cap, ls, weighted, world=2, shard=96):
    from lowp_ops.kernels import vocab_parallel as vp_kernels

    logits, target, weight, _ = inputs(19, world * shard, device, seed=5)
    weight = weight if weighted else None
    packets, want_packets = [], []
    for rank in range(world):
        part = logits[:, rank * shard : (rank + 1) * shard].contiguous()
        packets.append(
            vp_kernels.launch_vocab_parallel_ce_stats(part, target, rank * shard, ls > 0, weight, cap)
        )
        want_packets.append(
            vp_ref.vocab_parallel_ce_stats(part.cpu(), target.cpu(), rank * shard, ls > 0, _cpu(weight), cap)
        )
    torch.testing.assert_close(torch.cat(packets).cpu(), torch.cat(want_packets), rtol=2e-5, atol=2e-4)
    loss, stats = vp_kernels.launch_vocab_parallel_ce_merge(
        torch.cat(packets), target, shard, ls, IGNORE, weight, z
    )
    single = ce_ref.cross_entropy_fwd(logits.cpu(), target.cpu(), ls, IGNORE, _cpu(weight), z, cap)
    torch.testing.assert_close(loss.cpu(), single[0], rtol=2e-5, atol=2e-4)
    torch.testing.assert_close(stats.cpu(), single[1], rtol=2e-5, atol=2e-5)


def _cpu(x):
    return None if x is None else x.cpu()


@pytest.mark.interp
@pytest.mark.parametrize(("z", "cap", "ls", "weighted"), COMBOS[1:3])
def test_interp_vocab_parallel_kernels_with_features_match_single_rank(z, cap, ls, weighted):
    check_vocab_parallel("cpu", z, cap, ls, weighted)


# ----------------------------------------------------------------------------------- GPU (real sizes)


@pytest.mark.gpu
@pytest.mark.parametrize(("z", "cap", "ls", "weighted"), COMBOS)
@pytest.mark.parametrize(("rows", "vocab"), [(256, 32768), (100, 50257)])
def test_gpu_fwd_bwd_with_features_match_reference(rows, vocab, z, cap, ls, weighted):
    check_fwd_bwd(rows, vocab, "cuda", z, cap, ls, weighted)
    check_fwd_bwd(64, 40000, "cuda", z, cap, ls, weighted, masked_cols=16384)


@pytest.mark.gpu
@pytest.mark.parametrize(("z", "cap", "ls", "weighted"), COMBOS)
@pytest.mark.parametrize("scale_layout", ["compact", "swizzled"])
@pytest.mark.parametrize("fp8_dtype", ["e4m3", "e5m2"])
def test_gpu_mxfp8_kernel_with_features_is_bytes_of_quantized_grad(
    z, cap, ls, weighted, scale_layout, fp8_dtype
):
    """The launcher's own choice (gluon=None): with features it must take the Triton kernel."""
    check_mxfp8_contract(256, 8192 + 96, "cuda", z, cap, ls, weighted, fp8_dtype, scale_layout)


@pytest.mark.gpu
def test_gpu_gluon_kernel_refuses_features():
    from lowp_ops.kernels import cross_entropy as ce_kernels

    logits, target, _, grad_rows = inputs(64, 1024, "cuda")
    stats = ce_kernels.launch_cross_entropy_fwd(logits, target, 0.0, IGNORE)[1]
    with pytest.raises(ValueError, match="Gluon"):
        ce_kernels.launch_cross_entropy_bwd_mxfp8(
            logits,
            target,
            stats,
            grad_rows,
            0.0,
            IGNORE,
            "e4m3",
            True,
            True,
            "compact",
            0,
            0,
            None,
            1e-3,
            0.0,
            gluon=True,
        )


@pytest.mark.gpu
@pytest.mark.parametrize(("z", "cap", "ls", "weighted"), COMBOS)
def test_gpu_vocab_parallel_kernels_with_features_match_single_rank(z, cap, ls, weighted):
    check_vocab_parallel("cuda", z, cap, ls, weighted, world=4, shard=8192)
