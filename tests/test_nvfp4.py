"""NVFP4 (round-to-nearest) reference: E2M1 rounding, packing, the RHT, and quantize/dequantize against
an independent per-block numpy-float32 oracle written from docs/nvfp4.md."""

import functools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowp_ops
from lowp_ops.meta.split_sizes import set_split_size_checks
from lowp_ops.reference import nvfp4 as ref

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
SPEC_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
F32 = np.float32


def nearest_even_code(value: float) -> int:
    """Brute force: the E2M1 code nearest to ``value`` (|value| <= 6), ties to the even code; negative
    values keep their sign even when they round to zero, -0.0 is +0."""
    distances = np.abs(GRID - abs(value))
    best = np.flatnonzero(distances == distances.min())
    code = int(best[0] if len(best) == 1 else best[best % 2 == 0][0])
    return code + 8 if value < 0 else code


def oracle_quantize(t: np.ndarray, amax: float, block_2d: bool = False):
    """Per-block oracle in numpy float32: (codes (R, C) int, scale bytes (R, ceil(C/16)))."""
    rows, cols = t.shape
    n_blocks = -(-cols // 16)
    padded = np.zeros((rows + (-rows % 16 if block_2d else 0), n_blocks * 16), dtype=F32)
    padded[:rows, :cols] = t
    vec_max = np.abs(padded.reshape(padded.shape[0], n_blocks, 16)).max(axis=2)
    if block_2d:
        tiles = vec_max.reshape(-1, 16, n_blocks).max(axis=1)
        vec_max = np.repeat(tiles, 16, axis=0)
    with np.errstate(divide="ignore", over="ignore"):
        encode = F32(1.0) if amax == 0 else min(F32(2688.0) / F32(amax), np.finfo(F32).max)
    encode = F32(1.0) if encode == 0 else F32(encode)
    decode = F32(1.0) / encode
    scale_in = np.minimum(vec_max * (encode * F32(1.0 / 6.0)), F32(448.0)).astype(F32)
    scale = torch.from_numpy(scale_in).to(torch.float8_e4m3fn)
    scale_f = scale.float().numpy()
    with np.errstate(divide="ignore"):
        block_encode = np.minimum(F32(1.0) / (scale_f * decode), np.finfo(F32).max).astype(F32)
    codes = np.zeros(padded.shape, dtype=np.int64)
    for r in range(rows):
        for c in range(cols):
            scaled = np.clip(padded[r, c] * block_encode[r, c // 16], F32(-6), F32(6))
            codes[r, c] = nearest_even_code(float(scaled))
    return codes[:rows, :cols], scale.view(torch.uint8).numpy()[:rows]


def unpack(packed: torch.Tensor) -> np.ndarray:
    data = packed.numpy()
    return np.stack([data & 0xF, data >> 4], axis=-1).reshape(data.shape[0], -1)


def random_matrix(rows: int, cols: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-12, 12, (1, cols), generator=gen).double())
    return (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * spread).to(dtype)


def sylvester_hadamard_16() -> np.ndarray:
    h = np.array([[1.0]])
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize(
    "value", [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2, 0.3, 0.74, 1.3, 2.6, 4.9, 5.1, 6.0]
)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_rounds_to_nearest_with_ties_to_even(value, sign):
    codes = ref.e2m1_codes(torch.tensor([sign * value], dtype=torch.float32))
    assert int(codes[0]) == nearest_even_code(sign * value)


def test_negative_values_rounding_to_zero_are_minus_zero_but_minus_zero_input_is_plus_zero():
    codes = ref.e2m1_codes(torch.tensor([-0.1, -0.25, -0.0, 0.0, 0.1], dtype=torch.float32))
    assert codes.tolist() == [8, 8, 0, 0, 0]


def test_every_code_decodes_to_its_grid_value():
    values = ref.e2m1_values(torch.arange(16, dtype=torch.uint8))
    expected = np.concatenate([GRID, -GRID])
    assert np.array_equal(values.numpy(), expected.astype(np.float32))


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = ref.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(ref.unpack_fp4(packed), codes)


def test_rht_matrix_is_signed_sylvester_hadamard_over_four_and_orthogonal():
    matrix = ref.rht_matrix(torch.float32)
    expected = np.diag(SPEC_SIGNS) @ sylvester_hadamard_16() / 4
    assert np.array_equal(matrix.numpy(), expected.astype(np.float32))
    assert torch.equal(matrix @ matrix.t(), torch.eye(16))
    assert torch.equal(ref.rht_matrix(torch.bfloat16).float(), matrix)


def test_rht_output_is_bounded_by_four_amax_and_the_bound_is_reached():
    x = random_matrix(64, 256, seed=1)
    amax = x.float().abs().max()
    assert ref.apply_rht(x).float().abs().max() <= 4 * amax
    # x_i = s_i * H[i, j] makes output j equal to the sum of 16 quarters: exactly 4 * amax.
    column = 5
    worst = torch.tensor(
        np.array(SPEC_SIGNS) * sylvester_hadamard_16()[:, column] * 3.0, dtype=torch.bfloat16
    )
    assert ref.apply_rht(worst.view(1, 16)).float()[0, column] == 12.0


@given(rows=st.integers(1, 40), half_cols=st.integers(1, 40), seed=st.integers(0, 2**20))
def test_rowwise_quantize_matches_the_per_block_oracle(rows, half_cols, seed):
    x = random_matrix(rows, 2 * half_cols, seed)
    q = lowp_ops.nvfp4_quantize(x)
    amax = float(x.float().abs().max())
    codes, scales = oracle_quantize(x.float().numpy(), amax)
    assert q.amax_rowwise.item() == amax
    assert np.array_equal(unpack(q.row_data), codes)
    assert np.array_equal(q.row_scale[:rows, : scales.shape[1]].numpy(), scales)


@pytest.mark.parametrize("block_2d", [False, True])
def test_given_amax_is_used_as_is(block_2d):
    x = random_matrix(32, 64, seed=3)
    given_amax = torch.tensor([4.0 * float(x.float().abs().max())])
    q = lowp_ops.nvfp4_quantize(x, amax_rowwise=given_amax, block_2d=block_2d)
    codes, scales = oracle_quantize(x.float().numpy(), float(given_amax), block_2d=block_2d)
    assert torch.equal(q.amax_rowwise, given_amax)
    assert np.array_equal(unpack(q.row_data), codes)
    assert np.array_equal(q.row_scale[:32, :4].numpy(), scales)


def test_block_2d_shares_one_scale_per_16x16_tile_and_columnwise_is_the_transpose():
    x = random_matrix(48, 64, seed=4)
    q = lowp_ops.nvfp4_quantize(x, columnwise=True, block_2d=True)
    codes, _ = oracle_quantize(x.float().numpy(), float(x.float().abs().max()), block_2d=True)
    assert np.array_equal(unpack(q.row_data), codes)
    row_scales = q.row_scale[:48, :4]
    assert torch.equal(row_scales, row_scales[::16].repeat_interleave(16, dim=0))
    assert np.array_equal(unpack(q.col_data), unpack(q.row_data).T)
    assert torch.equal(q.col_scale[:64, :3], row_scales[::16].t().repeat_interleave(16, dim=0))


@pytest.mark.parametrize("rht", [False, True])
def test_columnwise_copy_quantizes_the_transpose_or_its_hadamard_transform(rht):
    x = random_matrix(32, 48, seed=5)
    q = lowp_ops.nvfp4_quantize(x, rowwise=False, columnwise=True, rht=rht)
    operand = x.t().contiguous()
    if rht:
        operand = (
            operand.view(-1, 16)
            @ torch.tensor(np.diag(SPEC_SIGNS) @ sylvester_hadamard_16() / 4, dtype=torch.bfloat16)
        ).view(48, 32)
    amax = float(operand.float().abs().max())
    codes, scales = oracle_quantize(operand.float().numpy(), amax)
    assert q.row_data is None and q.col_data.shape == (48, 16)
    assert q.amax_columnwise.item() == amax
    assert np.array_equal(unpack(q.col_data), codes)
    assert np.array_equal(q.col_scale[:48, :2].numpy(), scales)


def test_rht_flag_says_whether_a_columnwise_copy_is_transformed():
    """``q.rht`` describes the column-wise copy: with the row-wise copy alone (never transformed) it is
    False, so that no caller applies the inverse transform to a row-wise GEMM."""
    x = random_matrix(32, 32, seed=7)
    splits = torch.tensor([16, 16])
    for quantize in (
        lowp_ops.nvfp4_quantize,
        functools.partial(lowp_ops.nvfp4_group_quantize, split_sizes=splits),
    ):
        rowwise_only = quantize(x, rht=True)
        assert rowwise_only.rht is False and rowwise_only.col_data is None
        assert quantize(x, columnwise=True, rht=True).rht is True
        assert torch.equal(rowwise_only.row_data, quantize(x).row_data)


def test_rowwise_amax_is_untouched_by_rht_and_columnwise_amax_is_at_most_four_times_it():
    x = random_matrix(64, 32, seed=6)
    q = lowp_ops.nvfp4_quantize(x, columnwise=True, rht=True)
    assert q.amax_rowwise.item() == float(x.float().abs().max())
    assert q.amax_columnwise.item() <= 4 * q.amax_rowwise.item()


def test_dequantize_is_code_value_times_block_scale_times_amax_over_2688():
    x = random_matrix(16, 32, seed=7)
    q = lowp_ops.nvfp4_quantize(x)
    got = lowp_ops.nvfp4_dequantize(q, torch.float32)
    values = np.concatenate([GRID, -GRID])[unpack(q.row_data)].astype(F32)
    block_scale = q.row_scale[:16, :2].view(torch.float8_e4m3fn).float().numpy()
    final = (block_scale * F32(q.amax_rowwise.item())) * F32(1.0 / 2688.0)
    assert np.array_equal(got.numpy(), values * np.repeat(final, 16, axis=1))


def all_codes_under_every_scale_byte() -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """(packed data (256, 8), scales (256, 4)): row r holds the 16 codes 0..15 in one block with scale
    byte r; and, for the oracle, their E2M1 values (256, 16) and E4M3 scales (256, 1) as float32."""
    codes = np.tile(np.arange(16), (256, 1))
    data = torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    scale = torch.zeros(256, 4, dtype=torch.uint8)
    scale[:, 0] = torch.arange(256, dtype=torch.uint8)
    values = np.concatenate([GRID, -GRID])[codes].astype(F32)
    block_scale = scale[:, :1].view(torch.float8_e4m3fn).float().numpy()
    return data, scale, values, block_scale


def test_dequantize_is_bit_identical_to_the_unstaged_formula_wherever_that_is_finite():
    """Random amaxes over all of fp32 (subnormals to FLT_MAX), every code under every E4M3 scale byte:
    the staged dequantization equals ``e2m1 * ((s_b * amax) * fp32(1/2688))`` in numpy float32 bit for
    bit where that is finite, and is finite and within 2 fp32 roundings of the exact value elsewhere."""
    data, scale, values, block_scale = all_codes_under_every_scale_byte()
    gen = np.random.default_rng(21)
    amaxes = np.concatenate(
        [
            np.exp2(gen.uniform(-149, 128, 300)).astype(F32),
            np.array([2.0**64, np.nextafter(F32(2.0**64), F32(0)), 7.6e35, 3e38, np.finfo(F32).max], F32),
        ]
    )
    finite_scale = np.isfinite(block_scale)  # bytes 0x7F and 0xFF are NaN
    for amax in amaxes:
        got = ref.nvfp4_dequantize(data, scale, torch.tensor([amax]), torch.float32).numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            unstaged = values * ((block_scale * F32(amax)) * F32(1.0 / 2688.0))
        exact = values.astype(np.float64) * block_scale.astype(np.float64) * float(amax) / 2688.0
        below = np.isfinite(unstaged)
        assert np.array_equal(got[below].view(np.int32), unstaged[below].view(np.int32)), amax
        above = ~below & finite_scale
        assert np.isfinite(got[above]).all(), amax
        assert (np.abs(got[above] - exact[above]) <= 2.0**-22 * np.abs(exact[above])).all(), amax
    assert (amaxes > 7.6e35).sum() >= 3, "some amaxes must reach the range that used to overflow"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_round_trip_of_values_up_to_the_dtype_max_is_finite(dtype):
    top = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(22)
    x = (torch.rand(64, 64, generator=gen, dtype=torch.float64) * 2 - 1).mul(top).to(dtype)
    x[0, 0], x[1, 1] = top, -top
    q = lowp_ops.nvfp4_quantize(x, columnwise=True)
    for use, original in (("rowwise", x), ("columnwise", x.t())):
        x_hat = lowp_ops.nvfp4_dequantize(q, dtype, use=use)
        assert torch.isfinite(x_hat).all(), use
        assert x_hat.abs().max() == top, use
        error = (x_hat.double() - original.double()).abs()
        assert (error <= top / 6).all(), use  # half the widest E2M1 step (4 -> 6) at the top block scale


def test_grouped_recipe_alpha_factors_keep_finite_outputs_and_single_multiply_bits():
    from lowp_ops.reference.nvfp4_decode import nvfp4_scale_rows

    out = torch.tensor([[2.0**-20, -(2.0**-17)], [1.5, -(2.0**-10)]], dtype=torch.bfloat16)
    ends = torch.tensor([1, 2], dtype=torch.int32)
    amax_a, amax_b = torch.tensor([1e30, 3.0]), torch.tensor([1e20, 5.0])
    got = nvfp4_scale_rows(out, amax_a, amax_b, ends)
    # Expert 0: (1e30 / 2688)(1e20 / 2688) overflows fp32 on its own, the scaled row does not.
    row0 = out[0].double() * (1e30 / 2688.0) * (1e20 / 2688.0)
    assert torch.isfinite(got[0]).all()
    assert torch.allclose(got[0].double(), row0, rtol=2.0**-7)
    # Expert 1: one multiply by the fp32 alpha, as before.
    alpha_1 = (torch.tensor(3.0) * (1.0 / 2688.0)) * (torch.tensor(5.0) * (1.0 / 2688.0))
    assert torch.equal(got[1], (out[1].float() * alpha_1).to(torch.bfloat16))


def test_round_trip_error_of_gaussian_data_is_nvfp4_sized():
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(8)).bfloat16()
    q = lowp_ops.nvfp4_quantize(x, columnwise=True)
    for use, reference in (("rowwise", x.float()), ("columnwise", x.float().t())):
        error = (lowp_ops.nvfp4_dequantize(q, torch.float32, use=use) - reference).norm() / reference.norm()
        assert 0.02 < error < 0.12


def test_zero_input_gives_zero_data_and_scales_with_unit_global_scale():
    q = lowp_ops.nvfp4_quantize(torch.zeros(32, 32), columnwise=True)
    assert q.amax_rowwise.item() == 0.0
    assert not q.row_data.any() and not q.row_scale.any() and not q.col_data.any()
    given_zero = lowp_ops.nvfp4_quantize(torch.ones(16, 16), amax_rowwise=torch.zeros(1))
    # amax 0 means S_enc = 1 (the kernels' rule): s_b = e4m3(1/6), data 1 * (1 / (s_b * 1)) -> 6.
    assert np.array_equal(unpack(given_zero.row_data), np.full((16, 16), 7))


def test_scale_buffers_are_padded_to_128x4_tiles_with_zeros():
    q = lowp_ops.nvfp4_quantize(random_matrix(20, 50, seed=9), columnwise=True)
    assert q.row_data.shape == (20, 25) and q.row_scale.shape == (128, 4)
    assert q.col_data.shape == (50, 10) and q.col_scale.shape == (128, 4)
    assert not q.row_scale[20:].any() and not q.row_scale[:, 4:].any()
    assert not q.col_scale[50:].any() and not q.col_scale[:, 2:].any()


# Another device: meta stands in on a CPU-only machine.
_ON_META = (torch.ones(1, device="meta"), torch.ones(2, dtype=torch.int64, device="meta"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": torch.ones(4, 6, dtype=torch.int32)}, "x must be float32"),
        ({"x": torch.ones(4, 5)}, "even last dim"),
        ({"x": torch.ones(5, 4), "columnwise": True}, "even row count"),
        ({"x": torch.ones(16, 16), "rht": True, "columnwise": True}, "rht needs bfloat16"),
        ({"x": torch.ones(8, 16, dtype=torch.bfloat16), "rht": True, "columnwise": True}, "divisible by 16"),
        ({"x": torch.ones(16, 16), "rht": True, "block_2d": True}, "cannot be combined"),
        ({"x": torch.ones(16, 16), "amax_rowwise": torch.ones(2)}, "amax_rowwise must be"),
        ({"x": torch.ones(16, 16), "rowwise": False}, "at least one of rowwise and columnwise"),
        # A negative amax flips the scales' signs; checked where it is readable without a sync (CPU).
        ({"x": torch.ones(16, 16), "amax_rowwise": -torch.ones(1)}, "amax_rowwise must be >= 0"),
        ({"x": torch.ones(16, 16), "amax_columnwise": torch.ones(1)}, "amax_columnwise is given but"),
        ({"x": torch.ones(16, 16), "amax_rowwise": _ON_META[0]}, "amax_rowwise must be on the"),
        (
            {"x": torch.ones(16, 16), "stochastic_rounding": True, "sr_seed": _ON_META[1]},
            "sr_seed must be on the data's device",
        ),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, match):
    kwargs = dict(kwargs)
    x = kwargs.pop("x")
    with pytest.raises(ValueError, match=match):
        lowp_ops.nvfp4_quantize(x, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": [[1.0, 2.0]]}, "x must be a Tensor"),
        ({"amax_rowwise": 1.0}, "amax_rowwise must be a Tensor"),
        ({"rowwise": "no"}, "rowwise must be a bool"),
        ({"columnwise": 1}, "columnwise must be a bool"),
        ({"rht": "yes", "columnwise": True}, "rht must be a bool"),
        ({"stochastic_rounding": 1}, "stochastic_rounding must be a bool"),
    ],
)
def test_arguments_of_the_wrong_type_raise_naming_them(kwargs, match):
    args = {"x": torch.ones(16, 16, dtype=torch.bfloat16)} | kwargs
    with pytest.raises(TypeError, match=match):
        lowp_ops.nvfp4_quantize(args.pop("x"), **args)


@pytest.mark.parametrize("permuted", [False, True])
def test_opcheck(permuted):
    x = random_matrix(32, 64, seed=10)
    if permuted:
        x = x.t().contiguous().t()
    torch.library.opcheck(torch.ops.lowp.nvfp4_quantize.default, (x, True, True, True, None, None, False))
    torch.library.opcheck(
        torch.ops.lowp.nvfp4_quantize.default, (x, True, True, False, torch.tensor([3.0]), None, True)
    )
    out = torch.ops.lowp.nvfp4_quantize(x, True, False, False, None, None, False)
    torch.library.opcheck(torch.ops.lowp.nvfp4_dequantize.default, (out[0], out[1], out[4], torch.bfloat16))


def test_compiles_to_one_graph_without_recompiles():
    counters = torch._dynamo.utils.counters
    counters.clear()

    def round_trip(x):
        q = lowp_ops.nvfp4_quantize(x, columnwise=True, rht=True)
        return lowp_ops.nvfp4_dequantize(q, torch.float32), lowp_ops.nvfp4_dequantize(q, use="columnwise")

    compiled = torch.compile(round_trip, fullgraph=True, dynamic=True, backend="aot_eager")
    for index, rows in enumerate((32, 48, 80)):
        x = random_matrix(rows, 64, seed=rows)
        if index == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(x)
        finally:
            if index:
                torch.compiler.set_stance("default")
        expected = round_trip(x)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert not counters["graph_break"]


@pytest.mark.parametrize("shape", [(0, 48), (48, 0)])
def test_empty_input_with_16x16_blocks_and_both_copies(shape):
    q = lowp_ops.nvfp4_quantize(torch.zeros(shape), columnwise=True, block_2d=True)
    assert q.row_data.shape == (shape[0], shape[1] // 2) and q.col_data.shape == (shape[1], shape[0] // 2)
    assert not q.row_scale.any() and not q.col_scale.any()


def test_grouped_16x16_blocks_are_each_experts_own_quantization():
    """block_2d: expert e's rows quantized alone in 16x16 blocks with its own amax (the row-wise copy:
    data and the scale rows it uses); split sizes must be multiples of 16 and the RHT is refused."""
    x = random_matrix(96, 48, seed=25)
    sizes = [32, 0, 64]
    got = lowp_ops.nvfp4_group_quantize(x, torch.tensor(sizes), block_2d=True)
    assert got.block_2d
    row0 = 0
    for expert, size in enumerate(sizes):
        alone = lowp_ops.nvfp4_quantize(x[row0 : row0 + size], block_2d=True)
        assert torch.equal(got.row_data[row0 : row0 + size], alone.row_data), expert
        assert torch.equal(got.row_scale[row0 : row0 + size], alone.row_scale[:size]), expert
        assert torch.equal(got.amax_rowwise[expert : expert + 1], alone.amax_rowwise), expert
        row0 += size
    with pytest.raises(ValueError, match="block_2d: 16x16 blocks"):
        lowp_ops.nvfp4_group_quantize(x, torch.tensor([40, 56]), block_2d=True)
    with pytest.raises(ValueError, match="cannot be combined"):
        lowp_ops.nvfp4_group_quantize(
            x.bfloat16(), torch.tensor(sizes), block_2d=True, rht=True, columnwise=True
        )


GROUPED_OPTIONS = {
    "row-wise": {},
    "both copies": {"columnwise": True},
    "both copies, RHT": {"columnwise": True, "rht": True},
    "16x16 blocks": {"block_2d": True},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", sorted(GROUPED_OPTIONS))
def test_grouped_dequantize_is_each_experts_own_dequantization(options, dtype):
    """Expert e's rows (row-wise) or columns (column-wise) of a grouped tensor dequantize to the bytes of
    that expert quantized alone with the same amaxes; an empty expert takes no rows."""
    kwargs = GROUPED_OPTIONS[options]
    x = random_matrix(96, 48, seed=26)
    sizes = [32, 0, 48, 16]
    grouped = lowp_ops.nvfp4_group_quantize(x, torch.tensor(sizes), **kwargs)
    uses = ("rowwise", "columnwise") if kwargs.get("columnwise") else ("rowwise",)
    got = {use: lowp_ops.nvfp4_dequantize(grouped, dtype, use) for use in uses}
    assert got["rowwise"].shape == (96, 48) and got.get("columnwise", torch.empty(48, 96)).shape == (48, 96)
    row0 = 0
    for expert, size in enumerate(sizes):
        amaxes = {"amax_rowwise": grouped.amax_rowwise[expert : expert + 1].clone()}
        if kwargs.get("columnwise"):
            amaxes["amax_columnwise"] = grouped.amax_columnwise[expert : expert + 1].clone()
        if size:
            alone = lowp_ops.nvfp4_quantize(x[row0 : row0 + size], **kwargs, **amaxes)
            for use in uses:
                want = lowp_ops.nvfp4_dequantize(alone, dtype, use)
                part = got[use][row0 : row0 + size] if use == "rowwise" else got[use][:, row0 : row0 + size]
                assert torch.equal(part.view(torch.uint8), want.view(torch.uint8)), (expert, use)
        row0 += size


def test_grouped_dequantize_gives_zero_for_rows_of_no_expert_and_checks_its_arguments():
    """Sizes summing to fewer rows (effective boundaries): the rows past the last end dequantize to 0."""
    x = random_matrix(64, 32, seed=27)
    previous = set_split_size_checks("off")
    try:
        grouped = lowp_ops.nvfp4_group_quantize(x, torch.tensor([16, 32]))
    finally:
        set_split_size_checks(previous)
    values = lowp_ops.nvfp4_dequantize(grouped, torch.float32)
    assert not values[48:].any() and values[:48].abs().sum() > 0
    with pytest.raises(ValueError, match="use='columnwise' but q holds no columnwise copy"):
        lowp_ops.nvfp4_dequantize(grouped, use="columnwise")
    out = torch.ops.lowp.nvfp4_group_quantize(x, torch.tensor([32, 32]), True, True, False, None, None)
    args = (out[2], out[3], out[5], torch.tensor([32, 32]), torch.bfloat16, "columnwise", 64, 32, 2)
    torch.library.opcheck(torch.ops.lowp.nvfp4_group_dequantize.default, args)


def test_grouped_round_trip_compiles_to_one_graph_across_token_counts():
    from torch._dynamo.testing import CompileCounterWithBackend

    def round_trip(x, sizes):
        grouped = lowp_ops.nvfp4_group_quantize(x, sizes, columnwise=True, rht=True)
        return lowp_ops.nvfp4_dequantize(grouped, torch.float32, "columnwise")

    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(round_trip, backend=backend, fullgraph=True, dynamic=True)
    for tokens in (64, 96, 128):
        x, sizes = random_matrix(tokens, 32, seed=tokens), torch.tensor([16, 0, tokens - 16])
        assert torch.equal(compiled(x, sizes), round_trip(x, sizes))
    assert backend.frame_count == 1


def test_reprs_show_shapes_dtypes_and_flags_not_values():
    x = random_matrix(64, 32, seed=24)
    q = lowp_ops.nvfp4_quantize(x, columnwise=True, rht=True)
    assert repr(q) == (
        "NVFP4Tensor(shape=(64, 32), rht=True, block_2d=False, row_data=uint8[64, 16], "
        "row_scale=uint8[128, 4], col_data=uint8[32, 32], col_scale=uint8[128, 4], "
        "amax_rowwise=float32[1], amax_columnwise=float32[1])"
    )
    g = lowp_ops.nvfp4_group_quantize(x, torch.tensor([16, 48]), columnwise=False)
    assert repr(g) == (
        "NVFP4GroupedTensor(shape=(64, 32), rht=False, block_2d=False, row_data=uint8[64, 16], "
        "row_scale=uint8[128, 4], col_data=None, col_scale=None, amax_rowwise=float32[2], "
        "amax_columnwise=float32[2], split_sizes=int64[2])"
    )
