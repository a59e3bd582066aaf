"""Malformed split sizes never give silent garbage or a device assert (``lowp_ops.meta.split_sizes``).

- Bad arguments (a list, bool / float / 2-D tensors, the wrong expert count or device) raise naming
  ``split_sizes`` in every op that takes them.
- On CPU, values that are not well formed (negative, a wrong total, not the op's multiple) raise.
- With the checks off (the CUDA behaviour), every op gives its documented result: the effective
  boundaries, computed here by an independent pure-Python oracle; the references, the Triton kernels
  (interpreter) and CUDA (``gpu``) are held to it.
- The mode switch and ``LOWP_OPS_CHECK_SPLIT_SIZES``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowp_ops
from lowp_ops.kernels import split_sizes as split_kernels
from lowp_ops.meta import split_sizes as split_meta
from lowp_ops.reference import grouped_mm as grouped_mm_ref
from lowp_ops.reference import nvfp4 as nvfp4_ref
from lowp_ops.reference import nvfp4_decode as decode_ref
from lowp_ops.reference import swiglu as swiglu_ref

SUITES = [
    pytest.param("interp", marks=pytest.mark.interp, id="interp"),
    pytest.param("gpu", marks=pytest.mark.gpu, id="gpu"),
]
T = 64  # rows of the small tests
# Malformed sizes of 3 experts over T rows: (name, sizes). Their effective boundaries are the oracle's.
MALFORMED = [
    ("negative", [20, -5, 36]),
    ("short", [16, 8, 8]),
    ("long", [16, 24, 32]),
    ("huge", [2**40, 8, 8]),
    ("int32_extremes", [-(2**31), 2**31 - 1, 0]),
    ("not_multiples", [21, 3, 40]),
]
MALFORMED_IDS = [name for name, _ in MALFORMED]
# Any sizes, int32 and int64 extremes included.
SIZES = st.lists(
    st.one_of(st.integers(-40, 40), st.sampled_from([-(2**31), 2**31 - 1, 2**40, -(2**40)])),
    min_size=1,
    max_size=6,
)


def oracle_ends(sizes: list[int], rows: int, multiple: int = 1) -> list[int]:
    """The documented rule in plain Python: negative sizes count as 0, experts take rows in order, the
    first one reaching past ``rows`` and all after it get none, ends rounded down to ``multiple``."""
    ends, total, last = [], 0, 0
    for size in sizes:
        total += max(size, 0)
        if total <= rows:
            last = total
        ends.append(last // multiple * multiple)
    return ends


def oracle_sizes(sizes: list[int], rows: int, multiple: int = 1) -> list[int]:
    ends = oracle_ends(sizes, rows, multiple)
    return [end - start for start, end in itertools.pairwise([0, *ends])]


def oracle_bounds(sizes: list[int], rows: int, multiple: int = 1) -> list[tuple[int, int]]:
    return list(itertools.pairwise([0, *oracle_ends(sizes, rows, multiple)]))


def int_tensor(sizes: list[int], device="cpu") -> torch.Tensor:
    dtype = torch.int64 if any(abs(s) >= 2**31 - 1 for s in sizes) else torch.int32
    return torch.tensor(sizes, dtype=dtype, device=device)


@pytest.fixture
def checks_off():
    """The CUDA behaviour on every device: the values are not read, the effective boundaries apply."""
    previous = split_meta.set_split_size_checks("off")
    yield
    split_meta.set_split_size_checks(previous)


def bf16(*shape, seed: int, scale: float = 0.5, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(*shape, generator=gen) - 0.5) * scale).bfloat16().to(device)


def assert_exact(got: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same values bit for bit (floats compared through their integer views)."""
    got, expected = got.detach().cpu(), expected.detach().cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    if got.is_floating_point():
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        got, expected = got.view(view), expected.view(view)
    assert torch.equal(got, expected), what


# ------------------------------------------------------------------------------- effective boundaries


@settings(max_examples=25, deadline=None)
@given(sizes=SIZES, rows=st.integers(0, 64), multiple=st.sampled_from([1, 2, 16]))
def test_effective_boundaries_follow_the_documented_rule(sizes, rows, multiple):
    split_sizes = torch.tensor(sizes, dtype=torch.int64)
    ends = oracle_ends(sizes, rows, multiple)
    assert split_meta.group_ends(split_sizes, rows, multiple).tolist() == ends
    effective = split_meta.effective_split_sizes(split_sizes, rows, multiple)
    assert effective.tolist() == oracle_sizes(sizes, rows, multiple)
    assert effective.min() >= 0 and effective.sum() <= rows and (effective % multiple == 0).all()
    expected_expert = [
        next((e for e, end in enumerate(ends) if row < end), len(sizes)) for row in range(rows)
    ]
    assert split_meta.expert_of_rows(split_sizes, rows, multiple).tolist() == expected_expert


