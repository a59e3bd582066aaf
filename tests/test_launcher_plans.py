"""The launchers that keep one plan per input specialization (``kernels.launch.PlanCache``) give, for
calls of one shape with other strides, dtypes and options made one after another (each finding the
plans of the calls before it), the bytes of the same call made with no plan stored.

The cross-entropy launchers and the quantizers have tests of their own (``test_cross_entropy_kernels``,
``test_mxfp8_kernels``, ``test_nvfp4_kernels``); these are the others: the dequantizers and decodes, the
MXFP8 round trip, the softmax family, SwiGLU and dGLU, the group ends, RMSNorm, the in-place scaling and
the LM head's one-pass loss step.
"""

from __future__ import annotations

import pytest
import torch
from ce_softmax_oracles import bits
from kernel_suites import SUITES, assert_plans_follow

ROWS, COLS = 32, 128

VARIANTS = [
    {},
    {"layout": "row-strided"},
    {"layout": "column-major"},
    {"dtype": torch.float32},
    {"option": True},
    {"layout": "row-strided", "option": True},
    {},
]


def _matrix(rows: int, cols: int, dtype: torch.dtype, device: str, layout: str, seed: int) -> torch.Tensor:
    """A (rows, cols) matrix of the given layout: contiguous, rows of a wider matrix, or column-major."""
    gen = torch.Generator().manual_seed(seed)
    # Rows of magnitudes 0.01-10, so that blocks that restart at group ends get other scales.
    values = torch.randn(rows, cols + 8, generator=gen) * torch.logspace(-2, 1, rows)[:, None]
    values = values.to(dtype).to(device)
    if layout == "row-strided":
        return values[:, :cols]
    if layout == "column-major":
        return values[:, :cols].t().contiguous().t()
    return values[:, :cols].contiguous()


