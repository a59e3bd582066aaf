"""Triton NVFP4 kernels against the pure-PyTorch reference, byte for byte, and the grouped / RHT /
stochastic-rounding contracts (docs/nvfp4.md).

``interp``: the kernels on CPU tensors under TRITON_INTERPRET=1 (small shapes, few examples); ``gpu``:
the same bodies on CUDA at larger shapes. The reference always runs on CPU; it is itself checked against
a per-block numpy oracle in test_nvfp4.py. The RHT's fp32 additions follow one fixed order
(the butterfly) in both, so the column-wise copy is bit-exact too, stochastic rounding included (its
random bits are a counter-based hash that both compute). Plain tests: properties of the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_suites import INTERPRET, SUITES, kernel_property_settings

import lowp_ops
from lowp_ops.kernels import nvfp4 as kernels
from lowp_ops.kernels import nvfp4_math
from lowp_ops.reference import nvfp4 as reference

MAX_SIDE = {"interp": 96, "gpu": 1200}
property_settings = kernel_property_settings(10)
OUTPUT_NAMES = ("row_data", "row_scale", "col_data", "col_scale", "amax_rowwise", "amax_columnwise")
BF16_MIN_NORMAL = 2.0**-126
SPEC_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def make_input(rows: int, cols: int, seed: int, dtype=torch.bfloat16, spread: str = "column", n_inf: int = 0):
    """randn * 2^k with k per column in +-12 ("column") or per element in +-20 ("element": blocks whose
    16 terms span more than 12 binades, where the order of the RHT's fp32 additions matters)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, cols) if spread == "column" else (rows, cols)
    span = 12 if spread == "column" else 20
    exponents = torch.randint(-span, span + 1, shape, generator=gen).double()
    values = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * torch.exp2(exponents)
    if INTERPRET and dtype == torch.bfloat16:
        # The interpreter (triton 3.9) converts bf16 subnormals to fp32 wrongly; the GPU suite keeps them.
        values = torch.where(values.abs() < BF16_MIN_NORMAL, 0.0, values)
    flat = values.view(-1)
    for _ in range(n_inf if flat.numel() else 0):
        flat[torch.randint(flat.numel(), (1,), generator=gen)] = float("inf") * (1 - 2 * (seed % 2))
    return values.to(dtype)


def assert_same(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    got = got.cpu()
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    if got.dtype == torch.float32:
        same = (got.view(torch.int32) == expected.view(torch.int32)) | (got.isnan() & expected.isnan())
    else:
        same = got == expected
    if not same.all():
        first = tuple(i.item() for i in (~same).nonzero()[0])
        raise AssertionError(
            f"{name}: {(~same).sum().item()} of {got.numel()} differ; first at {first}: "
            f"got {got[first].item()!r}, expected {expected[first].item()!r}"
        )


def assert_outputs_equal(got, expected, names=OUTPUT_NAMES) -> None:
    for name, g, e in zip(names, got, expected, strict=True):
        assert_same(name, g, e)


def given_amaxes(amax_source: str, x: torch.Tensor):
    """(amax_rowwise, amax_columnwise): None, or multiples of the true amax (some blocks then saturate)."""
    amax_rowwise = amax_columnwise = None
    if amax_source == "given":
        scale = float(x.float().abs().max().clamp_min(1e-30))
        amax_rowwise = torch.tensor([0.37 * scale])
        amax_columnwise = torch.tensor([2.5 * scale])
    return amax_rowwise, amax_columnwise


def check_quantize(x, device, rowwise, columnwise, rht, block_2d, amax_source, sr_seed=None, config=None):
    amax_rowwise, amax_columnwise = given_amaxes(amax_source, x)
    args = (rowwise, columnwise, rht, amax_rowwise, amax_columnwise, block_2d, sr_seed)
    expected = reference.nvfp4_quantize(x, *args)
    on_device = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    got = kernels.launch_nvfp4_quantize(x.to(device), *on_device, config=config)
    assert all(g.device.type == device for g in got)
    assert_outputs_equal(got, expected)


def even_shape(max_side: int, rows_multiple: int):
    side = st.integers(1, max_side // 2)
    return st.tuples(
        side.map(lambda r: rows_multiple * max(1, 2 * r // rows_multiple)), side.map(lambda c: 2 * c)
    )


# ------------------------------------------------------------------------------- kernel == reference


@pytest.mark.parametrize("suite", SUITES)
@property_settings
@given(
    data=st.data(),
    copies=st.sampled_from(["both", "rowwise", "columnwise"]),
    rht=st.booleans(),
    block_2d=st.booleans(),
    amax_source=st.sampled_from(["computed", "given"]),
    dtype=st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16, torch.float32]),
    spread=st.sampled_from(["column", "element"]),
    n_inf=st.sampled_from([0, 0, 0, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_kernel_matches_reference(
    suite, kernel_device, data, copies, rht, block_2d, amax_source, dtype, spread, n_inf, seed
):
    rht = rht and not block_2d and copies != "rowwise"
    if rht:
        dtype = torch.bfloat16
    rows, cols = data.draw(even_shape(MAX_SIDE[suite], 16 if rht else 2), label="shape")
    x = make_input(rows, cols, seed, dtype, spread, n_inf)
    rowwise, columnwise = copies in ("both", "rowwise"), copies in ("both", "columnwise")
    check_quantize(x, kernel_device, rowwise, columnwise, rht, block_2d, amax_source)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize(
    ("shape", "rht", "block_2d"),
    [
        ((16, 16), True, False),
        ((34, 50), False, False),  # partial 16-blocks in both directions, scale padding
        ((48, 80), True, False),
        ((48, 80), False, True),
        ((2, 6), False, False),
        ((64, 144), True, False),  # more than one tile in both directions
        ((128, 128), True, False),  # scales without padding: no zero fill, every scale written
    ],
    ids=str,
)
@pytest.mark.parametrize("amax_source", ["computed", "given"])
def test_quantize_kernel_matches_reference_on_fixed_shapes(
    suite, kernel_device, shape, rht, block_2d, amax_source
):
    x = make_input(*shape, seed=sum(shape), spread="element", n_inf=1)
    check_quantize(x, kernel_device, True, True, rht, block_2d, amax_source)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("config", [(32, 64, 1, True), (16, 32, 2, False)], ids=str)
def test_quantize_kernel_matches_reference_under_other_launch_configs(suite, kernel_device, config):
    x = make_input(64, 96, seed=3, spread="element")
    check_quantize(x, kernel_device, True, True, True, False, "computed", config=config)
    check_quantize(x, kernel_device, True, True, False, True, "given", config=config)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("config", [None, (16, 16, 2, True), (16, 128, 1, True)], ids=str)
def test_2d_blocks_in_a_masked_tile_are_scaled_by_their_block_scale(suite, kernel_device, config):
    """An H200 regression case: with 2-D blocks in a tile that crosses the tensor's edge,
    ptxas once compiled the block scale's fp8 unpack to read another register (row data 0xFF 0x5F where
    the reference has 0x03 0x87, scale codes right) when the NaN mask took the fp8 scale in a second
    layout."""
    x = torch.tensor([[2288.0, 13.5625], [9856.0, -3.21875]], dtype=torch.bfloat16)
    check_quantize(x, kernel_device, True, True, False, True, "computed", config=config)
    check_quantize(x, kernel_device, True, False, False, True, "computed", config=config)


@pytest.mark.parametrize("suite", SUITES)
def test_nan_input_gives_nan_amax_and_zero_data_like_the_reference(suite, kernel_device):
    x = make_input(32, 48, seed=4)
    x[5, 7] = float("nan")
    # Infinities in the NaN's row block and column block (their blocks' data must be 0 too).
    x[5, 8] = float("inf")
    x[6, 7] = float("-inf")
    check_quantize(x, kernel_device, True, True, True, False, "computed")
    check_quantize(x, kernel_device, True, True, False, False, "given")


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_2d", [False, True])
def test_values_up_to_the_dtype_max_quantize_like_the_reference_and_round_trip_finite(
    suite, kernel_device, dtype, block_2d
):
    """amax = the dtype's max (the range where ``s_b * amax`` used to overflow in the dequantization)."""
    top = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(23)
    x = (torch.rand(48, 64, generator=gen, dtype=torch.float64) * 2 - 1).mul(top).to(dtype)
    x[0, 0], x[40, 9] = top, -top
    check_quantize(x, kernel_device, True, True, False, block_2d, "computed")
    got = kernels.launch_nvfp4_quantize(x.to(kernel_device), True, True, False, None, None, block_2d, None)
    row_data, row_scale, col_data, col_scale, amax_row, amax_col = (t.cpu() for t in got)
    for data, scale, amax in ((row_data, row_scale, amax_row), (col_data, col_scale, amax_col)):
        x_hat = reference.nvfp4_dequantize(data, scale, amax, dtype)
        assert torch.isfinite(x_hat).all() and x_hat.abs().max() == top


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("shape", [(0, 32), (32, 0)], ids=str)
def test_quantize_kernel_handles_empty_input(suite, kernel_device, shape):
    x = torch.ones(shape, dtype=torch.bfloat16)
    check_quantize(x, kernel_device, True, True, False, False, "computed")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "rht", "block_2d", "dtype"),
    [
        ((4096, 4096), True, False, torch.bfloat16),
        ((8192, 1040), True, False, torch.bfloat16),
        ((1000, 1002), False, True, torch.float32),
        ((2048, 512), False, False, torch.float16),
    ],
    ids=str,
)
def test_quantize_kernel_matches_reference_at_large_shapes(kernel_device, shape, rht, block_2d, dtype):
    x = make_input(*shape, seed=1, dtype=dtype, spread="element", n_inf=2)
    check_quantize(x, kernel_device, True, True, rht, block_2d, "computed")


@pytest.mark.parametrize("suite", SUITES)
def test_kernel_e2m1_rounding_matches_the_reference_rule(suite, kernel_device):
    """The kernel's shifter form of RNE onto the E2M1 grid (packed as the kernels pack, each value in both
    nibbles) against the reference's comparisons: every grid point and tie with its fp32 neighbours,
    random values and random fp32 bit patterns below 8, Inf, NaN, subnormals and signed zeros."""
    import triton
    import triton.language as tl

    @triton.jit
    def e2m1_kernel(v_ptr, code_ptr, n, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + index, mask=index < n, other=0.0)
        # The kernels zero the bytes of blocks holding a NaN (their encode factor is NaN).
        byte = nvfp4_math.e2m1_bytes(v, v, 0, 0, False) & nvfp4_math.not_nan_mask(v)
        tl.store(code_ptr + index, byte.to(tl.uint8), mask=index < n)

    gen = torch.Generator().manual_seed(0)
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6])
    up, down = torch.tensor(10.0), torch.tensor(-10.0)
    count = 20_000 if suite == "interp" else 2_000_000
    values = torch.cat(
        [
            points,
            points.nextafter(up),
            points.nextafter(down),
            torch.rand(count, generator=gen) * 7,
            torch.randint(0, 0x41000000, (count,), generator=gen, dtype=torch.int32).view(torch.float32),
            torch.tensor([float("inf"), float("nan"), 1e-45, 6.0001, 7.0, 1e30]),
        ]
    )
    values = torch.cat([values, -values])
    codes = torch.empty(values.shape, dtype=torch.uint8, device=kernel_device)
    block = 4096
    e2m1_kernel[(triton.cdiv(values.numel(), block),)](
        values.to(kernel_device), codes, values.numel(), BLOCK=block
    )
    expected = reference.e2m1_codes(torch.clamp(values, -6, 6))
    assert_same("codes", codes, expected | (expected << 4))


# ------------------------------------------------------------------------------------------- grouped


def per_expert_outputs(grouped, split_sizes: list[int], hidden: int):
    """Slice the grouped layout (formats.NVFP4GroupedTensor) into each expert's six outputs."""
    row_data, row_scale, col_data, col_scale, amax_row, amax_col = (t.cpu() for t in grouped)
    starts = reference.group_col_scale_starts(torch.tensor(split_sizes)).tolist()
    row0 = 0
    for expert, size in enumerate(split_sizes):
        width = (size + 63) // 64 * 4  # roundup(ceil(size / 16), 4)
        yield (
            row_data[row0 : row0 + size],
            row_scale[row0 : row0 + size],
            col_data[hidden * row0 // 2 : hidden * (row0 + size) // 2].view(hidden, size // 2),
            col_scale[:, starts[expert] : starts[expert] + width],
            amax_row[expert : expert + 1],
            amax_col[expert : expert + 1],
        )
        row0 += size


def check_grouped_equals_per_expert(
    x,
    split_sizes,
    device,
    rowwise,
    columnwise,
    rht,
    amax_source,
    sr_seed=None,
    split_full_tiles=None,
    block_2d=False,
) -> None:
    experts = len(split_sizes)
    amax_rowwise = amax_columnwise = None
    if amax_source == "given":
        gen = torch.Generator().manual_seed(experts)
        amax_rowwise = torch.rand(experts, generator=gen) * 50
        amax_columnwise = torch.rand(experts, generator=gen) * 200
    sizes = torch.tensor(split_sizes, device=device)
    got = kernels.launch_nvfp4_group_quantize(
        x.to(device),
        sizes,
        rowwise,
        columnwise,
        rht,
        None if amax_rowwise is None else amax_rowwise.to(device),
        None if amax_columnwise is None else amax_columnwise.to(device),
        block_2d=block_2d,
        split_full_tiles=split_full_tiles,
    )
    used_scale_cols = sum((size + 63) // 64 * 4 for size in split_sizes)
    assert not got[3].cpu()[:, used_scale_cols:].any()
    hidden = x.shape[1]
    row0 = 0
    experts_outputs = per_expert_outputs(got, split_sizes, hidden)
    for expert, (size, mine) in enumerate(zip(split_sizes, experts_outputs, strict=True)):
        given_row = None if amax_rowwise is None else amax_rowwise[expert : expert + 1]
        given_col = None if amax_columnwise is None else amax_columnwise[expert : expert + 1]
        alone = reference.nvfp4_quantize(
            x[row0 : row0 + size], rowwise, columnwise, rht, given_row, given_col, block_2d
        )
        row_data, row_scale, col_data, col_scale, amax_row, amax_col = alone
        expected = (
            row_data if rowwise else mine[0],
            row_scale[:size] if rowwise else mine[1],
            col_data if columnwise else mine[2],
            col_scale if columnwise else mine[3],
            amax_row,
            amax_col,
        )
        for name, g, e in zip(OUTPUT_NAMES, mine, expected, strict=True):
            assert_same(f"expert {expert} {name}", g, e)
        row0 += size


@pytest.mark.parametrize("suite", SUITES)
def test_quantize_plans_follow_given_amaxes_strides_options_and_bad_arguments(suite, kernel_device):
    """The launchers keep one plan per specialization: calls of one shape with and without given amaxes,
    with other strides, copies, transforms and split sizes, one after another, each give the reference's
    (or the per-expert) bytes, and bad arguments of a shape that has a plan still raise."""
    x = make_input(32, 48, seed=3)
    for args in [
        (True, True, True, False, "computed"),
        (True, True, True, False, "given"),
        (True, True, True, False, "computed"),
        (True, False, False, True, "given"),
        (False, True, False, False, "computed"),
    ]:
        check_quantize(x, kernel_device, *args)
        check_quantize(x.t().contiguous().t(), kernel_device, *args)
        check_quantize(x.view(2, 16, 48), kernel_device, *args)
    for splits, amax_source in [([16, 16], "computed"), ([32, 0], "given"), ([0, 32], "computed")]:
        check_grouped_equals_per_expert(x, splits, kernel_device, True, True, True, amax_source)
    on_device = x.to(kernel_device)
    with pytest.raises(ValueError, match="amax_rowwise must be a float32"):
        kernels.launch_nvfp4_quantize(on_device, True, True, True, on_device[0, :1], None, False)
    with pytest.raises(ValueError, match="rht needs bfloat16"):
        kernels.launch_nvfp4_quantize(on_device.half(), True, True, True, None, None, False)
    sizes = torch.tensor([16, 16], device=kernel_device)
    with pytest.raises(ValueError, match=r"amax_columnwise must be float32 of shape \(2,\)"):
        kernels.launch_nvfp4_group_quantize(on_device, sizes, True, True, True, None, sizes.float()[:1])
    if kernel_device == "cpu":  # split-size and amax values are read on the host for CPU tensors
        with pytest.raises(ValueError, match="split_sizes must sum to the row count 32"):
            kernels.launch_nvfp4_group_quantize(
                on_device, sizes * torch.tensor([1, 0]), True, True, True, None, None
            )
        # A negative given amax after a call that made the specialization's plan.
        amax, amaxes = torch.tensor([4.0]), torch.tensor([4.0, 4.0])
        kernels.launch_nvfp4_quantize(on_device, True, True, True, amax, amax, False)
        with pytest.raises(ValueError, match="amax_rowwise must be >= 0"):
            kernels.launch_nvfp4_quantize(on_device, True, True, True, -amax, amax, False)
        kernels.launch_nvfp4_group_quantize(on_device, sizes, True, True, True, amaxes, amaxes)
        with pytest.raises(ValueError, match="amax_columnwise must be >= 0"):
            kernels.launch_nvfp4_group_quantize(on_device, sizes, True, True, True, amaxes, -amaxes)


GROUPED_SPLITS = {
    "empty_front": [0, 32, 48, 16],
    "empty_middle": [32, 0, 0, 64],
    "empty_end": [16, 48, 0],
    "all_empty_but_one": [0, 0, 80, 0],
}


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("splits", sorted(GROUPED_SPLITS))
@pytest.mark.parametrize(
    ("copies", "rht", "amax_source"),
    [("both", True, "computed"), ("both", False, "given"), ("columnwise", True, "given")],
    ids=["both-rht-computed", "both-given", "columnwise-rht-given"],
)
def test_grouped_equals_per_expert_quantization(suite, kernel_device, splits, copies, rht, amax_source):
    split_sizes = GROUPED_SPLITS[splits]
    x = make_input(sum(split_sizes), 48, seed=len(splits), spread="element")
    rowwise = copies == "both"
    check_grouped_equals_per_expert(x, split_sizes, kernel_device, rowwise, True, rht, amax_source)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("splits", sorted(GROUPED_SPLITS))
@pytest.mark.parametrize("amax_source", ["computed", "given"])
def test_grouped_16x16_blocks_equal_per_expert_quantization(suite, kernel_device, splits, amax_source):
    """block_2d: each expert's rows in 16x16 blocks with its own amax, as the grouped MLP's NVFP4
    recipe quantizes its stacked expert weights."""
    split_sizes = GROUPED_SPLITS[splits]
    x = make_input(sum(split_sizes), 48, seed=len(splits) + 7, spread="element")
    check_grouped_equals_per_expert(
        x, split_sizes, kernel_device, True, True, False, amax_source, block_2d=True
    )


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("split_full_tiles", [True, False], ids=["two-launches", "one-launch"])
def test_grouped_full_tiles_in_a_launch_of_their_own(suite, kernel_device, split_full_tiles):
    """64-row tiles wholly inside their expert (the maskless path: experts 0, 2 and 4) and the others
    (experts' ends, the 16-row expert) quantized in two launches or one, both equal to per-expert
    quantization."""
    split_sizes = [80, 16, 64, 0, 144]
    x = make_input(sum(split_sizes), 128, seed=11, spread="element")
    check_grouped_equals_per_expert(
        x, split_sizes, kernel_device, True, True, True, "given", split_full_tiles=split_full_tiles
    )


@pytest.mark.parametrize("suite", SUITES)
@property_settings
@given(
    data=st.data(),
    rht=st.booleans(),
    amax_source=st.sampled_from(["computed", "given"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_equals_per_expert_on_random_splits(suite, kernel_device, data, rht, amax_source, seed):
    multiple = 16 if rht else 2
    max_units = 6 if suite == "interp" else 80
    units = data.draw(st.lists(st.integers(0, max_units), min_size=1, max_size=6), label="units")
    split_sizes = [multiple * u for u in units]
    hidden = data.draw(st.integers(1, 40 if suite == "interp" else 600), label="hidden") * 2
    x = make_input(sum(split_sizes), hidden, seed, spread="element")
    check_grouped_equals_per_expert(x, split_sizes, kernel_device, True, True, rht, amax_source)


# ------------------------------------------------------------------------------ stochastic rounding


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("rht", [False, True])
def test_stochastic_rounding_kernel_matches_reference_bits(suite, kernel_device, rht):
    x = make_input(48, 80, seed=5, spread="element")
    sr_seed = torch.tensor([123456789, 2**40 + 17])
    check_quantize(x, kernel_device, True, True, rht, False, "computed", sr_seed=sr_seed)
    expected = reference.nvfp4_group_quantize(
        x, torch.tensor([16, 0, 32]), True, True, rht, None, None, sr_seed
    )
    got = kernels.launch_nvfp4_group_quantize(
        x.to(kernel_device),
        torch.tensor([16, 0, 32], device=kernel_device),
        True,
        True,
        rht,
        None,
        None,
        sr_seed.to(kernel_device),
    )
    assert_outputs_equal(got, expected)


GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_stochastic_e2m1_rounding_is_unbiased_and_picks_a_neighbour():
    """Each value drawn 8192 times with independent random bits: every code is one of the two grid
    neighbours, and the mean is the value within 5 standard deviations of the Bernoulli mean."""
    values = torch.tensor([0.1, 0.3, 0.74, 1.1, 1.3, 1.9, 2.2, 2.75, 3.9, 4.5, 5.0, 5.9, 6.0, 0.0])
    values = torch.cat((values, -values))
    draws = 8192
    index = torch.arange(draws * values.numel()).view(draws, -1)
    bits = reference.sr_random_bits(torch.tensor([7, 0]), 0, index)
    codes = reference.e2m1_codes_stochastic(values.expand(draws, -1), bits)
    decoded = reference.e2m1_values(codes).double()
    magnitude = values.abs().double()
    lower = torch.tensor([GRID[m >= GRID].max() for m in magnitude.tolist()], dtype=torch.float64)
    upper = torch.tensor([GRID[m <= GRID].min() for m in magnitude.tolist()], dtype=torch.float64)
    got = decoded.abs()
    assert ((got == lower) | (got == upper)).all()
    assert (torch.sign(decoded) * torch.sign(values.double()) >= 0).all()
    p = torch.where(upper > lower, (magnitude - lower) / (upper - lower).clamp_min(1e-30), 0.0)
    sigma = (upper - lower) * torch.sqrt(p * (1 - p) / draws)
    assert ((got.mean(dim=0) - magnitude).abs() <= 5 * sigma + 1e-12).all()


def test_stochastic_rounding_beats_round_to_nearest_on_average_like_te():
    """TE's test (tests/pytorch/nvfp4/test_nvfp4_sr_quantize.py): the mean of 50 SR dequantizations is
    closer to x than the RN one, for the row-wise copy and for the column-wise copy against RHT(x^T);
    two draws differ."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    rn = lowp_ops.nvfp4_quantize(x, columnwise=True, rht=True)
    targets = {"rowwise": x.float(), "columnwise": reference.apply_rht(x.t().contiguous()).float()}
    means = {use: torch.zeros_like(target) for use, target in targets.items()}
    previous = None
    for draw in range(50):
        q = lowp_ops.nvfp4_quantize(
            x, columnwise=True, rht=True, stochastic_rounding=True, sr_seed=torch.tensor([draw, 0])
        )
        for use in targets:
            means[use] += lowp_ops.nvfp4_dequantize(q, torch.float32, use=use) / 50
        assert previous is None or not torch.equal(previous, q.row_data)
        previous = q.row_data
    for use, target in targets.items():
        rn_error = (lowp_ops.nvfp4_dequantize(rn, torch.float32, use=use) - target).pow(2).mean().sqrt()
        sr_error = (means[use] - target).pow(2).mean().sqrt()
        assert sr_error < rn_error, use


# ------------------------------------------------------------------------------- RHT and amax facts


def test_butterfly_rht_of_the_identity_is_the_rht_matrix_and_orthogonal():
    identity = torch.eye(16, dtype=torch.bfloat16)
    matrix = reference.apply_rht(identity).float()
    assert torch.equal(matrix, reference.rht_matrix(torch.float32))
    assert torch.equal(matrix @ matrix.t(), torch.eye(16))


@pytest.mark.parametrize("suite", SUITES)
def test_kernel_post_rht_amax_is_at_most_four_amax_and_reaches_it(suite, kernel_device):
    x = make_input(64, 32, seed=6)
    q = kernels.launch_nvfp4_quantize(x.to(kernel_device), False, True, True, None, None, False)
    amax = x.float().abs().max()
    assert q[5].item() <= 4 * amax
    # x_i = 3 s_i H[i, 5] in rows 16..31 of column 2 sums 16 quarters of 3: output 12 = 4 * amax.
    hadamard = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
    worst = torch.zeros(32, 8, dtype=torch.bfloat16)
    worst[16:, 2] = torch.tensor(SPEC_SIGNS) * hadamard[:, 5] * 3.0
    q = kernels.launch_nvfp4_quantize(worst.to(kernel_device), True, True, True, None, None, False)
    assert q[4].item() == 3.0 and q[5].item() == 12.0


@given(exponents=st.lists(st.integers(-140, 127), min_size=1, max_size=64), seed=st.integers(0, 2**31 - 1))
def test_max_of_bf16_magnitudes_is_bf16_of_the_max_magnitude(exponents, seed):
    """Rounding is monotone and sign-symmetric, so an fp32 amax rounded once equals the bf16 amax
    (docs/nvfp4.md#amax-of-a-rounded-tensor)."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(len(exponents), generator=gen, dtype=torch.float64) * torch.exp2(torch.tensor(exponents))
    v = v.float()
    assert torch.equal(v.bfloat16().abs().max(), v.abs().max().bfloat16())


# ------------------------------------------------------------------------------ through the ops


@pytest.fixture
def op_runs_kernel(monkeypatch, kernel_device):
    """Route CPU op calls to the Triton kernels (as scripts/test.sh does) and count kernel launches."""
    if kernel_device == "cpu":
        monkeypatch.setenv("LOWP_OPS_CPU_KERNELS", "triton")
    calls = {"quantize": 0, "group": 0}

    def counted(name, launcher):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return launcher(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(kernels, "launch_nvfp4_quantize", counted("quantize", kernels.launch_nvfp4_quantize))
    monkeypatch.setattr(
        kernels, "launch_nvfp4_group_quantize", counted("group", kernels.launch_nvfp4_group_quantize)
    )
    return calls


def opcheck_all(device: str) -> None:
    x = make_input(32, 48, seed=8).to(device)
    permuted = x.t().contiguous().t()
    seed = torch.tensor([1, 2], device=device)
    amax = torch.tensor([3.0], device=device)
    quantize = torch.ops.lowp.nvfp4_quantize.default
    for args in [
        (x, True, True, True, None, None, False),
        (permuted, True, True, False, amax, None, True),
        (permuted, True, True, True, None, amax, False, seed),
    ]:
        torch.library.opcheck(quantize, args)
    sizes = torch.tensor([16, 0, 16], device=device)
    group = torch.ops.lowp.nvfp4_group_quantize.default
    for args in [
        (x, sizes, True, True, True, None, None),
        (permuted, sizes, True, True, False, amax.expand(3).contiguous(), None, seed),
    ]:
        torch.library.opcheck(group, args)


def test_opcheck_reference_ops():
    opcheck_all("cpu")


@pytest.mark.parametrize("suite", SUITES)
def test_opcheck_ops_on_kernels(suite, kernel_device, op_runs_kernel):
    opcheck_all(kernel_device)
    assert op_runs_kernel["quantize"] > 0 and op_runs_kernel["group"] > 0


def compiled_round_trip_without_recompiles(device: str) -> None:
    def quantize_both(x, split_sizes, seed):
        q = lowp_ops.nvfp4_quantize(x, columnwise=True, rht=True, stochastic_rounding=True, sr_seed=seed)
        g = lowp_ops.nvfp4_group_quantize(x, split_sizes, columnwise=True, rht=True)
        return lowp_ops.nvfp4_dequantize(q, torch.float32), g.col_data, g.col_scale, g.amax_columnwise

    compiled = torch.compile(quantize_both, fullgraph=True, dynamic=True, backend="aot_eager")
    seed = torch.tensor([5, 6], device=device)
    for index, rows in enumerate((32, 48, 80)):
        x = make_input(rows, 64, seed=rows).to(device)
        split_sizes = torch.tensor([16, rows - 32, 16], device=device)
        if index == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(x, split_sizes, seed)
        finally:
            torch.compiler.set_stance("default")
        expected = quantize_both(x, split_sizes, seed)
        for g, e in zip(got, expected, strict=True):
            assert_same("compiled", g, e.cpu())


def test_compiles_without_recompiles():
    compiled_round_trip_without_recompiles("cpu")


@pytest.mark.parametrize("suite", SUITES)
def test_compiled_ops_run_kernels_without_recompiles(suite, kernel_device, op_runs_kernel):
    compiled_round_trip_without_recompiles(kernel_device)
    assert op_runs_kernel["quantize"] >= 3 and op_runs_kernel["group"] >= 3


@pytest.mark.cudagraph
def test_cuda_graph_capture_replays_like_eager_with_new_inputs_splits_and_seed():
    """Captured: computed amaxes, the RHT, grouped quantization from device split sizes and stochastic
    rounding from a device seed; replayed with new values in all four static inputs."""

    def step(x, split_sizes, sr_seed):
        q = lowp_ops.nvfp4_quantize(x, columnwise=True, rht=True, stochastic_rounding=True, sr_seed=sr_seed)
        g = lowp_ops.nvfp4_group_quantize(x, split_sizes, columnwise=True, rht=True)
        return (q.row_data, q.col_data, q.col_scale, q.amax_columnwise, g.row_data, g.col_data, g.col_scale)

    def inputs(seed: int):
        x = make_input(512, 384, seed=seed, spread="element").cuda()
        sizes = torch.tensor([[128, 0, 256, 128], [0, 256, 256, 0], [512, 0, 0, 0]][seed % 3], device="cuda")
        return x, sizes, torch.tensor([seed, 1000 * seed], device="cuda")

    static = inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(*static)
    for seed in (1, 2, 3):
        fresh = inputs(seed)
        for target, value in zip(static, fresh, strict=True):
            target.copy_(value)
        graph.replay()
        for got, expected in zip(static_out, step(*fresh), strict=True):
            assert_same("replay", got, expected.cpu())


# ---------------------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split_sizes": torch.tensor([16.0])}, "split_sizes must be 1-D int32/int64"),
        ({"amax_rowwise": torch.ones(3)}, r"amax_rowwise must be float32 of shape \(2,\)"),
        ({"sr_seed": torch.ones(2, dtype=torch.int64)}, "only used with stochastic_rounding"),
        ({"stochastic_rounding": True, "sr_seed": torch.ones(3, dtype=torch.int64)}, "sr_seed must be int64"),
    ],
)
def test_group_quantize_bad_arguments_raise_naming_them(kwargs, match):
    kwargs.setdefault("split_sizes", torch.tensor([16, 16]))
    with pytest.raises(ValueError, match=match):
        lowp_ops.nvfp4_group_quantize(torch.ones(32, 16, dtype=torch.bfloat16), **kwargs)


# ------------------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("amax", [0.0, 1e-30, 3.5, 6e4, 7.6e35, 3e38], ids=str)
@pytest.mark.parametrize("shape", [(16, 256), (5, 48), (33, 272)], ids=str)
def test_dequantize_kernel_equals_the_reference_bytes(suite, kernel_device, dtype, amax, shape):
    """Every E2M1 code and E4M3 scale pattern (NaN 0x7F/0xFF and subnormals included) at amaxes on both
    sides of the staging threshold: the kernel's fp32 roundings are the reference's, in its order."""
    from lowp_ops.kernels.nvfp4_decode import launch_nvfp4_dequantize
    from lowp_ops.meta.nvfp4 import scale_shape

    rows, cols = shape
    gen = torch.Generator().manual_seed(rows * cols)
    data = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 256, tuple(scale_shape(rows, cols)), generator=gen, dtype=torch.uint8)
    amax_t = torch.tensor([amax], dtype=torch.float32)
    expected = reference.nvfp4_dequantize(data, scale, amax_t, dtype)
    got = launch_nvfp4_dequantize(
        data.to(kernel_device), scale.to(kernel_device), amax_t.to(kernel_device), dtype
    )
    assert got.dtype == dtype and got.shape == (rows, cols)
    got = got.cpu()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.masked_fill(nan, 0).view(bits), expected.masked_fill(nan, 0).view(bits))
