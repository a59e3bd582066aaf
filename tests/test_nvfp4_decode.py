"""NVFP4 local-value decodes (``lowp::nvfp4_decode_rows``, ``lowp::nvfp4_group_decode_columns``): the
reference against the pure-PyTorch block quantization of ``grouped_nvfp4.local_values`` and a float64
table of every code/scale pair; the Triton kernels against the reference bit for bit (``interp``: CPU
tensors under TRITON_INTERPRET=1, small shapes; ``gpu``: CUDA, larger shapes); opcheck, compile, bad
arguments."""

from __future__ import annotations

import nvfp4_oracles
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_suites import kernel_property_settings

from lowp_ops.composite import grouped_nvfp4
from lowp_ops.formats import E2M1_MAGNITUDES
from lowp_ops.kernels import nvfp4_decode as kernels
from lowp_ops.reference import nvfp4 as nvfp4_ref
from lowp_ops.reference import nvfp4_decode as reference

SUITES = [
    pytest.param("interp", marks=pytest.mark.interp, id="interp"),
    pytest.param("gpu", marks=pytest.mark.gpu, id="gpu"),
]
# Empty experts at the front, in the middle and at the end; sizes multiples of 16, not of the tile.
SPLITS = [[0, 48, 0, 16, 32, 0], [16, 80], [0, 0, 96], [96]]
decode_rows = torch.ops.lowp.nvfp4_decode_rows
decode_columns = torch.ops.lowp.nvfp4_group_decode_columns


def make_tokens(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 randn with per-column magnitudes over 2^+-10 (block scales from subnormal to large E4M3)."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-10, 11, (1, cols), generator=gen).float()
    return (torch.randn(rows, cols, generator=gen) * torch.exp2(exponents)).bfloat16()


def assert_bits_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype and bit patterns (so -0 differs from +0); NaN equals NaN whatever its payload."""
    got = got.cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, tuple(got.shape))
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    same = (got.view(bits) == expected.view(bits)) | (got.isnan() & expected.isnan())
    if not same.all():
        first = tuple(i.item() for i in (~same).nonzero()[0])
        raise AssertionError(
            f"{(~same).sum().item()} of {got.numel()} differ; first at {first}: "
            f"got {got[first].item()!r}, expected {expected[first].item()!r}"
        )


def every_code_and_scale() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data (256, 256), scale (256, 32), float64 values (256, 512)): row s holds the 256 data bytes in
    order and scale byte s for all of its 32 blocks, so every (code, scale) pair occurs."""
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None].repeat(256, 1)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 32)
    e2m1 = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float64)
    codes = torch.stack((data.long() & 15, data.long() >> 4), dim=-1).reshape(256, 512)
    e4m3 = scale[:, :1].view(torch.float8_e4m3fn).double()
    return data, scale, e2m1[codes] * e4m3


def group_columnwise_copy(t: torch.Tensor, split_sizes: torch.Tensor, rht: bool):
    """(col_data, col_scale, amax) of the grouped reference quantizer."""
    outputs = nvfp4_ref.nvfp4_group_quantize(t, split_sizes, False, True, rht, None, None)
    return outputs[2], outputs[3], outputs[5]


# ------------------------------------------------------------------------------------------ reference


def test_every_code_and_scale_decodes_to_the_float64_product():
    data, scale, expected = every_code_and_scale()
    got = reference.nvfp4_decode_rows(data, scale)
    assert_bits_equal(got, expected.to(torch.bfloat16))
    assert got.isnan().sum() == 2 * 512, "scale bytes 0x7F and 0xFF are NaN"
    assert got[0, 16].signbit() and got[0, 16] == 0, "code 8 (low nibble of byte 8) is -0"