def test_well_formed_sizes_are_their_own_effective_sizes():
    for sizes in ([0, 16, 48], [64], [32, 0, 0, 32]):
        assert split_meta.effective_split_sizes(torch.tensor(sizes), 64, 16).tolist() == sizes


@settings(max_examples=25, deadline=None)
@given(offs=st.lists(st.integers(-10, 80), min_size=1, max_size=6), rows=st.integers(0, 64))
def test_group_ends_of_offs_keep_the_last_valid_end(offs, rows):
    expected, last = [], 0
    for end in offs:
        last = max(last, end) if 0 <= end <= rows else last
        expected.append(last)
    assert split_meta.valid_group_ends(torch.tensor(offs), rows).tolist() == expected


@pytest.mark.interp
@settings(max_examples=25, deadline=None)
@given(sizes=SIZES, rows=st.integers(0, 64), multiple=st.sampled_from([1, 2, 16]))
def test_kernel_helper_follows_the_documented_rule(sizes, rows, multiple):
    """``kernels.split_sizes.effective_bounds`` (one prefix sum) against the oracle, extremes included."""
    out = torch.empty(2, 8, dtype=torch.int64)
    split_kernels_probe[(1,)](int_tensor(sizes), out, len(sizes), rows, EXPERTS_POW2=8, MULTIPLE=multiple)
    ends = oracle_ends(sizes, rows, multiple)
    assert out[1, : len(sizes)].tolist() == ends
    assert out[0, : len(sizes)].tolist() == [0, *ends[:-1]]
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    expected = split_meta.valid_group_ends(offs, rows).tolist()
    assert split_kernels.launch_valid_group_ends(offs, rows).tolist() == expected


@settings(max_examples=25, deadline=None)
@given(sizes=SIZES, rows=st.integers(0, 64))
def test_group_ends_op_reference_follows_the_documented_rule(sizes, rows):
    """``lowp::group_ends`` (reference): int32 effective ends, valid ``offs`` of ``grouped_mm``; the
    extended row: the same with the last one ``rows``."""
    got = grouped_mm_ref.group_ends(int_tensor(sizes), rows)
    assert got.dtype == torch.int32 and got.tolist() == oracle_ends(sizes, rows)
    both = grouped_mm_ref.group_ends(int_tensor(sizes), rows, True)
    assert both.shape == (2, len(sizes)) and both[0].tolist() == oracle_ends(sizes, rows)
    assert both[1].tolist() == [*oracle_ends(sizes, rows)[:-1], rows]


@pytest.mark.parametrize("suite", SUITES)
# kernel_device is a constant of the run: sharing it across examples is safe.
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=SIZES, rows=st.integers(0, 64))
def test_group_ends_kernel_follows_the_documented_rule(suite, kernel_device, sizes, rows):
    got = split_kernels.launch_group_ends(int_tensor(sizes, kernel_device), rows)
    assert got.dtype == torch.int32 and got.device.type == torch.device(kernel_device).type
    assert got.cpu().tolist() == oracle_ends(sizes, rows)
    both = split_kernels.launch_group_ends(int_tensor(sizes, kernel_device), rows, True)
    assert both.cpu().tolist() == [oracle_ends(sizes, rows), [*oracle_ends(sizes, rows)[:-1], rows]]


