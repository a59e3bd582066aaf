"""Triton MXFP8 kernels against the pure-PyTorch reference, byte for byte.

``interp`` tests run the kernels on CPU tensors under TRITON_INTERPRET=1 (small shapes, few examples);
``gpu`` tests run the same bodies on CUDA at larger shapes. The reference always runs on CPU: it defines
the semantics (docs/mxfp8.md) and is itself checked in test_mxfp8.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_suites import INTERPRET, SUITES, kernel_property_settings

from lowp_ops.kernels import cross_entropy as ce_kernels
from lowp_ops.kernels import mxfp8 as kernels
from lowp_ops.meta.split_sizes import set_split_size_checks
from lowp_ops.reference import mxfp8 as reference

# One test body per property; the parameter picks the suite and the size of the shapes drawn.
MAX_SIDE = {"interp": 200, "gpu": 1500}
property_settings = kernel_property_settings(15)

FP8_DTYPES = ("e4m3", "e5m2")
LAYOUTS = ("compact", "swizzled")
COPIES = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Magnitude spread 2^k. "wide": k per column in +-30 (fp16: within its range, subnormals included).
# "extreme": k per row from fp32/bf16 subnormals (E8M0 code 0, v = amax * R an fp32 denormal) up to
# 2^117, plus k per column in +-8, so that whole blocks sit at every magnitude.
WIDE_EXPONENTS = {torch.float32: (-30, 30), torch.bfloat16: (-30, 30), torch.float16: (-20, 12)}
EXTREME_ROW_EXPONENTS = {torch.float32: (-150, 117), torch.bfloat16: (-150, 117), torch.float16: (-30, 5)}
BF16_MIN_NORMAL = 2.0**-126
OUTPUT_NAMES = ("row_data", "row_scale", "col_data", "col_scale")


def make_input(shape, dtype, seed: int, n_special: int, layout: str, spread: str = "wide") -> torch.Tensor:
    """randn * 2^k, ``n_special`` NaN/+-Inf at random places, in the given memory layout."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64)
    if spread == "wide":
        low, high = WIDE_EXPONENTS[dtype]
        exponents = torch.randint(low, high + 1, (shape[-1],), generator=gen)
    else:
        low, high = EXTREME_ROW_EXPONENTS[dtype]
        exponents = torch.randint(low, high + 1, (*shape[:-1], 1), generator=gen)
        exponents = exponents + torch.randint(-8, 9, (shape[-1],), generator=gen)
    values = values * torch.exp2(exponents.double())
    if INTERPRET and dtype == torch.bfloat16:
        # The interpreter (triton 3.9) converts bf16 subnormals to fp32 wrongly; the GPU suite keeps them.
        values = torch.where(values.abs() < BF16_MIN_NORMAL, 0.0, values)
    flat = values.view(-1)
    specials = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
    for _ in range(n_special if flat.numel() else 0):
        index = torch.randint(flat.numel(), (1,), generator=gen)
        flat[index] = specials[torch.randint(3, (1,), generator=gen)]
    x = values.to(dtype)
    if layout == "transposed":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "strided":
        wide = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


def shapes(max_side: int):
    side = st.one_of(st.integers(1, min(max_side, 300)), st.integers(1, max_side))
    two_d = st.tuples(side, side)
    n_d = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 40), st.integers(1, 70))
    return st.one_of(two_d, two_d, two_d, n_d)