@pytest.mark.parametrize(("cols", "block_2d"), [(64, False), (40, False), (48, True)])
def test_rows_decode_is_the_pure_pytorch_local_values(cols, block_2d):
    t = make_tokens(48, cols, seed=cols)
    amax = t.abs().amax().float().reshape(1)
    data, scale, *_ = nvfp4_ref.nvfp4_quantize(t, True, False, False, amax, None, block_2d)
    assert_bits_equal(reference.nvfp4_decode_rows(data, scale), nvfp4_oracles.local_values(t, amax, block_2d))


def test_batched_rows_decode_is_each_matrix_decoded():
    copies = [
        nvfp4_ref.nvfp4_quantize(make_tokens(32, 48, seed=s), True, False, False, None, None, True)
        for s in range(3)
    ]
    data, scale = torch.stack([c[0] for c in copies]), torch.stack([c[1] for c in copies])
    got = reference.nvfp4_decode_rows(data, scale)
    for index, copy in enumerate(copies):
        assert_bits_equal(got[index], reference.nvfp4_decode_rows(copy[0], copy[1]))


@pytest.mark.parametrize(
    ("splits", "rht"), [*((s, r) for s in SPLITS for r in (False, True)), ([6, 0, 34, 56], False)]
)
def test_grouped_columns_decode_is_each_experts_local_values(splits, rht):
    split_sizes = torch.tensor(splits)
    t = make_tokens(96, 40, seed=len(splits))
    col_data, col_scale, amax = group_columnwise_copy(t, split_sizes, rht)
    got = reference.nvfp4_group_decode_columns(col_data, col_scale, split_sizes, 40, 96)
    start = 0
    for expert, size in enumerate(splits):
        columns = t[start : start + size].t().contiguous()
        columns = nvfp4_ref.apply_rht(columns) if rht else columns
        expected = nvfp4_oracles.local_values(columns, amax[expert].reshape(1))
        assert_bits_equal(got[:, start : start + size], expected)
        start += size


def test_tokens_past_the_experts_and_of_a_cut_expert_decode_as_zero():
    col_data, col_scale, _ = group_columnwise_copy(
        make_tokens(96, 24, seed=4), torch.tensor(SPLITS[0]), False
    )
    full = reference.nvfp4_group_decode_columns(col_data, col_scale, torch.tensor(SPLITS[0]), 24, 96)
    short = reference.nvfp4_group_decode_columns(
        col_data, col_scale, torch.tensor([0, 48, 0, 16, 0, 0]), 24, 96
    )
    assert_bits_equal(short[:, :64], full[:, :64])
    assert (short[:, 64:] == 0).all() and not short[:, 64:].signbit().any()
    long = reference.nvfp4_group_decode_columns(
        col_data, col_scale, torch.tensor([0, 48, 0, 16, 48, 0]), 24, 96
    )
    assert_bits_equal(long[:, :64], full[:, :64])
    assert (long[:, 64:] == 0).all()


# ------------------------------------------------------------------------------ kernels vs reference