def test_group_ends_op_checks_its_arguments():
    with pytest.raises(ValueError, match="split_sizes must be 1-D int32/int64"):
        lowp_ops.library.group_ends(torch.ones(3), 8)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        lowp_ops.library.group_ends(torch.ones(3, dtype=torch.int32), -1)
    torch.library.opcheck(torch.ops.lowp.group_ends.default, (torch.tensor([3, -1, 9], dtype=torch.int32), 8))
    sizes = torch.tensor([3, -1, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.lowp.group_ends.default, (sizes, 8, True))


@triton.jit
def split_kernels_probe(
    split_ptr, out_ptr, experts, rows, EXPERTS_POW2: tl.constexpr, MULTIPLE: tl.constexpr
):
    """Stores ``effective_bounds``: starts, then ends."""
    start, end = split_kernels.effective_bounds(split_ptr, experts, rows, EXPERTS_POW2, MULTIPLE)
    idx = tl.arange(0, EXPERTS_POW2)
    tl.store(out_ptr + idx, start)
    tl.store(out_ptr + EXPERTS_POW2 + idx, end)


# ------------------------------------------------------------------------------------ argument checks

X = torch.zeros(32, 16, dtype=torch.bfloat16)
BAD_ARGUMENTS = [
    pytest.param([16, 16], TypeError, "split_sizes must be a torch.Tensor", id="list"),
    pytest.param(torch.tensor([True, False]), ValueError, "split_sizes must be 1-D int32/int64", id="bool"),
    pytest.param(torch.tensor([16.0, 16.0]), ValueError, "split_sizes must be 1-D int32/int64", id="float"),
    pytest.param(torch.tensor([[16, 16]]), ValueError, "split_sizes must be 1-D int32/int64", id="2-D"),
    pytest.param(torch.tensor([16, 16], dtype=torch.int16), ValueError, "int32/int64", id="int16"),
    pytest.param(
        torch.tensor([16, 16], device="meta"), ValueError, "split_sizes must be on the device", id="device"
    ),
    pytest.param(
        torch.zeros(0, dtype=torch.int64), ValueError, "split_sizes must have at least one", id="empty"
    ),
]


def mlp_args(split_sizes):
    x = bf16(32, 16, seed=0)
    return (x, bf16(2, 32, 16, seed=1), bf16(2, 16, 16, seed=2), split_sizes, torch.rand(32))


def dglu_args(split_sizes):
    return (torch.randn(32, 8), torch.randn(32, 16), torch.rand(32), split_sizes)


def decode_args(split_sizes):
    return (
        torch.zeros(8 * 32 // 2, dtype=torch.uint8),
        torch.zeros(128, 2 + 4 * 2, dtype=torch.uint8),
        split_sizes,
        8,
        32,
    )


CALLS = {
    "grouped_swiglu_mlp": lambda s: lowp_ops.grouped_swiglu_mlp(*mlp_args(s)),
    "grouped_linear": lambda s: torch.ops.lowp.grouped_linear(X, bf16(2, 8, 16, seed=3), s, "bf16"),
    "nvfp4_group_quantize": lambda s: lowp_ops.nvfp4_group_quantize(X, s, columnwise=True, rht=True),
    "dglu": lambda s: lowp_ops.dglu(*dglu_args(s)),
    "dglu_op": lambda s: torch.ops.lowp.dglu(*dglu_args(s), 0),
    "decode_columns": lambda s: torch.ops.lowp.nvfp4_group_decode_columns(*decode_args(s)),
}


RAW_OPS = ("grouped_linear", "dglu_op", "decode_columns")


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize(("split_sizes", "error", "match"), BAD_ARGUMENTS)
def test_bad_split_size_arguments_raise_naming_them(call, split_sizes, error, match):
    if call in RAW_OPS and error is TypeError:
        error, match = RuntimeError, "for argument 'split_sizes'"  # torch's schema check of a raw op
    with pytest.raises(error, match=match):
        CALLS[call](split_sizes)


def test_a_wrong_expert_count_raises_naming_split_sizes():
    with pytest.raises(ValueError, match="split_sizes must have one entry per expert"):
        CALLS["grouped_swiglu_mlp"](torch.tensor([16, 8, 8]))


# ----------------------------------------------------------------------------------- CPU value checks

VALUE_CASES = [
    # (call, split sizes, match); the well-formed sizes of each call are [16, 16] over 32 rows.
    ("grouped_swiglu_mlp", [20, -4], "split_sizes must be >= 0"),
    ("grouped_swiglu_mlp", [16, 8], "split_sizes must sum to the row count 32, got 24"),
    ("grouped_swiglu_mlp", [16, 24], "split_sizes must sum to the row count 32, got 40"),
    ("grouped_linear", [40, -8], "split_sizes must be >= 0"),
    ("grouped_linear", [8, 8], "split_sizes must sum to the row count"),
    ("nvfp4_group_quantize", [-16, 48], "split_sizes must be >= 0"),
    ("nvfp4_group_quantize", [16, 0], "split_sizes must sum to the row count"),
    ("nvfp4_group_quantize", [8, 24], "split_sizes must be multiples of 16"),
    ("dglu", [40, -8], "split_sizes must be >= 0"),
    ("dglu", [16, 17], "split_sizes must sum to at most the row count 32"),
    ("dglu_op", [16, 17], "split_sizes must sum to at most the row count 32"),
    ("decode_columns", [-2, 34], "split_sizes must be >= 0"),
    ("decode_columns", [15, 17], "split_sizes must be multiples of 2"),
]


@pytest.mark.parametrize(("call", "sizes", "match"), VALUE_CASES)
def test_malformed_values_raise_on_cpu(call, sizes, match):
    with pytest.raises(ValueError, match=match):
        CALLS[call](torch.tensor(sizes))


def test_nvfp4_recipe_needs_multiples_of_16_and_columnwise_needs_even_sizes():
    x = bf16(32, 16, seed=4)
    with pytest.raises(ValueError, match="multiples of 16"):
        lowp_ops.grouped_swiglu_mlp(*mlp_args(torch.tensor([8, 24]))[:4], torch.rand(32), recipe="nvfp4")
    with pytest.raises(ValueError, match="multiples of 2"):
        lowp_ops.nvfp4_group_quantize(x, torch.tensor([7, 25]), columnwise=True)
    lowp_ops.nvfp4_group_quantize(x, torch.tensor([7, 25]))  # row-wise only: any sizes


def test_documented_totals_are_accepted_on_cpu():
    """dGLU allows a short total (rows past it count for no expert); the decode allows any total."""
    CALLS["dglu"](torch.tensor([8, 8]))
    CALLS["decode_columns"](torch.tensor([16, 32]))


def test_invalid_group_ends_of_grouped_mm_raise_on_cpu():
    a, b = bf16(32, 16, seed=5), bf16(2, 16, 8, seed=6)
    for offs, match in (([20, 10], "non-decreasing"), ([-1, 32], "non-decreasing"), ([16, 33], r"\[0, 32\]")):
        with pytest.raises(ValueError, match=match):
            torch.ops.lowp.grouped_mm(a, b, torch.tensor(offs, dtype=torch.int32))


def test_compiled_call_raises_when_it_runs():
    """Dynamo traces no value (no graph break); the op checks when the compiled graph runs it."""
    compiled = torch.compile(lambda s: lowp_ops.dglu(*dglu_args(s)), fullgraph=True)
    compiled(torch.tensor([16, 16]))
    with pytest.raises(ValueError, match="split_sizes must be >= 0"):
        compiled(torch.tensor([40, -8]))


# ---------------------------------------------------------------------------------------------- modes


def test_mode_switch_turns_the_cpu_check_off_and_back_on():
    previous = split_meta.set_split_size_checks("off")
    try:
        assert split_meta.split_size_checks() == "off"
        CALLS["dglu"](torch.tensor([40, -8]))  # the effective boundaries, no error
        split_meta.set_split_size_checks("cpu")
        with pytest.raises(ValueError, match=">= 0"):
            CALLS["dglu"](torch.tensor([40, -8]))
        with pytest.raises(ValueError, match="mode must be one of"):
            split_meta.set_split_size_checks("on")
    finally:
        split_meta.set_split_size_checks(previous)


def test_fake_and_meta_tensors_are_never_read():
    split_meta.check_split_size_values(torch.tensor([-1, 99], device="meta"), 32)
    with torch._subclasses.FakeTensorMode():
        split_meta.check_split_size_values(torch.tensor([-1, 99]), 32)


@pytest.mark.parametrize(("value", "mode"), [("1", "all"), ("0", "off"), ("", "cpu"), ("cpu", "cpu")])
def test_environment_variable_values(monkeypatch, value, mode):
    monkeypatch.setenv(split_meta.ENV_VAR, value)
    assert split_meta._mode_from_env() == mode


def test_environment_variable_is_read_at_import():
    code = "from lowp_ops.meta import split_sizes as s; print(s.split_size_checks())"
    env = {**os.environ, split_meta.ENV_VAR: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "all"
    env[split_meta.ENV_VAR] = "yes"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and split_meta.ENV_VAR in bad.stderr


# ------------------------------------------------------------------ defined results: references (CPU)


def float64_grouped_mm(a: torch.Tensor, b: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Independent float64 loop over the oracle's groups; rows / tokens of no group contribute 0."""
    a, b = a.double(), b.double()
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
        for group, (start, end) in enumerate(bounds):
            out[start:end] = a[start:end] @ b[group]
        return out
    return torch.stack([a[:, start:end] @ b[start:end] for start, end in bounds])


GROUPED_MM_OFFS = [[20, 12, 40], [-5, 30, 64], [16, 70, 48], [0, 0, 0], [64, 64, 200]]


def grouped_mm_operands(layout: str):
    """(a, b) of the (T, K) x (E, K, N) or the (M, T) x (T, N) product, in row- or column-major layouts
    (the kernel copies the ones ``torch._grouped_mm`` restricts)."""
    if layout.startswith("rows"):
        a, b = bf16(T, 24, seed=7), bf16(3, 24, 16, seed=8)
        return (a.t().contiguous().t() if layout.endswith("col_major") else a), b
    a, b = bf16(T, 16, seed=9).t(), bf16(T, 24, seed=10)  # a column-major, b row-major
    return (a.contiguous() if layout.endswith("row_major") else a), b


@pytest.mark.parametrize("offs", GROUPED_MM_OFFS)
@pytest.mark.parametrize("layout", ["rows", "tokens"])
def test_grouped_mm_reference_uses_the_valid_group_ends(checks_off, offs, layout):
    a, b = grouped_mm_operands(layout)
    grouped_len = a.shape[0] if b.dim() == 3 else a.shape[1]
    ends, last = [], 0
    for end in offs:
        last = max(last, end) if 0 <= end <= grouped_len else last
        ends.append(last)
    expected = float64_grouped_mm(a, b, list(itertools.pairwise([0, *ends])))
    got = grouped_mm_ref.grouped_mm(a, b, torch.tensor(offs))
    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=1e-3)
    if b.dim() == 3:
        assert (got[ends[-1] :] == 0).all()


def float64_mlp(x, w1, w2, probs, dy, bounds):
    """(y, dx, dW1, dW2, dprobs) in float64 by autograd over the oracle's experts (rows of none: y = 0)."""
    x, w1, w2, probs = (t.double().requires_grad_() for t in (x, w1, w2, probs))
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for expert, (start, end) in enumerate(bounds):
        gate, linear = (x[start:end] @ w1[expert].t()).chunk(2, dim=1)
        h = torch.nn.functional.silu(gate) * linear * probs[start:end, None]
        y = y.index_put((torch.arange(start, end),), h @ w2[expert].t())
    y.backward(dy.double())
    return y.detach(), x.grad, w1.grad, w2.grad, probs.grad


def lowp_mlp(x, w1, w2, probs, dy, split_sizes, recipe):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, probs)]
    y = lowp_ops.grouped_swiglu_mlp(leaves[0], leaves[1], leaves[2], split_sizes, leaves[3], recipe=recipe)
    y.backward(dy)
    return y.detach(), *(leaf.grad for leaf in leaves)


def mlp_inputs(device="cpu", tokens=T, hidden=32, ffn=16, experts=3):
    return (
        bf16(tokens, hidden, seed=11, device=device),
        bf16(experts, 2 * ffn, hidden, seed=12, device=device),
        bf16(experts, hidden, ffn, seed=13, device=device),
        torch.rand(tokens, generator=torch.Generator().manual_seed(14)).to(device),
        bf16(tokens, hidden, seed=15, device=device),
    )


def assert_rows_of_no_expert_are_zero(outputs, end: int) -> None:
    y, dx, _, _, dprobs = outputs
    for name, t in (("y", y), ("dx", dx), ("dprobs", dprobs)):
        assert (t[end:] == 0).all(), name
        assert torch.isfinite(t).all(), name


@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_bf16_mlp_with_malformed_sizes_matches_float64_over_the_effective_experts(checks_off, sizes):
    inputs = mlp_inputs()
    bounds = oracle_bounds(sizes, T)
    got = lowp_mlp(*inputs, int_tensor(sizes), "bf16")
    expected = float64_mlp(*inputs, bounds)
    for name, g, e in zip(("y", "dx", "dW1", "dW2", "dprobs"), got, expected, strict=True):
        torch.testing.assert_close(g.double(), e, rtol=0.125, atol=0.02, msg=lambda m, n=name: f"{n}: {m}")
    assert_rows_of_no_expert_are_zero(got, bounds[-1][1])


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_quantized_mlp_with_malformed_sizes_is_the_mlp_of_the_effective_sizes(checks_off, recipe, sizes):
    multiple = 16 if recipe == "nvfp4" else 1
    inputs = mlp_inputs()
    got = lowp_mlp(*inputs, int_tensor(sizes), recipe)
    expected = lowp_mlp(*inputs, torch.tensor(oracle_sizes(sizes, T, multiple)), recipe)
    for name, g, e in zip(("y", "dx", "dW1", "dW2", "dprobs"), got, expected, strict=True):
        assert_exact(g, e, name)
    assert_rows_of_no_expert_are_zero(got, oracle_ends(sizes, T, multiple)[-1])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cpu", marks=pytest.mark.interp, id="interp"),
        pytest.param("cuda", marks=pytest.mark.gpu, id="gpu"),
    ],
)
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_rows_past_the_last_end_change_nothing_but_the_fc1_weight_gradient(checks_off, recipe, device):
    """Rows of no expert (past the last end) with large x and zero dy: y, dx and dprobs of the other rows
    and FC2's weight gradient are those of the MLP without those rows, bit for bit. For MXFP8 this needs
    the backward's recomputed h to be +0 there as in the forward (32-row column blocks cross the end);
    only dW1 may differ (x's column-wise blocks hold those rows of x)."""
    end = 40
    x, w1, w2, probs, dy = mlp_inputs(device)
    x[end:], dy[end:] = 3.0, 0.0
    sizes = torch.tensor([16, 0, end - 16], device=device)
    got = lowp_mlp(x, w1, w2, probs, dy, sizes, recipe)
    alone = lowp_mlp(x[:end], w1, w2, probs[:end], dy[:end], sizes, recipe)
    for name, g, e in zip(("y", "dx"), got, alone, strict=False):
        assert_exact(g[:end], e, name)
    assert_exact(got[3], alone[3], "dW2")
    assert_exact(got[4][:end], alone[4], "dprobs")
    assert_rows_of_no_expert_are_zero(got, end)