def assert_bytes_equal(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    got = got.cpu().view(torch.uint8)
    expected = expected.view(torch.uint8)
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    mismatch = got != expected
    if mismatch.any():
        first = tuple(i.item() for i in mismatch.nonzero()[0])
        raise AssertionError(
            f"{name}: {mismatch.sum().item()} of {got.numel()} bytes differ; first at {first}: "
            f"got {got[first].item():#04x}, expected {expected[first].item():#04x}"
        )


def assert_quantize_matches_reference(
    x: torch.Tensor, device: str, fp8_dtype: str, rowwise: bool, columnwise: bool, scale_layout: str
) -> None:
    expected = reference.mxfp8_quantize(x, fp8_dtype, rowwise, columnwise, scale_layout)
    got = kernels.launch_mxfp8_quantize(x.to(device), fp8_dtype, rowwise, columnwise, scale_layout)
    for name, g, e in zip(OUTPUT_NAMES, got, expected, strict=True):
        assert g.device.type == device
        assert_bytes_equal(name, g, e)


def assert_same_floats(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit equality, except that any NaN matches any NaN."""
    got = got.cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    both_nan = torch.isnan(got) & torch.isnan(expected)
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    same_bits = got.view(int_dtype[got.dtype]) == expected.view(int_dtype[got.dtype])
    mismatch = ~(both_nan | same_bits)
    if mismatch.any():
        first = tuple(i.item() for i in mismatch.nonzero()[0])
        raise AssertionError(
            f"{mismatch.sum().item()} values differ; first at {first}: "
            f"got {got[first].item()!r}, expected {expected[first].item()!r}"
        )


# ------------------------------------------------------------------------------------------ quantize


@pytest.mark.parametrize("suite", SUITES)
@property_settings
@given(
    data=st.data(),
    dtype=st.sampled_from(INPUT_DTYPES),
    fp8_dtype=st.sampled_from(FP8_DTYPES),
    scale_layout=st.sampled_from(LAYOUTS),
    copies=st.sampled_from(sorted(COPIES)),
    layout=st.sampled_from(["contiguous", "contiguous", "transposed", "strided"]),
    n_special=st.sampled_from([0, 0, 0, 1, 3]),
    spread=st.sampled_from(["wide", "wide", "extreme"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_kernel_matches_reference(
    suite, kernel_device, data, dtype, fp8_dtype, scale_layout, copies, layout, n_special, spread, seed
):
    shape = data.draw(shapes(MAX_SIDE[suite]), label="shape")
    x = make_input(shape, dtype, seed, n_special, layout, spread)
    assert_quantize_matches_reference(x, kernel_device, fp8_dtype, *COPIES[copies], scale_layout)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize(
    "shape",
    [(1, 1), (1, 16), (31, 33), (45, 70), (64, 64), (33, 200), (3, 5, 33), (32, 256), (64, 512)],
    ids=str,
)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_layout", LAYOUTS)
@pytest.mark.parametrize(
    ("dtype", "layout", "spread"),
    [
        (torch.bfloat16, "contiguous", "wide"),
        (torch.bfloat16, "transposed", "extreme"),
        (torch.float16, "transposed", "wide"),
        (torch.float32, "strided", "extreme"),
    ],
    ids=["bf16-contiguous-wide", "bf16-transposed-extreme", "fp16-transposed-wide", "fp32-strided-extreme"],
)
@pytest.mark.usefixtures("poisoned_empty")
def test_quantize_kernel_matches_reference_on_fixed_small_shapes(
    suite, kernel_device, shape, fp8_dtype, scale_layout, dtype, layout, spread
):
    """Deterministic coverage next to the property test: every memory layout, NaN and Inf, subnormals;
    outputs allocated as poisoned memory, so scale padding the kernel skipped would differ from the
    reference's zeros."""
    x = make_input(shape, dtype, seed=sum(shape), n_special=2, layout=layout, spread=spread)
    assert_quantize_matches_reference(x, kernel_device, fp8_dtype, True, True, scale_layout)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("shape", [(64, 512), (40, 300), (96, 160)], ids=str)
@pytest.mark.parametrize("copies", ["rowwise", "columnwise"])
@pytest.mark.parametrize("scale_layout", LAYOUTS)
def test_one_copy_kernels_match_reference_on_wide_inputs(suite, kernel_device, shape, copies, scale_layout):
    """One copy alone over several full and partial column tiles: the reference's bytes."""
    x = make_input(shape, torch.bfloat16, seed=sum(shape), n_special=2, layout="contiguous")
    assert_quantize_matches_reference(x, kernel_device, "e4m3", *COPIES[copies], scale_layout)


@pytest.mark.parametrize("suite", SUITES)
def test_quantize_plans_follow_strides_options_and_bad_arguments(suite, kernel_device):
    """The launcher keeps one plan per input specialization: calls of one shape with other strides,
    dtypes, copies and formats, one after another, each give the reference's bytes, and bad arguments
    of a shape that has a plan still raise."""
    shape = (64, 96)
    for layout, dtype, fp8_dtype, copies, scale_layout in [
        ("contiguous", torch.bfloat16, "e4m3", "both", "compact"),
        ("transposed", torch.bfloat16, "e4m3", "both", "compact"),
        ("strided", torch.bfloat16, "e4m3", "both", "compact"),
        ("contiguous", torch.float32, "e4m3", "both", "compact"),
        ("contiguous", torch.bfloat16, "e5m2", "rowwise", "swizzled"),
        ("contiguous", torch.bfloat16, "e4m3", "columnwise", "compact"),
        ("contiguous", torch.bfloat16, "e4m3", "both", "compact"),
    ]:
        x = make_input(shape, dtype, seed=7, n_special=1, layout=layout)
        assert_quantize_matches_reference(x, kernel_device, fp8_dtype, *COPIES[copies], scale_layout)
        x3d = make_input((4, 16, 96), dtype, seed=8, n_special=1, layout=layout)
        assert_quantize_matches_reference(x3d, kernel_device, fp8_dtype, *COPIES[copies], scale_layout)
    x = make_input(shape, torch.bfloat16, seed=7, n_special=0, layout="contiguous").to(kernel_device)
    with pytest.raises(ValueError, match="fp8_dtype"):
        kernels.launch_mxfp8_quantize(x, "e4m4", True, True, "compact")
    with pytest.raises(ValueError, match="x must be float32"):
        kernels.launch_mxfp8_quantize(x.to(torch.int32), "e4m3", True, True, "compact")
    with pytest.raises(ValueError, match="at least one of rowwise"):
        kernels.launch_mxfp8_quantize(x, "e4m3", False, False, "compact")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "dtype", "spread"),
    [
        ((4096, 4096), torch.bfloat16, "wide"),
        ((16384, 1000), torch.bfloat16, "extreme"),
        ((1000, 257), torch.float32, "extreme"),
        ((8, 512, 1056), torch.float16, "wide"),
    ],
    ids=str,
)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_layout", LAYOUTS)
def test_quantize_kernel_matches_reference_at_large_shapes(
    kernel_device, shape, dtype, spread, fp8_dtype, scale_layout
):
    x = make_input(shape, dtype, seed=1, n_special=4, layout="contiguous", spread=spread)
    assert_quantize_matches_reference(x, kernel_device, fp8_dtype, True, True, scale_layout)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize(
    ("shape", "row_scale_shape", "col_scale_shape"),
    [((0, 32), (0, 4), (0, 128)), ((4, 0), (128, 0), (4, 0)), ((2, 0, 5), (0, 4), (0, 128))],
    ids=str,
)
def test_quantize_kernel_handles_empty_input(suite, kernel_device, shape, row_scale_shape, col_scale_shape):
    x = torch.ones(shape, device=kernel_device)
    row_data, row_scale, col_data, col_scale = kernels.launch_mxfp8_quantize(x, "e4m3", True, True, "compact")
    assert row_data.shape == col_data.shape == x.shape
    assert tuple(row_scale.shape) == row_scale_shape and tuple(col_scale.shape) == col_scale_shape
    assert not row_scale.any() and not col_scale.any()