@pytest.mark.parametrize("suite", SUITES)
def test_kernel_decodes_every_code_and_scale_like_the_reference(suite, kernel_device):
    data, scale, _ = every_code_and_scale()
    got = kernels.launch_nvfp4_decode_rows(data.to(kernel_device), scale.to(kernel_device))
    assert_bits_equal(got, reference.nvfp4_decode_rows(data, scale))


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize(("shape", "config"), [((40, 40), None), ((3, 33, 64), None), ((20, 96), (8, 32, 1))])
def test_rows_kernel_matches_reference(suite, kernel_device, shape, config):
    gen = torch.Generator().manual_seed(sum(shape))
    data = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=gen, dtype=torch.uint8)
    # Scales below 0x7F (no NaN), read through a transposed view (any scale strides).
    scale_shape = (*shape[:-2], (shape[-1] + 15) // 16 + 3, shape[-2] + 5)
    scale = torch.randint(0, 127, scale_shape, generator=gen, dtype=torch.uint8).transpose(-1, -2)
    got = kernels.launch_nvfp4_decode_rows(data.to(kernel_device), scale.to(kernel_device), config)
    assert_bits_equal(got, reference.nvfp4_decode_rows(data, scale))


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize(
    ("quantized_splits", "splits"),
    [
        *((SPLITS[0], splits) for splits in SPLITS),
        (SPLITS[0], [0, 48, 0, 16, 0, 0]),  # tokens past the last expert
        (SPLITS[0], [0, 48, 0, 16, 48, 0]),  # an expert cut at the last token
        ([6, 0, 34, 56], [6, 0, 34, 56]),  # even sizes, not multiples of 16 (no RHT): unaligned tiles
    ],
)
def test_grouped_columns_kernel_matches_reference(suite, kernel_device, quantized_splits, splits):
    t = make_tokens(96, 40, seed=5)
    rht = all(size % 16 == 0 for size in quantized_splits)
    col_data, col_scale, _ = group_columnwise_copy(t, torch.tensor(quantized_splits), rht)
    split_sizes = torch.tensor(splits)
    expected = reference.nvfp4_group_decode_columns(col_data, col_scale, split_sizes, 40, 96)
    device_args = (col_data.to(kernel_device), col_scale.to(kernel_device), split_sizes.to(kernel_device))
    for config in (None, (16, 16, 1)):
        got = kernels.launch_nvfp4_group_decode_columns(*device_args, 40, 96, config)
        assert_bits_equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [1, 8])
def test_kernels_match_reference_at_moe_shapes(experts):
    gen = torch.Generator().manual_seed(experts)
    sizes = torch.randint(1, 40, (experts,), generator=gen) * 16
    sizes[experts // 2] = 0 if experts > 1 else sizes[0]
    tokens, hidden = int(sizes.sum()), 1040
    t = make_tokens(tokens, hidden, seed=experts)
    outputs = nvfp4_ref.nvfp4_group_quantize(t, sizes, True, True, True, None, None)
    got = kernels.launch_nvfp4_decode_rows(outputs[0].cuda(), outputs[1].cuda())
    assert_bits_equal(got, reference.nvfp4_decode_rows(outputs[0], outputs[1]))
    cuda_args = (outputs[2].cuda(), outputs[3].cuda(), sizes.cuda(), hidden, tokens)
    got = kernels.launch_nvfp4_group_decode_columns(*cuda_args)
    assert_bits_equal(
        got, reference.nvfp4_group_decode_columns(outputs[2], outputs[3], sizes, hidden, tokens)
    )


@pytest.mark.parametrize("suite", SUITES)
def test_recipe_operands_through_the_kernels_equal_the_pure_pytorch_local_values(suite, kernel_device):
    """The recipe's operands (quantize ops + decode ops on the kernel device) against ``local_values``."""
    split_sizes = torch.tensor([32, 0, 48, 16])
    t = make_tokens(96, 48, seed=11)
    local, amax = grouped_nvfp4.rowwise_operand(t.to(kernel_device), split_sizes.to(kernel_device))
    token_amax = nvfp4_oracles.row_values(amax.cpu(), split_sizes, 96)[:, None]
    assert_bits_equal(local, nvfp4_oracles.local_values(t, token_amax))
    local, amax = grouped_nvfp4.columnwise_operand(t.to(kernel_device), split_sizes.to(kernel_device))
    block_amax = nvfp4_oracles.row_values(amax.cpu(), split_sizes, 96)[::16][None, :]
    assert_bits_equal(local, nvfp4_oracles.local_values(nvfp4_ref.apply_rht(t.t().contiguous()), block_amax))
    weight = make_tokens(3 * 32, 48, seed=12).view(3, 32, 48)
    local, amax = grouped_nvfp4.weight_operand(weight.to(kernel_device))
    for e in range(3):
        expected = nvfp4_oracles.local_values(weight[e], amax[e].cpu().reshape(1), block_2d=True)
        assert_bits_equal(local[e], expected)


# -------------------------------------------------------------------- global scales of GEMM outputs

scale_rows = torch.ops.lowp.nvfp4_scale_rows


def scale_rows_inputs(seed: int, rows: int = 40, cols: int = 72):
    """(y, amax_a, amax_b, ends) over 5 experts (one empty, rows 36..39 of none), with the overflowing
    alpha of expert 1, an inf and a NaN amax, and inf / NaN / -0 / large values in y."""
    gen = torch.Generator().manual_seed(seed)
    y = (
        torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-30, 30, (rows, 1), generator=gen))
    ).bfloat16()
    y[0, 0], y[7, 1], y[12, 2], y[38, 3] = float("inf"), float("nan"), -0.0, float("-inf")
    amax_a = torch.tensor([3.0, 1e30, float("inf"), 0.5, float("nan")])
    amax_b = torch.tensor([5.0, 1e20, 2.0, 7e3, 1.0])
    ends = torch.tensor([8, 8, 20, 30, 36], dtype=torch.int32)  # expert 1 empty
    return y, amax_a, amax_b, ends