def launcher_outputs(variant: dict, device: str) -> list[torch.Tensor]:
    """Every output of the planned launchers for one shape and ``variant``'s layout, dtype and option
    (a flag of each launcher), as bit patterns."""
    from lowp_ops.kernels import cross_entropy_single_pass as one_pass
    from lowp_ops.kernels import linear_cross_entropy, mxfp8, nvfp4, nvfp4_decode, rms_norm, softmax, swiglu
    from lowp_ops.kernels import split_sizes as split_kernels

    layout, option = variant.get("layout", "contiguous"), variant.get("option", False)
    dtype = variant.get("dtype", torch.bfloat16)
    x = _matrix(ROWS, COLS, dtype, device, layout, seed=1)
    grad = _matrix(ROWS, COLS, dtype, device, layout, seed=2)
    out = []

    # softmax / log_softmax / logsumexp
    y = softmax.launch_softmax_fwd(x, option, "zero" if option else "nan")
    out += [y, softmax.launch_softmax_bwd(y, grad, option), softmax.launch_logsumexp(x)]

    # MXFP8: dequantize (into a given buffer with the option) and the round trip (grouped with it)
    x16 = x.to(torch.bfloat16)
    row_data, row_scale, col_data, col_scale = mxfp8.launch_mxfp8_quantize(x16, "e4m3", True, True, "compact")
    buffer = torch.empty(ROWS, COLS, dtype=dtype, device=device) if option else None
    rows_copy = (row_data, row_scale, "e4m3", "rowwise", "compact", dtype)
    out.append(mxfp8.launch_mxfp8_dequantize(*rows_copy, out=buffer))
    out.append(mxfp8.launch_mxfp8_dequantize(col_data, col_scale, "e4m3", "columnwise", "compact", dtype))
    ends = torch.tensor([12, 12, 32], dtype=torch.int32, device=device) if option else None
    fp8 = "e5m2" if dtype == torch.float32 else "e4m3"
    out += list(mxfp8.launch_mxfp8_round_trip(x, fp8, True, True, ends))

    # NVFP4: dequantize, the row decode (2-D and stacked), the grouped column decode, the row scaling
    q = nvfp4.launch_nvfp4_quantize(x, True, True, False, None, None, False)
    out.append(nvfp4_decode.launch_nvfp4_dequantize(q[0], q[1], q[4], dtype))
    data = torch.stack([q[0], q[0]]) if option else q[0]
    scale = torch.stack([q[1], q[1]]) if option else q[1]
    out.append(nvfp4_decode.launch_nvfp4_decode_rows(data, scale))
    splits = torch.tensor([16, 0, 16] if option else [32, 0, 0], device=device)
    g = nvfp4.launch_nvfp4_group_quantize(x, splits, True, True, False, None, None)
    out.append(nvfp4_decode.launch_nvfp4_group_decode_columns(g[2], g[3], splits, COLS, ROWS))
    amaxes = torch.tensor([1.5, 2.0, 3.0], device=device)
    row_ends = ends if option else None
    y16 = x16 if option else x16[:30]  # without ends, rows split evenly over the experts
    out.append(nvfp4_decode.launch_nvfp4_scale_rows(y16, amaxes, amaxes * 2, row_ends))

    # SwiGLU forward, dGLU, group ends
    probs = torch.linspace(0.1, 1.0, ROWS, device=device)
    interleave = 32 if option else 0
    group_ends = split_kernels.launch_group_ends(splits, ROWS, option)
    out.append(group_ends)
    out.append(swiglu.launch_swiglu_fwd(x, probs, interleave, group_ends.reshape(-1)[:3] if option else None))
    out += list(swiglu.launch_dglu(grad[:, : COLS // 2], x, probs, splits, interleave))

    # RMSNorm forward and backward
    weight = torch.linspace(0.5, 1.5, COLS, device=device).to(dtype)
    normed, rstd = rms_norm.launch_rms_norm_fwd(x, weight, 1e-6, option)
    out += [normed, rstd, *rms_norm.launch_rms_norm_bwd(grad, x, weight, rstd, option)]

    # the LM head's in-place scaling and one-pass loss step (in place: on copies)
    scaled = x.contiguous()
    linear_cross_entropy.launch_scale_by_(scaled, torch.tensor(0.75 if option else 1.5, device=device))
    logits = x.contiguous()
    target = torch.arange(ROWS, device=device) % COLS
    grad_rows = torch.full((ROWS,), 0.5, device=device)
    step = one_pass.launch_cross_entropy_rows_fwd_bwd_(logits, target, grad_rows, 0.1 * option, -100)
    out += [scaled, *step]
    return [bits(t) for t in out]


@pytest.mark.interp
def test_interp_launcher_plans_follow_layouts_and_options():
    assert_plans_follow(launcher_outputs, VARIANTS, "cpu")


@pytest.mark.gpu
def test_gpu_launcher_plans_follow_layouts_and_options():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert_plans_follow(launcher_outputs, VARIANTS, "cuda")


@pytest.mark.parametrize("suite", SUITES)
def test_strided_vectors_read_as_their_contiguous_copies(suite, kernel_device):
    """Arguments that the kernels read at unit stride (a grouped quantizer's given per-expert amaxes, the
    SwiGLU forward's group ends, the row scaling's amaxes and ends, a grouped GEMM's valid ends, an NVFP4
    dequantize's scales) give, as strided views, the bytes of their contiguous copies."""
    import lowp_ops
    from lowp_ops import library

    device = kernel_device
    x = _matrix(64, COLS, torch.bfloat16, device, "contiguous", seed=3)
    splits = torch.tensor([32, 32], device=device)
    spaced = torch.tensor([3.0, 100.0, 5.0, 100.0], device=device)[::2]  # a 100 read here is wrong
    strided = lowp_ops.nvfp4_group_quantize(
        x, splits, columnwise=True, amax_rowwise=spaced, amax_columnwise=spaced
    )
    dense = spaced.contiguous()
    want = lowp_ops.nvfp4_group_quantize(
        x, splits, columnwise=True, amax_rowwise=dense, amax_columnwise=dense
    )
    for field in ("row_data", "row_scale", "col_data", "col_scale", "amax_rowwise", "amax_columnwise"):
        assert torch.equal(getattr(strided, field), getattr(want, field)), field

    ends = torch.tensor([10, 99, 20, 99, 64, 99], dtype=torch.int32, device=device)[::2]
    probs = torch.linspace(0.1, 1.0, 64, device=device)
    got = library.swiglu_fwd(x, probs, 0, ends)
    assert torch.equal(got, library.swiglu_fwd(x, probs, 0, ends.contiguous()))
    amaxes = torch.tensor([1.0, 9.0, 2.0, 9.0, 4.0, 9.0], device=device)[::2]
    got = library.nvfp4_scale_rows(x, amaxes, amaxes, ends)
    assert torch.equal(
        got, library.nvfp4_scale_rows(x, amaxes.contiguous(), amaxes.contiguous(), ends.contiguous())
    )

    a = x[:32].contiguous()
    b = _matrix(2 * COLS, 32, torch.bfloat16, device, "contiguous", seed=4).reshape(2, COLS, 32)
    ends = torch.tensor([10, 99, 24, 77], dtype=torch.int32, device=device)[::2]  # rows 24-31: no group
    assert torch.equal(
        library.grouped_mm(a, b, ends, True), library.grouped_mm(a, b, ends.contiguous(), True)
    )

    q = lowp_ops.nvfp4_quantize(x)
    column_major = q.row_scale.t().contiguous().t()
    got = library.nvfp4_dequantize(q.row_data, column_major, q.amax_rowwise, torch.float32)
    assert torch.equal(got, library.nvfp4_dequantize(q.row_data, q.row_scale, q.amax_rowwise, torch.float32))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose first element sits one element past the start of its storage, so that its
    base pointer is not 16-byte aligned (the allocator's blocks are)."""
    storage = t.new_empty(t.numel() + 1)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


def _tensors(result) -> list[torch.Tensor]:
    """Every tensor in ``result`` (a tensor, a tuple, or an MXFP8 / NVFP4 container's fields)."""
    import dataclasses

    if isinstance(result, torch.Tensor):
        return [result]
    if dataclasses.is_dataclass(result):
        result = [getattr(result, f.name) for f in dataclasses.fields(result)]
    parts = [part for part in result if isinstance(part, (torch.Tensor, tuple, list))]
    return [t for part in parts for t in _tensors(part)]


def _values(result) -> list[torch.Tensor]:
    """``result``'s tensors as fp32 values, an MXFP8 gradient as its two dequantized copies."""
    import lowp_ops

    values = []
    for part in result if isinstance(result, (tuple, list)) else [result]:
        if isinstance(part, lowp_ops.MXFP8Tensor):
            values += [
                lowp_ops.mxfp8_dequantize(part, torch.float32, use) for use in ("rowwise", "columnwise")
            ]
        else:
            values.append(part.float())
    return values


@pytest.mark.parametrize("suite", SUITES)
def test_misaligned_base_pointers_give_the_results_of_aligned_copies(suite, kernel_device):
    """Public calls on inputs whose base pointer is not 16-byte aligned (a view at a storage offset of one
    element) against the same calls on aligned copies, gradients included. The quantizers (element-wise
    and block maxima) give the same bytes. Calls that sum along rows give the same values within one
    unit in the last place of each output's dtype (2^-16 relative for fp32 outputs; one E4M3 step for
    an MXFP8 gradient's dequantized copies): Triton lays a block out in registers by the alignment it
    can prove, so a misaligned row is summed in another order, as rows that are not 16-byte aligned are
    (docs/cross_entropy.md)."""
    import lowp_ops

    device = kernel_device
    gen = torch.Generator().manual_seed(11)

    def randn(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen) * 3).to(dtype).to(device)

    def fwd_bwd(fn, *inputs):
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves)
        out.float().sum().backward()
        return [out, *(leaf.grad for leaf in leaves if leaf.requires_grad)]

    wide, odd, wide32 = randn(64, 4096), randn(48, 1000), randn(32, 1024, dtype=torch.float32)
    target_wide = torch.randint(0, 4096, (64,), generator=gen).to(device)
    target_odd = torch.randint(0, 1000, (48,), generator=gen).to(device)
    hidden, head = randn(64, 256), randn(1000, 256)
    c, probs = randn(64, 512), torch.rand(64, generator=gen).to(device)
    norm_weight = randn(4096)
    ce, mxfp8_loss = lowp_ops.cross_entropy, lowp_ops.cross_entropy_with_mxfp8_grad
    smoothed = lambda y: ce(y, target_odd, label_smoothing=0.1)
    exact = {
        "mxfp8_quantize": (lambda x: lowp_ops.mxfp8_quantize(x), [wide]),
        "mxfp8_quantize e5m2 48x1000": (lambda x: lowp_ops.mxfp8_quantize(x, "e5m2"), [odd]),
        "mxfp8_quantize fp32": (lambda x: lowp_ops.mxfp8_quantize(x), [wide32]),
        "nvfp4_quantize": (lambda x: lowp_ops.nvfp4_quantize(x, columnwise=True), [wide]),
    }
    close = {
        "cross_entropy": (lambda x: fwd_bwd(lambda y: ce(y, target_wide), x), [wide]),
        "cross_entropy 48x1000": (lambda x: fwd_bwd(smoothed, x), [odd]),
        "cross_entropy fp32": (lambda x: fwd_bwd(lambda y: ce(y, target_wide[:32] % 1024), x), [wide32]),
        "cross_entropy_with_mxfp8_grad": (lambda x: mxfp8_loss(x, target_wide), [wide]),
        "cross_entropy_with_mxfp8_grad 48x1000": (lambda x: mxfp8_loss(x, target_odd), [odd]),
        "softmax": (lambda x: fwd_bwd(lambda y: lowp_ops.softmax(y, -1), x), [wide]),
        "log_softmax": (lambda x: fwd_bwd(lambda y: lowp_ops.log_softmax(y, -1), x), [odd]),
        "logsumexp": (lambda x: lowp_ops.logsumexp(x, -1), [wide]),
        "rms_norm": (lambda x, w: fwd_bwd(lowp_ops.rms_norm, x, w), [wide, norm_weight]),
        "linear_cross_entropy": (
            lambda h, w: fwd_bwd(lambda a, b: lowp_ops.linear_cross_entropy(a, b, target_wide % 1000), h, w),
            [hidden, head],
        ),
        "swiglu": (lambda c, p: fwd_bwd(lowp_ops.swiglu, c, p), [c, probs]),
    }  # fmt: skip
    failures = []
    for name, (fn, inputs) in {**exact, **close}.items():
        want = fn(*(t.contiguous() for t in inputs))
        got = fn(*(_misaligned(t) for t in inputs))
        if name in exact:
            pairs = zip(_tensors(got), _tensors(want), strict=True)
            failures += [
                f"{name}: output {i} differs"
                for i, (a, b) in enumerate(pairs)
                if not torch.equal(bits(a), bits(b))
            ]
            continue
        # fp32 outputs carry the row sums' roundoff (up to ~2^-16 relative), more than one unit
        ulp_of = [max(torch.finfo(t.dtype).eps, 2**-16) for t in _tensors(want) if t.is_floating_point()]
        values = zip(_values(got), _values(want), strict=True)
        for index, (a, b) in enumerate(values):
            ulp = 2**-3 if name.startswith("cross_entropy_with") and index else ulp_of[index]
            try:
                torch.testing.assert_close(a, b, rtol=ulp, atol=ulp * float(b.abs().max()) * 2**-10)
            except AssertionError as error:
                failures.append(f"{name}: output {index}: {str(error).splitlines()[2:4]}")
    assert not failures, "\n".join(failures)