# --------------------------------------------------------------------------------------- NaN as TE


def with_nans(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with NaNs, the NaN mask): 5% scattered NaNs, half of them negative, an all-NaN 32x32 corner."""
    gen = torch.Generator().manual_seed(seed)
    is_nan = torch.rand(x.shape, generator=gen) < 0.05
    is_nan[:32, :32] = True
    negative = torch.rand(x.shape, generator=gen) < 0.5
    nans = torch.where(negative, -math.nan, math.nan).to(x.dtype)
    return torch.where(is_nan, nans, x), is_nan


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_quantize_kernel_drops_nan_from_the_block_amax(suite, kernel_device, fp8_dtype, scale_layout, dtype):
    """TE's fmaxf amax, checked without the reference: NaNs give the scales and the other bytes of the
    same input with those elements zeroed, and 0x7F themselves; then the reference's bytes too."""
    shape = (70, 97) if suite == "interp" else (1000, 1057)
    x = make_input(shape, dtype, seed=12, n_special=0, layout="contiguous")
    x_nan, is_nan = with_nans(x, seed=13)
    assert (x_nan.float().view(torch.int32) < 0)[is_nan].any(), "some NaNs must be negative"
    got = kernels.launch_mxfp8_quantize(x_nan.to(kernel_device), fp8_dtype, True, True, scale_layout)
    zeroed = x.masked_fill(is_nan, 0.0).to(kernel_device)
    want = kernels.launch_mxfp8_quantize(zeroed, fp8_dtype, True, True, scale_layout)
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        g, w = g.cpu(), w.cpu()
        if name.endswith("scale"):
            assert_bytes_equal(name, g, w)
        else:
            assert (g[is_nan] == 0x7F).all(), name
            assert_bytes_equal(name, g[~is_nan], w[~is_nan])
    assert_quantize_matches_reference(x_nan, kernel_device, fp8_dtype, True, True, scale_layout)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_kernel_inf_and_nan_in_one_block(suite, kernel_device, fp8_dtype):
    x = torch.ones(32, 32)
    x[0, 3] = x[5, 0] = math.inf
    x[0, 9] = x[9, 0] = math.nan
    row_data, row_scale, col_data, col_scale = kernels.launch_mxfp8_quantize(
        x.to(kernel_device), fp8_dtype, True, True, "compact"
    )
    max_byte = 0x7E if fp8_dtype == "e4m3" else 0x7B
    for data, code in ((row_data.cpu(), row_scale[0, 0]), (col_data.cpu(), col_scale[0, 0])):
        assert code.item() == 254
        assert data[0, 3] == data[5, 0] == max_byte and data[0, 9] == data[9, 0] == 0x7F
    assert_quantize_matches_reference(x, kernel_device, fp8_dtype, True, True, "compact")