def test_scale_rows_reference_is_each_rows_two_fp32_products():
    y, amax_a, amax_b, ends = scale_rows_inputs(1)
    got = reference.nvfp4_scale_rows(y, amax_a, amax_b, ends)
    for row in range(y.shape[0]):
        expert = int((ends <= row).sum())
        if expert == len(ends):  # no expert: multiplied by 0
            expected = (y[row].float() * 0.0).bfloat16()
        else:
            a, b = amax_a[expert] * (1 / 2688), amax_b[expert] * (1 / 2688)
            alpha = a * b
            first, second = (a, b) if alpha.isinf() and a.isfinite() and b.isfinite() else (alpha, 1.0)
            expected = (y[row].float() * first * second).bfloat16()
        assert_bits_equal(got[row], expected)
    blocks = reference.nvfp4_scale_rows(y, amax_a[:4], amax_b[:4], None)  # 4 experts of 10 rows
    assert_bits_equal(
        blocks, reference.nvfp4_scale_rows(y, amax_a[:4], amax_b[:4], torch.tensor([10, 20, 30, 40]))
    )


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("shape", [(40, 72), (40, 300)])
def test_scale_rows_kernel_matches_reference(suite, kernel_device, shape):
    y, amax_a, amax_b, ends = scale_rows_inputs(sum(shape), *shape)
    for ends_of_rows in (ends, ends.long()):
        device_args = [t.to(kernel_device) for t in (y, amax_a, amax_b, ends_of_rows)]
        got = kernels.launch_nvfp4_scale_rows(*device_args)
        assert_bits_equal(got, reference.nvfp4_scale_rows(y, amax_a, amax_b, ends_of_rows))
    strided = y.to(kernel_device)[:, : shape[1] - 8]  # rows through their stride
    got = kernels.launch_nvfp4_scale_rows(
        strided, amax_a[:4].to(kernel_device), amax_b[:4].to(kernel_device), None
    )
    assert_bits_equal(got, reference.nvfp4_scale_rows(y[:, : shape[1] - 8], amax_a[:4], amax_b[:4], None))