def dglu_inputs(device="cpu", tokens=T, ffn=32):
    gen = torch.Generator().manual_seed(16)
    grad = torch.randn(tokens, ffn, generator=gen).bfloat16().to(device)
    c = torch.randn(tokens, 2 * ffn, generator=gen).bfloat16().to(device)
    return grad, c, torch.rand(tokens, generator=gen).to(device)


def assert_amax_is_the_max_of_each_effective_expert(dc, amax, bounds) -> None:
    for expert, (start, end) in enumerate(bounds):
        expected = dc[start:end].float().abs().max() if end > start else torch.tensor(0.0)
        assert amax[expert].to(torch.bfloat16).float().cpu() == expected.cpu(), expert


@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_dglu_reference_groups_the_amax_by_the_effective_experts(checks_off, sizes):
    grad, c, probs = dglu_inputs()
    dc, dprobs, amax = swiglu_ref.dglu(grad, c, probs, int_tensor(sizes), 0)
    whole = swiglu_ref.dglu(grad, c, probs, torch.tensor([T]), 0)
    bounds = oracle_bounds(sizes, T)
    end = max(stop for _, stop in bounds)
    assert_exact(dc[:end], whole[0][:end], "dc of the experts' rows is per row")
    assert_exact(dprobs[:end], whole[1][:end], "dprobs of the experts' rows is per row")
    assert_exact(dc[end:], torch.zeros_like(dc[end:]), "dc of rows of no expert")
    assert_exact(dprobs[end:], torch.zeros_like(dprobs[end:]), "dprobs of rows of no expert")
    assert_amax_is_the_max_of_each_effective_expert(dc, amax, bounds)