def fused_ce_mxfp8(logits, target, grad_rows, fp8_dtype, gluon):
    lse = ce_kernels.launch_cross_entropy_fwd(logits, target, 0.0, -100)[1]
    return ce_kernels.launch_cross_entropy_bwd_mxfp8(
        logits, target, lse, grad_rows, 0.0, -100, fp8_dtype, True, True, "compact", gluon=gluon
    )


@pytest.mark.parametrize(
    ("suite", "gluon"),
    [
        pytest.param("interp", False, marks=pytest.mark.interp, id="interp"),
        pytest.param("gpu", False, marks=pytest.mark.gpu, id="gpu-triton"),
        pytest.param("gpu", True, marks=pytest.mark.gpu, id="gpu-gluon"),
    ],
)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fused_ce_backward_drops_a_nan_row_from_column_block_amaxes(suite, gluon, kernel_device, fp8_dtype):
    """A NaN loss gradient makes one gradient row NaN. Every column-wise block holding it keeps the
    scale it has when that row's gradient is 0, the row's row-wise blocks get code 0 and 0x7F bytes."""
    rows, cols = (64, 256) if suite == "interp" else (256, 4096)
    gen = torch.Generator().manual_seed(14)
    logits = (torch.randn(rows, cols, generator=gen) * 4).to(torch.bfloat16).to(kernel_device)
    target = torch.randint(0, cols, (rows,), generator=gen).to(kernel_device)
    grad_rows = (torch.rand(rows, generator=gen) + 0.5).to(kernel_device)
    nan_row = 37
    grad_rows[nan_row] = math.nan
    got = [t.cpu() for t in fused_ce_mxfp8(logits, target, grad_rows, fp8_dtype, gluon)]
    grad_rows[nan_row] = 0.0
    want = [t.cpu() for t in fused_ce_mxfp8(logits, target, grad_rows, fp8_dtype, gluon)]
    row_data, row_scale, col_data, col_scale = got
    assert (row_data[nan_row] == 0x7F).all() and (col_data[nan_row] == 0x7F).all()
    assert (row_scale[nan_row] == 0).all()
    assert_bytes_equal("col_scale", col_scale, want[3])
    assert_bytes_equal("row_scale", row_scale, want[1])
    others = torch.arange(rows) != nan_row
    assert_bytes_equal("row_data", row_data[others], want[0][others])
    assert_bytes_equal("col_data", col_data[others], want[2][others])