@pytest.mark.parametrize("suite", SUITES)
@kernel_property_settings(10)
@given(
    data=st.data(),
    experts=st.integers(1, 6),
    by_ends=st.booleans(),
    cols=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_scale_rows_kernel_matches_reference_for_any_ends_and_amaxes(
    suite, kernel_device, data, experts, by_ends, cols, seed
):
    """Random valid ends (empty experts, rows of no expert) or equal blocks; amaxes from 0 to values whose
    alpha overflows, inf and NaN; y with inf, NaN and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    rows = data.draw(st.integers(1, 80), label="rows") if by_ends else experts * data.draw(st.integers(1, 16))
    ends = torch.sort(torch.randint(0, rows + 1, (experts,), generator=gen)).values if by_ends else None
    kinds = torch.randint(0, 6, (2, experts), generator=gen)
    magnitudes = torch.exp2(torch.randint(-20, 127, (2, experts), generator=gen).float())
    specials = torch.tensor([0.0, float("inf"), float("nan")])[kinds.clamp(max=2)]
    amax_a, amax_b = torch.where(kinds >= 3, magnitudes, specials)
    y = (
        torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-40, 40, (rows, 1), generator=gen))
    ).bfloat16()
    flat = y.view(-1)
    picks = torch.randint(0, flat.numel(), (3,), generator=gen)
    flat[picks] = torch.tensor([float("inf"), float("nan"), -0.0], dtype=torch.bfloat16)
    args = (y, amax_a.contiguous(), amax_b.contiguous(), ends)
    got = kernels.launch_nvfp4_scale_rows(*(None if t is None else t.to(kernel_device) for t in args))
    assert_bits_equal(got, reference.nvfp4_scale_rows(*args))


# ----------------------------------------------------------------------------------- traceability


def opcheck_all(device: str) -> None:
    t = make_tokens(48, 40, seed=6)
    data, scale, *_ = nvfp4_ref.nvfp4_quantize(t, True, False, False, None, None, False)
    torch.library.opcheck(decode_rows.default, (data.to(device), scale.to(device)))
    torch.library.opcheck(
        decode_rows.default,
        (data.to(device)[None].expand(2, -1, -1), scale.to(device)[None].expand(2, -1, -1)),
    )
    split_sizes = torch.tensor([16, 0, 32])
    col_data, col_scale, _ = group_columnwise_copy(t, split_sizes, True)
    args = (col_data.to(device), col_scale.to(device), split_sizes.to(device), 40, 48)
    torch.library.opcheck(decode_columns.default, args)
    y, amax_a, amax_b, ends = (t.to(device) for t in scale_rows_inputs(2))
    # Finite values: opcheck compares outputs with assert_close, where NaN differs from NaN.
    y, amax_a = y.nan_to_num(0.0, 1.0, -1.0), amax_a.nan_to_num(1.0, 2.0)
    torch.library.opcheck(scale_rows.default, (y, amax_a, amax_b, ends))
    torch.library.opcheck(scale_rows.default, (y, amax_a[:4], amax_b[:4], None))


def test_opcheck_reference_ops():
    opcheck_all("cpu")


@pytest.mark.parametrize("suite", SUITES)
def test_opcheck_ops_on_kernels(suite, kernel_device):
    opcheck_all(kernel_device)


def test_compiled_decodes_do_not_recompile_over_token_counts():
    def operands(t, split_sizes):
        row_data, row_scale, col_data, col_scale, *_ = torch.ops.lowp.nvfp4_group_quantize(
            t, split_sizes, True, True, True, None, None
        )
        tokens, hidden = t.shape
        return decode_rows(row_data, row_scale), decode_columns(
            col_data, col_scale, split_sizes, hidden, tokens
        )

    compiled = torch.compile(operands, fullgraph=True, dynamic=True, backend="aot_eager")
    for index, tokens in enumerate((32, 48, 80)):
        t = make_tokens(tokens, 32, seed=tokens)
        split_sizes = torch.tensor([16, tokens - 32, 16])
        if index == 2:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(t, split_sizes)
        finally:
            torch.compiler.set_stance("default")
        for g, e in zip(got, operands(t, split_sizes), strict=True):
            assert_bits_equal(g, e)


# -------------------------------------------------------------------------------------- arguments

_BYTES = torch.zeros(32, 8, dtype=torch.uint8)
_SCALES = torch.zeros(128, 4, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((_BYTES.float(), _SCALES), "data must be uint8"),
        ((_BYTES, _SCALES.float()), "scale must be uint8"),
        ((_BYTES[0], _SCALES), "data must be 2-D"),
        ((_BYTES, _SCALES[None]), "scale must have the rank of data"),
        ((_BYTES, _SCALES[:16]), "scale must have at least 32 rows and 1 columns"),
        ((_BYTES.expand(2, 32, 8), _SCALES.expand(3, 128, 4)), "scale must have the batch size"),
    ],
)
def test_decode_rows_bad_arguments_raise_naming_them(args, match):
    with pytest.raises(ValueError, match=match):
        decode_rows(*args)


_COL_BYTES = torch.zeros(8 * 32 // 2, dtype=torch.uint8)
_COL_SCALES = torch.zeros(128, 2 + 4 * 2, dtype=torch.uint8)
_SPLITS = torch.tensor([16, 16])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((_COL_BYTES.view(8, 16), _COL_SCALES, _SPLITS, 8, 32), "col_data must be 1-D with"),
        ((_COL_BYTES, _COL_SCALES, _SPLITS, 8, 30), "col_data must be 1-D with"),
        ((_COL_BYTES, _COL_SCALES, _SPLITS, 16, 15), "tokens must be even"),
        ((_COL_BYTES, _COL_SCALES.int(), _SPLITS, 8, 32), "col_scale must be uint8"),
        ((_COL_BYTES, _COL_SCALES[:, :9], _SPLITS, 8, 32), "at least 8 rows and 10 columns"),
        ((_COL_BYTES, _COL_SCALES, _SPLITS.float(), 8, 32), "split_sizes must be 1-D int32/int64"),
        ((_COL_BYTES, _COL_SCALES, _SPLITS[:0], 8, 32), "at least one expert"),
    ],
)
def test_group_decode_columns_bad_arguments_raise_naming_them(args, match):
    with pytest.raises(ValueError, match=match):
        decode_columns(*args)


_Y = torch.zeros(8, 4, dtype=torch.bfloat16)
_AMAX = torch.ones(2)
_ENDS = torch.tensor([4, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((_Y.float(), _AMAX, _AMAX, _ENDS), "y must be 2-D bf16"),
        ((_Y[0], _AMAX, _AMAX, _ENDS), "y must be 2-D bf16"),
        ((_Y, _AMAX.double(), _AMAX, _ENDS), "amax_a must be 1-D float32"),
        ((_Y, _AMAX, _AMAX[None], _ENDS), "amax_b must be 1-D float32"),
        ((_Y, _AMAX, torch.ones(3), _ENDS), "amax_b must have amax_a's 2 experts"),
        ((_Y, torch.ones(3), torch.ones(3), None), "must split evenly over the 3 experts"),
        ((_Y, _AMAX, _AMAX, _ENDS.float()), "ends must be 1-D int32/int64 with one end per expert"),
        ((_Y, _AMAX, _AMAX, _ENDS[:1]), "ends must be 1-D int32/int64 with one end per expert"),
    ],
)
def test_scale_rows_bad_arguments_raise_naming_them(args, match):
    with pytest.raises(ValueError, match=match):
        scale_rows(*args)


@pytest.mark.cudagraph
def test_cuda_graph_capture_of_the_recipe_operands_replays_like_eager_with_new_inputs_and_splits():
    """Quantize + decode of the three operand kinds, captured once (no host sync), replayed on new
    tokens, weights and split sizes."""

    def inputs(seed: int):
        gen = torch.Generator().manual_seed(seed)
        cuts = torch.sort(torch.randint(0, 33, (3,), generator=gen)).values * 16
        split_sizes = torch.cat([cuts[:1], cuts.diff(), 512 - cuts[-1:]])  # 4 experts, some empty
        return (
            make_tokens(512, 256, seed).cuda(),
            make_tokens(3 * 128, 256, seed + 1).view(3, 128, 256).cuda(),
            split_sizes.cuda(),
        )

    def operands(t, weight, split_sizes):
        return (
            *grouped_nvfp4.rowwise_operand(t, split_sizes),
            *grouped_nvfp4.columnwise_operand(t, split_sizes),
            *grouped_nvfp4.weight_operand(weight),
        )

    static = inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            operands(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = operands(*static)
    for seed in (1, 2):
        new = inputs(seed)
        for buffer, value in zip(static, new, strict=True):
            buffer.copy_(value)
        graph.replay()
        for got, expected in zip(captured, operands(*new), strict=True):
            assert_bits_equal(got, expected.cpu())