def assert_quantized_per_expert(outputs, x, bounds, rht: bool) -> None:
    """Each effective expert's rows quantized alone by the ungrouped op; rows of no expert: scales and
    (reference) data 0."""
    row_data, row_scale, col_data, col_scale, amax_row, amax_col = (t.cpu() for t in outputs)
    hidden = x.shape[1]
    starts = nvfp4_ref.group_col_scale_starts(torch.tensor([end - start for start, end in bounds])).tolist()
    for expert, (start, end) in enumerate(bounds):
        if end == start:
            assert amax_row[expert] == 0 and amax_col[expert] == 0
            continue
        alone = nvfp4_ref.nvfp4_quantize(x[start:end].cpu(), True, True, rht, None, None, False)
        assert_exact(row_data[start:end], alone[0], f"row data {expert}")
        assert_exact(row_scale[start:end, : hidden // 16], alone[1][: end - start, : hidden // 16])
        assert_exact(col_data[hidden * start // 2 : hidden * end // 2], alone[2].reshape(-1), f"col {expert}")
        blocks = alone[3].shape[1]
        assert_exact(col_scale[:, starts[expert] : starts[expert] + blocks], alone[3], f"col scale {expert}")
        assert_exact(amax_row[expert : expert + 1], alone[4])
        assert_exact(amax_col[expert : expert + 1], alone[5])
    assert (row_scale[bounds[-1][1] :] == 0).all()


@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_group_quantize_reference_quantizes_the_effective_experts(checks_off, sizes):
    x = bf16(T, 32, seed=17, scale=8.0)
    outputs = nvfp4_ref.nvfp4_group_quantize(x, int_tensor(sizes), True, True, True, None, None)
    bounds = oracle_bounds(sizes, T, 16)
    assert_quantized_per_expert(outputs, x, bounds, rht=True)
    assert (outputs[0][bounds[-1][1] :] == 0).all()


def quantized_columns(x: torch.Tensor):
    """A grouped column-wise copy of well-formed sizes, to decode with other sizes."""
    outputs = nvfp4_ref.nvfp4_group_quantize(x, torch.tensor([16, 32, 16]), False, True, True, None, None)
    return outputs[2], outputs[3]


@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_decode_columns_reference_decodes_the_effective_experts(checks_off, sizes):
    col_data, col_scale = quantized_columns(bf16(T, 32, seed=18, scale=8.0))
    got = decode_ref.nvfp4_group_decode_columns(col_data, col_scale, int_tensor(sizes), 32, T)
    effective = torch.tensor(oracle_sizes(sizes, T, 2))
    assert_exact(got, decode_ref.nvfp4_group_decode_columns(col_data, col_scale, effective, 32, T))
    assert (got[:, oracle_ends(sizes, T, 2)[-1] :] == 0).all()


# ---------------------------------------------------- defined results: kernels (interpreter and CUDA)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("offs", GROUPED_MM_OFFS)
@pytest.mark.parametrize("layout", ["rows", "rows_col_major", "tokens", "tokens_row_major"])
def test_grouped_mm_kernel_uses_the_valid_group_ends(suite, checks_off, kernel_device, offs, layout):
    from lowp_ops.kernels import grouped_mm as grouped_mm_kernels

    a, b = grouped_mm_operands(layout)
    got = grouped_mm_kernels.launch_grouped_mm(
        a.to(kernel_device), b.to(kernel_device), torch.tensor(offs).to(kernel_device)
    )
    expected = grouped_mm_ref.grouped_mm(a, b, torch.tensor(offs))
    torch.testing.assert_close(got.cpu().double(), expected.double(), rtol=2**-7, atol=1e-2)
    if b.dim() == 3:
        assert (got.cpu()[expected.abs().sum(1) == 0] == 0).all()  # the rows of no group, exactly 0


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("offs", GROUPED_MM_OFFS)
@pytest.mark.parametrize("layout", ["rows", "tokens"])
def test_grouped_mm_kernel_on_extended_ends_covers_every_row_without_zeroing(
    suite, checks_off, kernel_device, monkeypatch, offs, layout
):
    """``last_end_is_rows`` with ends whose last is the row count: the product of those groups (float64
    loop), every row written, and no zeroing launch."""
    from lowp_ops.kernels import grouped_mm as grouped_mm_kernels

    a, b = grouped_mm_operands(layout)
    rows = a.shape[0] if layout == "rows" else a.shape[1]
    ends = split_meta.valid_group_ends(torch.tensor(offs), rows).tolist()
    ends[-1] = rows
    zeroings = []
    monkeypatch.setattr(grouped_mm_kernels, "zero_rows_past", lambda out, e: zeroings.append(1) or out)
    extended = torch.tensor(ends, dtype=torch.int32)
    got = grouped_mm_kernels.launch_grouped_mm(
        a.to(kernel_device), b.to(kernel_device), extended.to(kernel_device), True, True
    )
    assert zeroings == []
    expected = float64_grouped_mm(a, b, list(itertools.pairwise([0, *ends])))
    torch.testing.assert_close(got.cpu().double(), expected, rtol=2**-7, atol=1e-2)
    reference = grouped_mm_ref.grouped_mm(a, b, extended, True, True)
    torch.testing.assert_close(reference.double(), expected, rtol=2**-7, atol=1e-2)


def test_grouped_mm_reference_checks_the_promise_of_last_end_is_rows():
    a, b = grouped_mm_operands("rows")
    with pytest.raises(ValueError, match=r"last_end_is_rows=True needs offs\[-1\] == 64"):
        torch.ops.lowp.grouped_mm(a, b, torch.tensor([8, 16, 40], dtype=torch.int32), True, True)


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED] + [[20, 12, 32]], ids=[*MALFORMED_IDS, "valid"])
@pytest.mark.parametrize("layout", ["rows", "tokens"])
def test_grouped_mm_kernel_on_ends_from_group_ends_skips_nothing_it_needs(
    suite, checks_off, kernel_device, monkeypatch, sizes, layout
):
    """``ends_valid=True`` with the int32 ends of ``group_ends``: no validating launch, the product of
    the validated call; with int64 ends the flag is not trusted (the ends are validated)."""
    from lowp_ops.kernels import grouped_mm as grouped_mm_kernels

    a, b = (t.to(kernel_device) for t in grouped_mm_operands(layout))
    sizes_t = int_tensor(sizes, kernel_device)
    ends = split_kernels.launch_group_ends(sizes_t, T)
    validations = []
    real = grouped_mm_kernels.launch_valid_group_ends
    monkeypatch.setattr(
        grouped_mm_kernels, "launch_valid_group_ends", lambda *args: validations.append(1) or real(*args)
    )
    trusted = grouped_mm_kernels.launch_grouped_mm(a, b, ends, True)
    assert validations == []
    checked = grouped_mm_kernels.launch_grouped_mm(a, b, ends)
    untrusted = grouped_mm_kernels.launch_grouped_mm(a, b, ends.long(), True)
    assert len(validations) == 2
    assert_exact(trusted, checked)
    assert_exact(untrusted, checked)
    raw_ends = split_meta.clamped_prefix_sums(sizes_t.cpu(), T)
    assert_exact(checked, grouped_mm_kernels.launch_grouped_mm(a, b, raw_ends.to(kernel_device)))


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_dglu_kernel_groups_the_amax_by_the_effective_experts(suite, checks_off, kernel_device, sizes):
    from lowp_ops.kernels import swiglu as swiglu_kernels

    grad, c, probs = dglu_inputs(kernel_device)
    split_sizes = int_tensor(sizes, kernel_device)
    dc, _, amax = swiglu_kernels.launch_dglu(grad, c, probs, split_sizes, 0)
    bounds = oracle_bounds(sizes, T)
    assert_amax_is_the_max_of_each_effective_expert(dc, amax, bounds)
    end = max(stop for _, stop in bounds)
    assert_exact(dc[end:], torch.zeros_like(dc[end:]), "dc of rows of no expert")
    effective = torch.tensor(oracle_sizes(sizes, T), device=kernel_device)
    assert_exact(amax, swiglu_kernels.launch_dglu(grad, c, probs, effective, 0)[2])


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize(("copies", "rht"), [("both", True), ("both", False), ("rowwise", False)])
@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_group_quantize_kernel_quantizes_the_effective_experts(
    suite, checks_off, kernel_device, copies, rht, sizes
):
    from lowp_ops.kernels import nvfp4 as nvfp4_kernels

    x = bf16(T, 32, seed=19, scale=8.0)
    columnwise = copies == "both"
    multiple = 16 if rht else 2 if columnwise else 1
    outputs = nvfp4_kernels.launch_nvfp4_group_quantize(
        x.to(kernel_device), int_tensor(sizes, kernel_device), True, columnwise, rht, None, None
    )
    bounds = oracle_bounds(sizes, T, multiple)
    expected = nvfp4_ref.nvfp4_group_quantize(
        x, torch.tensor([end - start for start, end in bounds]), True, columnwise, rht, None, None
    )
    end = bounds[-1][1]
    assert_exact(outputs[0][:end], expected[0][:end], "row data of the experts")  # the rest: unspecified
    assert_exact(outputs[1], expected[1], "row scales (0 for rows of no expert)")
    if columnwise:
        assert_exact(outputs[2][: 32 * end // 2], expected[2][: 32 * end // 2], "column data of the experts")
        assert_exact(outputs[3], expected[3], "column scales")
    assert_exact(outputs[4], expected[4])
    assert_exact(outputs[5], expected[5])


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_decode_columns_kernel_decodes_the_effective_experts(suite, checks_off, kernel_device, sizes):
    from lowp_ops.kernels import nvfp4_decode as decode_kernels

    col_data, col_scale = quantized_columns(bf16(T, 32, seed=20, scale=8.0))
    args = (col_data.to(kernel_device), col_scale.to(kernel_device), int_tensor(sizes, kernel_device), 32, T)
    for config in (None, (16, 16, 1)):
        got = decode_kernels.launch_nvfp4_group_decode_columns(*args, config)
        effective = torch.tensor(oracle_sizes(sizes, T, 2))
        assert_exact(got, decode_ref.nvfp4_group_decode_columns(col_data, col_scale, effective, 32, T))


# ------------------------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("sizes", [s for _, s in MALFORMED], ids=MALFORMED_IDS)
def test_cuda_mlp_with_malformed_sizes_is_the_mlp_of_the_effective_sizes(recipe, sizes):
    """No sync, no device assert: the MLP of the effective sizes, rows of no expert exactly 0."""
    multiple = 16 if recipe == "nvfp4" else 1
    inputs = mlp_inputs("cuda", tokens=256, hidden=64, ffn=32)
    scaled = [s * 4 if abs(s) < 2**31 - 1 else s for s in sizes]  # 256 rows
    got = lowp_mlp(*inputs, int_tensor(scaled, "cuda"), recipe)
    torch.cuda.synchronize()
    effective = torch.tensor(oracle_sizes(scaled, 256, multiple), device="cuda")
    expected = lowp_mlp(*inputs, effective, recipe)
    for name, g, e in zip(("y", "dx", "dW1", "dW2", "dprobs"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert_rows_of_no_expert_are_zero(got, oracle_ends(scaled, 256, multiple)[-1])
    if recipe == "bf16":  # and against float64, independently of the kernels' handling of those rows
        exact = float64_mlp(*(t.cpu() for t in inputs), oracle_bounds(scaled, 256))
        for name, g, e in zip(("y", "dx", "dW1", "dW2", "dprobs"), got, exact, strict=True):
            torch.testing.assert_close(
                g.cpu().double(), e, rtol=0.125, atol=0.02, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.gpu
def test_cuda_host_check_mode_raises_like_cpu():
    previous = split_meta.set_split_size_checks("all")
    try:
        x, w1, w2, probs, _ = mlp_inputs("cuda", tokens=32)
        with pytest.raises(ValueError, match="split_sizes must be >= 0"):
            lowp_ops.grouped_swiglu_mlp(x, w1, w2, torch.tensor([40, -8, 0], device="cuda"), probs)
        with pytest.raises(ValueError, match="split_sizes must sum to the row count"):
            lowp_ops.nvfp4_group_quantize(x, torch.tensor([16, 0, 0], device="cuda"))
        grad, c, p = dglu_inputs("cuda", tokens=32)
        with pytest.raises(ValueError, match="sum to at most"):
            lowp_ops.dglu(grad, c, p, torch.tensor([16, 17], device="cuda"))
        with pytest.raises(ValueError, match="non-decreasing"):
            torch.ops.lowp.grouped_mm(x, w2, torch.tensor([20, 10, 32], device="cuda", dtype=torch.int32))
    finally:
        split_meta.set_split_size_checks(previous)


@pytest.mark.cudagraph
def test_host_check_mode_is_skipped_inside_a_cuda_graph_capture():
    """Mode "all" reads nothing while capturing; a replay with malformed sizes gives the effective result."""
    previous = split_meta.set_split_size_checks("all")
    try:
        grad, c, probs = dglu_inputs("cuda")
        static_sizes = torch.tensor([16, 16, 32], device="cuda")
        lowp_ops.dglu(grad, c, probs, static_sizes)  # warm-up (compiles the kernel)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, _, static_amax = lowp_ops.dglu(grad, c, probs, static_sizes)
        static_sizes.copy_(torch.tensor([20, -5, 100], device="cuda"))
        graph.replay()
        split_meta.set_split_size_checks("off")
        assert_exact(static_amax, lowp_ops.dglu(grad, c, probs, torch.tensor([20, 0, 0], device="cuda"))[2])
    finally:
        split_meta.set_split_size_checks(previous)