# ---------------------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("suite", SUITES)
@property_settings
@given(
    data=st.data(),
    out_dtype=st.sampled_from(INPUT_DTYPES),
    fp8_dtype=st.sampled_from(FP8_DTYPES),
    scale_layout=st.sampled_from(LAYOUTS),
    use=st.sampled_from(["rowwise", "columnwise"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequantize_kernel_matches_reference_on_every_code(
    suite, kernel_device, data, out_dtype, fp8_dtype, scale_layout, use, seed
):
    """Random data bytes (every FP8 code, NaN/Inf included) and random E8M0 codes 0..255."""
    shape = data.draw(shapes(MAX_SIDE[suite]), label="shape")
    rows, cols = math.prod(shape[:-1]), shape[-1]
    row_blocks, col_blocks = -(-cols // 32), -(-rows // 32)
    if use == "rowwise":
        scale_shape = (-(-rows // 128) * 128, -(-row_blocks // 4) * 4)
    else:
        scale_shape = (-(-col_blocks // 4) * 4, -(-cols // 128) * 128)
    gen = torch.Generator().manual_seed(seed)
    data_bytes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 256, scale_shape, generator=gen, dtype=torch.uint8)
    expected = reference.mxfp8_dequantize(data_bytes, scale, fp8_dtype, use, scale_layout, out_dtype)
    got = kernels.launch_mxfp8_dequantize(
        data_bytes.to(kernel_device), scale.to(kernel_device), fp8_dtype, use, scale_layout, out_dtype
    )
    assert got.device.type == kernel_device
    assert_same_floats(got, expected)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("use", ["rowwise", "columnwise"])
@pytest.mark.parametrize("scale_layout", LAYOUTS)
def test_dequantize_kernel_round_trips_kernel_quantize(suite, kernel_device, use, scale_layout):
    shape = (70, 97) if suite == "interp" else (3000, 2049)
    x = make_input(shape, torch.bfloat16, seed=2, n_special=2, layout="contiguous")
    outputs = kernels.launch_mxfp8_quantize(x.to(kernel_device), "e4m3", True, True, scale_layout)
    data, scale = outputs[:2] if use == "rowwise" else outputs[2:]
    got = kernels.launch_mxfp8_dequantize(data, scale, "e4m3", use, scale_layout, torch.float32)
    expected_q = reference.mxfp8_quantize(x, "e4m3", True, True, scale_layout)
    expected_data, expected_scale = expected_q[:2] if use == "rowwise" else expected_q[2:]
    expected = reference.mxfp8_dequantize(
        expected_data, expected_scale, "e4m3", use, scale_layout, torch.float32
    )
    assert_same_floats(got, expected)


# ---------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("suite", SUITES)
@property_settings
@given(
    data=st.data(),
    dtype=st.sampled_from(INPUT_DTYPES),
    fp8_dtype=st.sampled_from(FP8_DTYPES),
    copies=st.sampled_from(sorted(COPIES)),
    layout=st.sampled_from(["contiguous", "transposed", "strided"]),
    n_special=st.sampled_from([0, 0, 1, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_kernel_equals_quantize_then_dequantize(
    suite, kernel_device, data, dtype, fp8_dtype, copies, layout, n_special, seed
):
    """One kernel, the bits of dequantize(quantize(x)) per copy (NaN matches NaN). The interpreter
    decodes FP8 NaN/Inf codes as finite numbers: its inputs hold none."""
    shape = data.draw(shapes(MAX_SIDE[suite]), label="shape")
    x = make_input(shape, dtype, seed, 0 if suite == "interp" else n_special, layout)
    rowwise, columnwise = COPIES[copies]
    expected = reference.mxfp8_round_trip(x, fp8_dtype, rowwise, columnwise)
    got = kernels.launch_mxfp8_round_trip(x.to(kernel_device), fp8_dtype, rowwise, columnwise)
    for g, e in zip(got, expected, strict=True):
        assert g.device.type == kernel_device
        assert_same_floats(g, e)


@pytest.mark.parametrize("suite", SUITES)
@property_settings
@given(
    data=st.data(),
    dtype=st.sampled_from(INPUT_DTYPES),
    copies=st.sampled_from(sorted(COPIES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_round_trip_kernel_equals_the_reference(suite, kernel_device, data, dtype, copies, seed):
    """With ``group_ends`` (column-wise blocks restarting at each group), the kernel's bits are the
    reference's, for ends that are sorted or not, empty groups and ends past either side of the rows.
    Rows per side up to 200 (interp) / 1500 (gpu); whole blocks at every magnitude (rows' exponents)."""
    shape = data.draw(shapes(MAX_SIDE[suite]), label="shape")
    rows = math.prod(shape[:-1])
    ends = data.draw(st.lists(st.integers(-3, rows + 3), max_size=9), label="group_ends")
    x = make_input(shape, dtype, seed, 0, "contiguous", spread="extreme")
    group_ends = torch.tensor(ends, dtype=torch.int32)
    rowwise, columnwise = COPIES[copies]
    previous = set_split_size_checks("off")  # malformed ends: the effective ends, on CPU tensors too
    try:
        expected = reference.mxfp8_round_trip(x, "e4m3", rowwise, columnwise, group_ends)
        got = kernels.launch_mxfp8_round_trip(
            x.to(kernel_device), "e4m3", rowwise, columnwise, group_ends.to(kernel_device)
        )
    finally:
        set_split_size_checks(previous)
    for g, e in zip(got, expected, strict=True):
        assert g.device.type == kernel_device
        assert_same_floats(g, e)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("copies", sorted(COPIES))
def test_grouped_round_trip_kernel_on_whole_tiles_equals_the_reference(suite, kernel_device, copies):
    """Columns in whole tiles, groups of 32-row multiples and not: the kernel's unmasked tiles (32 rows
    inside their group) and its masked ones give the reference's bits; the ends as a strided view."""
    rows, cols = (200, 256) if suite == "interp" else (3000, 1024)
    x = make_input((rows, cols), torch.bfloat16, 11, 0, "contiguous", spread="extreme")
    group_ends = torch.tensor([64, 70, 70, 133, rows // 2 + 40, rows - 5], dtype=torch.int32)
    expected = reference.mxfp8_round_trip(x, "e4m3", *COPIES[copies], group_ends)
    strided_ends = torch.stack([group_ends, group_ends.flip(0)], dim=1).to(kernel_device)[:, 0]
    got = kernels.launch_mxfp8_round_trip(x.to(kernel_device), "e4m3", *COPIES[copies], strided_ends)
    for g, e in zip(got, expected, strict=True):
        assert_same_floats(g, e)


@pytest.mark.parametrize("suite", SUITES)
def test_dequantize_into_a_given_buffer_writes_it_whole_and_checks_it(suite, kernel_device):
    shape = (70, 97) if suite == "interp" else (3000, 2049)
    x = make_input(shape, torch.bfloat16, seed=3, n_special=2, layout="contiguous").to(kernel_device)
    data, scale = kernels.launch_mxfp8_quantize(x, "e4m3", True, False, "compact")[:2]
    expected = kernels.launch_mxfp8_dequantize(data, scale, "e4m3", "rowwise", "compact", torch.bfloat16)
    buffer = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=kernel_device)
    got = kernels.launch_mxfp8_dequantize(
        data, scale, "e4m3", "rowwise", "compact", torch.bfloat16, out=buffer
    )
    assert got.data_ptr() == buffer.data_ptr()
    assert_same_floats(got, expected.cpu())
    for wrong in (buffer[:, :-1], buffer.float(), buffer.t().contiguous().t()):
        with pytest.raises(ValueError, match="out must be"):
            kernels.launch_mxfp8_dequantize(
                data, scale, "e4m3", "rowwise", "compact", torch.bfloat16, out=wrong
            )


# ---------------------------------------------------------------------------------- through the ops


@pytest.fixture
def op_runs_kernel(monkeypatch, kernel_device):
    """Route CPU op calls to the Triton kernels (as scripts/test.sh does) and count kernel launches."""
    if kernel_device == "cpu":
        monkeypatch.setenv("LOWP_OPS_CPU_KERNELS", "triton")
    calls = {"quantize": 0, "dequantize": 0}

    def counted(name, launcher):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return launcher(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(kernels, "launch_mxfp8_quantize", counted("quantize", kernels.launch_mxfp8_quantize))
    monkeypatch.setattr(
        kernels, "launch_mxfp8_dequantize", counted("dequantize", kernels.launch_mxfp8_dequantize)
    )
    return calls


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("scale_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_op_runs_kernel_and_matches_reference(
    suite, kernel_device, op_runs_kernel, dtype, scale_layout
):
    x = make_input((45, 70), dtype, seed=4, n_special=1, layout="transposed")
    got = torch.ops.lowp.mxfp8_quantize(x.to(kernel_device), "e5m2", True, True, scale_layout)
    assert op_runs_kernel["quantize"] == 1
    expected = reference.mxfp8_quantize(x, "e5m2", True, True, scale_layout)
    for name, g, e in zip(OUTPUT_NAMES, got, expected, strict=True):
        assert_bytes_equal(name, g, e)
    deq = torch.ops.lowp.mxfp8_dequantize(got[2], got[3], "e5m2", "columnwise", scale_layout, dtype)
    assert op_runs_kernel["dequantize"] == 1
    assert_same_floats(
        deq, reference.mxfp8_dequantize(*expected[2:], "e5m2", "columnwise", scale_layout, dtype)
    )


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("scale_layout", LAYOUTS)
def test_opcheck_ops_on_kernels(suite, kernel_device, op_runs_kernel, scale_layout, permuted):
    x = make_input(
        (40, 70), torch.bfloat16, seed=8, n_special=0, layout="transposed" if permuted else "contiguous"
    )
    x = x.to(kernel_device)
    torch.library.opcheck(torch.ops.lowp.mxfp8_quantize.default, (x, "e4m3", True, True, scale_layout))
    assert op_runs_kernel["quantize"] > 0
    row_data, row_scale, _, _ = torch.ops.lowp.mxfp8_quantize(x, "e4m3", True, False, scale_layout)
    torch.library.opcheck(
        torch.ops.lowp.mxfp8_dequantize.default,
        (row_data, row_scale, "e4m3", "rowwise", scale_layout, torch.bfloat16),
    )
    assert op_runs_kernel["dequantize"] > 0


@pytest.mark.parametrize("suite", SUITES)
def test_compiled_ops_run_kernel_without_recompiles(suite, kernel_device, op_runs_kernel):
    def round_trip(x):
        _, _, col_data, col_scale = torch.ops.lowp.mxfp8_quantize(x, "e4m3", True, True, "swizzled")
        return torch.ops.lowp.mxfp8_dequantize(col_data, col_scale, "e4m3", "columnwise", "swizzled", x.dtype)

    compiled = torch.compile(round_trip, backend="aot_eager", fullgraph=True, dynamic=True)
    for index, shape in enumerate([(40, 70), (65, 33), (3, 130)]):
        x = make_input(shape, torch.bfloat16, seed=index, n_special=0, layout="contiguous")
        if index == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(x.to(kernel_device))
        finally:
            torch.compiler.set_stance("default")
        expected = reference.mxfp8_dequantize(
            *reference.mxfp8_quantize(x, "e4m3", False, True, "swizzled")[2:],
            "e4m3",
            "columnwise",
            "swizzled",
            torch.bfloat16,
        )
        assert_same_floats(got, expected)
    assert op_runs_kernel["quantize"] >= 3


# ------------------------------------------------------------------------------------- E8M0 helper


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_kernel_e8m0_code_matches_the_reference_bit_rule(suite, kernel_device, fp8_dtype):
    """The kernel's integer short form of TE's rounding-up rule, on every positive BF16 magnitude, fp32
    denormals, random fp32 bit patterns (all binades) and Inf/NaN."""
    import triton
    import triton.language as tl

    from lowp_ops.formats import FP8_MAX_RCP

    @triton.jit
    def e8m0_kernel(amax_ptr, code_ptr, n, MAX_RCP: tl.constexpr, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        amax = tl.load(amax_ptr + index, mask=index < n, other=0.0)
        tl.store(code_ptr + index, kernels.e8m0_from_amax(amax, MAX_RCP), mask=index < n)

    bf16_magnitudes = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    generator = torch.Generator().manual_seed(0)
    random_fp32 = torch.randint(0, 0x7F800000, (200_000,), generator=generator, dtype=torch.int32)
    denormals = torch.arange(0, 0x800000, 4099, dtype=torch.int32)
    specials = torch.tensor([math.inf, math.nan, 3.4028234663852886e38, 0.0])
    amax = torch.cat(
        [bf16_magnitudes, random_fp32.view(torch.float32), denormals.view(torch.float32), specials]
    )
    codes = torch.empty(amax.shape, dtype=torch.int32, device=kernel_device)
    block = 4096
    e8m0_kernel[(triton.cdiv(amax.numel(), block),)](
        amax.to(kernel_device), codes, amax.numel(), MAX_RCP=FP8_MAX_RCP[fp8_dtype], BLOCK=block
    )
    expected = reference.e8m0_from_amax(amax, fp8_dtype)
    assert torch.equal(codes.cpu(), expected)
