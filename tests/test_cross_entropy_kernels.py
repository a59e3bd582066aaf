"""The Triton cross-entropy kernels against the pure-PyTorch references, and the MXFP8-gradient byte
contract between the two backward kernels (the softmax kernels: test_softmax_kernels.py).

- ``interp``: CPU tensors under ``TRITON_INTERPRET=1`` (small shapes; run with
  ``TRITON_INTERPRET=1 LOWP_OPS_CPU_KERNELS=triton pytest -m interp``). The interpreter truncates fp32 -> bf16
  stores instead of rounding to nearest, so bf16 outputs can sit one ulp below the reference there; the
  one-ulp tolerances below cover it, and the byte contract holds because both kernels round the same way.
- ``gpu``: CUDA at real sizes (N=4096 x V=129280 bf16, N=1000 x V=50257, odd V).

Tolerances: forward statistics (fp32) within 1e-5 relative plus fp32 roundoff of the magnitudes involved;
gradients within one ulp of the output dtype around the reference's fp32 value, plus the fp32 roundoff of
the math before rounding (the GPU's ``exp`` is approximate). The byte contract is exact.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from ce_softmax_oracles import (
    assert_close_fp32,
    assert_within_ulps,
    bits,
    ce_grad_fp32_slack,
    ce_loss_fp32_atol,
    cross_entropy_oracle,
    masked_softmax_inputs,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_suites import assert_mxfp8_scale_padding_is_zero, assert_plans_follow

import lowp_ops
from lowp_ops.reference import cross_entropy as ce_ref

triton = pytest.importorskip("triton")
from lowp_ops.kernels import cross_entropy as ce_kernels  # noqa: E402
from lowp_ops.kernels import mxfp8 as mxfp8_kernels  # noqa: E402
from lowp_ops.kernels import softmax as softmax_kernels  # noqa: E402

NEG_INF = float("-inf")
IGNORE = -100
FP8_LAYOUTS = [(fp8, layout) for fp8 in ("e4m3", "e5m2") for layout in ("compact", "swizzled")]
COPIES = [(True, True), (True, False), (False, True)]
INTERP_SETTINGS = settings(max_examples=10, deadline=None)
CHECK_ROWS = 512


# ------------------------------------------------------------------------------------------ inputs


def ce_inputs(
    n_rows: int, n_cols: int, dtype: torch.dtype, device: str, *, seed: int = 0, special_rows: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits with sparse -inf, every 7th row ignored and, when there are enough rows: a masked
    first forward block (FWD_BLOCK columns), a masked first 32768 columns, an ignored all -inf row, a
    non-ignored all -inf row (NaN) and a -inf target logit (loss +inf)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n_rows, n_cols, generator=gen, device=device) * 4
    logits[torch.rand(n_rows, n_cols, generator=gen, device=device) < 0.1] = NEG_INF
    target = torch.randint(0, n_cols, (n_rows,), generator=gen, device=device)
    target[::7] = IGNORE
    if special_rows and n_rows >= 6 and n_cols >= 2:
        logits[1, : min(n_cols - 1, ce_kernels.FWD_BLOCK)] = NEG_INF
        logits[1, n_cols - 1] = 1.0
        target[1] = n_cols - 1
        if n_cols > 32768:
            logits[2, :32768] = NEG_INF
        logits[3] = NEG_INF
        target[3] = IGNORE
        logits[4] = NEG_INF
        target[4] = 0
        target[5] = 0
        logits[5, 0] = NEG_INF
    return logits.to(dtype), target


def grad_rows_for(n_rows: int, device: str, kind: str, seed: int = 1) -> torch.Tensor:
    if kind == "expanded":  # a stride-0 view, as autograd hands in for sum/mean
        return torch.tensor(0.37, device=device).expand(n_rows)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(n_rows, generator=gen, device=device) - 0.3


# -------------------------------------------------------------------------------- cross entropy


def check_ce_forward(logits, target, label_smoothing):
    loss, stats = ce_kernels.launch_cross_entropy_fwd(logits, target, label_smoothing, IGNORE)
    want_loss, want_stats = ce_ref.cross_entropy_fwd(logits, target, label_smoothing, IGNORE)
    assert loss.dtype == stats.dtype == torch.float32 and loss.shape == target.shape
    assert stats.shape == (2, *target.shape), "row statistics (shift, log_sum)"
    atol = ce_loss_fp32_atol(logits)
    assert_close_fp32(loss, want_loss, rtol=1e-5, atol=atol, what="loss")
    assert torch.equal(stats[0], want_stats[0]), "shift: the exact row maximum"
    assert_close_fp32(stats[1], want_stats[1], rtol=1e-5, atol=atol, what="log_sum")
    return stats


def check_ce_backward(logits, target, lse, grad_rows, label_smoothing):
    got = ce_kernels.launch_cross_entropy_bwd(logits, target, lse, grad_rows, label_smoothing, IGNORE)
    want = ce_ref.cross_entropy_grad_fp32(logits, target, lse, grad_rows, label_smoothing, IGNORE)
    assert got.dtype == logits.dtype and got.shape == logits.shape and got.is_contiguous()
    row_weight = torch.where(target != IGNORE, grad_rows, 0.0)
    for start in range(0, logits.shape[0], CHECK_ROWS):  # bounded float64 temporaries at real sizes
        rows = slice(start, start + CHECK_ROWS)
        assert_within_ulps(
            got[rows],
            want[rows].double(),
            ulps=1,
            slack=ce_grad_fp32_slack(logits[rows], row_weight[rows]),
            what="dlogits",
        )
    ignored = target == IGNORE
    assert (got[ignored] == 0).all(), "ignored rows must get an exact zero gradient"


def check_mxfp8_contract(
    logits, target, lse, grad_rows, label_smoothing, fp8_dtype, rowwise, columnwise, scale_layout, gluon=None
):
    """launch_cross_entropy_bwd_mxfp8 == launch_mxfp8_quantize(launch_cross_entropy_bwd), byte for byte,
    and the scales' padding holds zeros (with ``poisoned_empty``, a byte no launch wrote shows).
    ``gluon``: which fused kernel (None: the launcher's choice, Gluon on CUDA)."""
    fused = ce_kernels.launch_cross_entropy_bwd_mxfp8(
        logits,
        target,
        lse,
        grad_rows,
        label_smoothing,
        IGNORE,
        fp8_dtype,
        rowwise,
        columnwise,
        scale_layout,
        gluon=gluon,
    )
    grad = ce_kernels.launch_cross_entropy_bwd(logits, target, lse, grad_rows, label_smoothing, IGNORE)
    quantized = mxfp8_kernels.launch_mxfp8_quantize(grad, fp8_dtype, rowwise, columnwise, scale_layout)
    for name, got, want in zip(
        ("row_data", "row_scale", "col_data", "col_scale"), fused, quantized, strict=True
    ):
        assert got.dtype == want.dtype == torch.uint8 and got.shape == want.shape, name
        assert torch.equal(got, want), f"{name}: {int((got != want).sum())} bytes differ"
    assert_mxfp8_scale_padding_is_zero(fused[1], fused[3], *logits.shape, scale_layout)
    if rowwise:
        assert fused[0].numel() == logits.numel()
    if columnwise:
        assert fused[2].numel() == logits.numel()


def check_select_free_tiles(n_cols: int, dtype: torch.dtype, device: str, label_smoothing: float) -> None:
    """Tiles whose rows are neither ignored nor hold their target column skip the per-element selects
    (a tile-uniform branch). Their gradient must be bit-identical to the full formula's: rows 0-30 are
    computed once in a block that takes that path (no ignored row, targets in columns 0-127 only) and
    once with row 31 ignored, which sends the whole block down the full path."""
    logits, target = ce_inputs(64, n_cols, dtype, device, special_rows=False)
    gen = torch.Generator(device=device).manual_seed(3)
    target[:32] = torch.randint(0, 128, (32,), generator=gen, device=device)
    lse = ce_kernels.launch_cross_entropy_fwd(logits, target, label_smoothing, IGNORE)[1]
    grad_rows = grad_rows_for(64, device, "dense")
    check_ce_backward(logits, target, lse, grad_rows, label_smoothing)
    check_mxfp8_contract(logits, target, lse, grad_rows, label_smoothing, "e4m3", True, True, "compact")
    fast = ce_kernels.launch_cross_entropy_bwd(logits, target, lse, grad_rows, label_smoothing, IGNORE)
    target[31] = IGNORE
    full = ce_kernels.launch_cross_entropy_bwd(logits, target, lse, grad_rows, label_smoothing, IGNORE)
    assert torch.equal(bits(fast[:31]), bits(full[:31])), "select-free tiles differ from the full formula"
    assert (full[31] == 0).all()
    check_mxfp8_contract(logits, target, lse, grad_rows, label_smoothing, "e5m2", True, True, "swizzled")


def check_row_segments_equal_tiles(n_rows: int, n_cols: int, dtype: torch.dtype, device: str) -> None:
    """The backward of unaligned rows (one program per row segment, vector-wide body, ragged ends apart)
    gives the tile kernel's bytes, with every loss feature, ignored rows and -inf logits."""
    logits, target = ce_inputs(n_rows, n_cols, dtype, device)
    gen = torch.Generator(device=device).manual_seed(5)
    weight = torch.rand(n_cols, generator=gen, device=device) + 0.5
    grad_rows = grad_rows_for(n_rows, device, "dense")
    for label_smoothing, class_weight, z_loss, softcap in [
        (0.0, None, 0.0, 0.0),
        (0.1, None, 0.0, 0.0),
        (0.1, weight, 0.0, 0.0),
        (0.0, weight, 1e-3, 0.0),
        (0.0, None, 1e-3, 0.0),
        (0.1, None, 1e-3, 30.0),
    ]:
        features = (class_weight, z_loss, softcap)
        stats = ce_kernels.launch_cross_entropy_fwd(logits, target, label_smoothing, IGNORE, *features)[1]
        args = (logits, target, stats, grad_rows, label_smoothing, IGNORE, 0, 0, *features)
        by_row = ce_kernels.launch_cross_entropy_bwd(*args, by_row=True)
        tile = ce_kernels.launch_cross_entropy_bwd(*args, by_row=False)
        what = f"rows != tiles: {label_smoothing=} {z_loss=} {softcap=}"
        assert torch.equal(bits(by_row), bits(tile)), what
    chosen = n_cols % 16 != 0 and n_cols >= ce_kernels.ROWS_BLOCK
    assert ce_kernels.aligned_row_programs(n_cols, logits.is_contiguous()) == chosen


# interp ----------------------------------------------------------------------------------------------


@st.composite
def small_ce_inputs(draw):
    n_rows, n_cols = draw(st.integers(1, 70)), draw(st.integers(1, 600))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    logits, target = ce_inputs(n_rows, n_cols, dtype, "cpu", seed=draw(st.integers(0, 2**31)))
    return logits, target, draw(st.sampled_from([0.0, 0.1, 0.7]))


@pytest.mark.interp
@INTERP_SETTINGS
@given(data=small_ce_inputs(), grad_kind=st.sampled_from(["dense", "expanded"]))
def test_interp_cross_entropy_kernels_match_reference(data, grad_kind):
    logits, target, label_smoothing = data
    lse = check_ce_forward(logits, target, label_smoothing)
    check_ce_backward(logits, target, lse, grad_rows_for(len(target), "cpu", grad_kind), label_smoothing)


@pytest.mark.interp
@pytest.mark.parametrize(
    ("n_rows", "n_cols", "dtype"),
    [
        (6, ce_kernels.FWD_BLOCK + 77, torch.float32),  # two forward blocks; the first all -inf in row 1
        (70, 257, torch.bfloat16),  # several 32-row backward tiles and 128-column tiles, ragged edges
        (64, 256, torch.bfloat16),  # whole tiles only (the kernels' unmasked path)
        (33, 129, torch.float16),
        (1, 1, torch.float32),
    ],
)
def test_interp_cross_entropy_kernels_match_reference_at_block_edges(n_rows, n_cols, dtype):
    logits, target = ce_inputs(n_rows, n_cols, dtype, "cpu")
    for label_smoothing in (0.0, 0.1):
        lse = check_ce_forward(logits, target, label_smoothing)
        check_ce_backward(logits, target, lse, grad_rows_for(n_rows, "cpu", "dense"), label_smoothing)


@pytest.mark.interp
@pytest.mark.parametrize("n_cols", [32768 + 4096, 2 * 32768 + 4104])  # the main and the peeled forward
def test_interp_forward_in_parts_matches_the_reference(n_cols):
    """Rows past 32768 classes fold in 32768-class parts merged in order (``softmax.merge_row_stats``):
    loss and statistics against the reference, with label smoothing (the merged shifted sums) on rows
    with no -inf, a row whose first part is all -inf and one whose maximum lies in its last part."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, n_cols, generator=gen) * 4
    logits[1, :32768] = NEG_INF
    logits[2, -5] = 40.0
    target = torch.randint(0, n_cols, (4,), generator=gen)
    for label_smoothing in (0.0, 0.1):
        check_ce_forward(logits.to(torch.bfloat16), target, label_smoothing)


@pytest.mark.interp
def test_interp_cross_entropy_forward_reads_strided_rows():
    logits, target = ce_inputs(40, 300, torch.float32, "cpu")
    padded = torch.zeros(40, 310)
    padded[:, 5:305] = logits
    check_ce_forward(padded[:, 5:305], target, 0.1)
    check_ce_forward(logits.t().contiguous().t(), target, 0.1)


@pytest.mark.interp
@pytest.mark.parametrize(("rowwise", "columnwise"), COPIES)
@pytest.mark.parametrize(("fp8_dtype", "scale_layout"), FP8_LAYOUTS)
@pytest.mark.usefixtures("poisoned_empty")
def test_interp_mxfp8_grad_kernel_is_bytes_of_quantized_grad(fp8_dtype, scale_layout, rowwise, columnwise):
    for n_rows, n_cols in [(37, 333), (64, 256)]:  # ragged tiles; whole tiles only
        logits, target = ce_inputs(n_rows, n_cols, torch.bfloat16, "cpu")
        _, lse = ce_ref.cross_entropy_fwd(logits, target, 0.1, IGNORE)
        check_mxfp8_contract(
            logits,
            target,
            lse,
            grad_rows_for(n_rows, "cpu", "dense"),
            0.1,
            fp8_dtype,
            rowwise,
            columnwise,
            scale_layout,
        )


@pytest.mark.interp
def test_interp_mxfp8_grad_kernel_contract_with_long_rows_and_scalar_grad():
    logits, target = ce_inputs(6, ce_kernels.FWD_BLOCK + 77, torch.bfloat16, "cpu")
    lse = ce_kernels.launch_cross_entropy_fwd(logits, target, 0.0, IGNORE)[1]
    check_mxfp8_contract(
        logits, target, lse, grad_rows_for(6, "cpu", "expanded"), 0.0, "e4m3", True, True, "swizzled"
    )


@pytest.mark.interp
@settings(max_examples=6, deadline=None)
@given(
    data=small_ce_inputs(),
    fp8_layout=st.sampled_from(FP8_LAYOUTS),
    copies=st.sampled_from(COPIES),
    grad_kind=st.sampled_from(["dense", "expanded"]),
)
def test_interp_mxfp8_grad_kernel_contract_property(data, fp8_layout, copies, grad_kind):
    logits, target, label_smoothing = data
    lse = ce_kernels.launch_cross_entropy_fwd(logits, target, label_smoothing, IGNORE)[1]
    fp8_dtype, scale_layout = fp8_layout
    check_mxfp8_contract(
        logits,
        target,
        lse,
        grad_rows_for(len(target), "cpu", grad_kind),
        label_smoothing,
        fp8_dtype,
        *copies,
        scale_layout,
    )


@pytest.mark.interp
@pytest.mark.parametrize(("n_cols", "dtype"), [(1024, torch.bfloat16), (1000, torch.float16)])
def test_interp_select_free_tiles_equal_the_full_formula(n_cols, dtype):
    for label_smoothing in (0.0, 0.1):
        check_select_free_tiles(n_cols, dtype, "cpu", label_smoothing)


@pytest.mark.interp
@pytest.mark.parametrize(
    ("n_rows", "n_cols", "dtype"), [(45, 201, torch.bfloat16), (9, 130, torch.float32), (3, 5, torch.float16)]
)
def test_interp_row_segment_backward_equals_the_tile_kernel(n_rows, n_cols, dtype, monkeypatch):
    monkeypatch.setattr(ce_kernels, "ROWS_BLOCK", 64)  # several segments per row at interpreter sizes
    check_row_segments_equal_tiles(n_rows, n_cols, dtype, "cpu")


@pytest.mark.interp
def test_interp_row_segment_backward_of_a_vocabulary_shard(monkeypatch):
    """A shard of a 3-way vocabulary (ids [201, 402) of 603): targets global, some in other shards, class
    weights of the whole vocabulary; the row-segment kernel gives the tile kernel's bytes."""
    monkeypatch.setattr(ce_kernels, "ROWS_BLOCK", 64)
    n_rows, n_cols = 40, 201
    logits, _ = ce_inputs(n_rows, n_cols, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(7)
    target = torch.randint(0, 3 * n_cols, (n_rows,), generator=gen)
    target[::5] = IGNORE
    weight = torch.rand(3 * n_cols, generator=gen) + 0.5
    stats = ce_kernels.launch_cross_entropy_fwd(logits, target.clamp(0, n_cols - 1), 0.1, IGNORE)[1]
    grad_rows = grad_rows_for(n_rows, "cpu", "dense")
    for class_weight in (None, weight):
        args = (logits, target, stats, grad_rows, 0.1, IGNORE, n_cols, 3 * n_cols, class_weight)
        by_row = ce_kernels.launch_cross_entropy_bwd(*args, by_row=True)
        tile = ce_kernels.launch_cross_entropy_bwd(*args, by_row=False)
        assert torch.equal(bits(by_row), bits(tile)), f"weights: {class_weight is not None}"


# gpu -------------------------------------------------------------------------------------------------

GPU_CE_SHAPES = [
    (4096, 129280, torch.bfloat16),
    (1000, 50257, torch.bfloat16),
    (1000, 50257, torch.float32),
    (77, 333, torch.float16),
    (33, 4097, torch.bfloat16),
    (1, 1, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("n_rows", "n_cols", "dtype"), GPU_CE_SHAPES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_gpu_cross_entropy_kernels_match_reference(n_rows, n_cols, dtype, label_smoothing):
    logits, target = ce_inputs(n_rows, n_cols, dtype, "cuda")
    lse = check_ce_forward(logits, target, label_smoothing)
    for kind in ("dense", "expanded"):
        check_ce_backward(logits, target, lse, grad_rows_for(n_rows, "cuda", kind), label_smoothing)


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize(("fp8_dtype", "scale_layout"), FP8_LAYOUTS)
@pytest.mark.parametrize(
    ("n_rows", "n_cols", "label_smoothing", "grad_kind"),
    [
        (4096, 129280, 0.0, "expanded"),
        (1000, 50257, 0.1, "dense"),
        (1000, 50257, 0.0, "expanded"),  # one dloss for every row, rows not 16-byte aligned
        (77, 333, 0.1, "dense"),
        (40, 256, 0.0, "dense"),
    ],
)
@pytest.mark.usefixtures("poisoned_empty")
def test_gpu_mxfp8_grad_kernel_is_bytes_of_quantized_grad(
    fp8_dtype, scale_layout, n_rows, n_cols, label_smoothing, grad_kind, gluon
):
    logits, target = ce_inputs(n_rows, n_cols, torch.bfloat16, "cuda")
    lse = ce_kernels.launch_cross_entropy_fwd(logits, target, label_smoothing, IGNORE)[1]
    check_mxfp8_contract(
        logits,
        target,
        lse,
        grad_rows_for(n_rows, "cuda", grad_kind),
        label_smoothing,
        fp8_dtype,
        True,
        True,
        scale_layout,
        gluon=gluon,
    )


def spy_gluon_kernels(monkeypatch) -> list[tuple[int, tuple]]:
    """Record (``LOAD_MOD``, grid) of every launch of the Gluon MXFP8 kernel (-1: aligned rows)."""
    from lowp_ops.kernels import cross_entropy_gluon

    launches = []
    kernel = cross_entropy_gluon.cross_entropy_bwd_mxfp8_gluon_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((meta["LOAD_MOD"], grid))
                return kernel[grid](*args, **meta)

            return launch

        def bind(self, grid, *, exact_ints=True, **meta):  # the launchers' plans bind the kernel once
            return lambda *args: self[grid](*args, **meta)

    monkeypatch.setattr(cross_entropy_gluon, "cross_entropy_bwd_mxfp8_gluon_kernel", Spy())
    return launches


def sm90_ptx(kernel, constexprs: dict, dtypes: dict, divisible: tuple[str, ...] = ()) -> str:
    """PTX of a Gluon kernel compiled for sm_90 on this machine (no GPU needed): pointers and the
    integers named in ``divisible`` multiples of 16, other run-time arguments i32 unless ``dtypes``
    says otherwise, 2 warps, FMA contraction as the kernel's launches pin it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon

    names = [p.name for p in kernel.jit_function.params]
    signature = {n: "constexpr" if n in constexprs else dtypes.get(n, "i32") for n in names}
    values = {(i,): constexprs[n] for i, n in enumerate(names) if n in constexprs}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if signature[n].startswith("*") or n in divisible
    }
    source = gluon._runtime.GluonASTSource(kernel.jit_function, signature, values, attrs)
    options = {"num_warps": 2, "enable_fp_fusion": kernel.fp_fusion}  # as its launches compile it
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.parametrize(("load_mod", "even"), [(-1, False), (-1, True), (0, False), (1, False), (3, True)])
def test_gluon_mxfp8_kernel_accesses_memory_vector_wide(load_mod, even):
    """The Gluon kernel's sm_90 code (compiled here, run on the GPU by the tests below): per thread,
    one 16-byte logits load per 8 columns of its 8 rows where rows are aligned or realigned from an
    aligned row stride, two where the stride is skewed; one 8-byte store per row and copy (the FP8
    rows are padded to 16 bytes), and no local memory (no spills); ``EVEN`` (whole tiles, maskless
    stores) the same."""
    import triton.language as tl

    from lowp_ops.kernels import cross_entropy_gluon

    pointers = ("target_ptr", "shift_ptr", "log_sum_ptr", "grad_ptr", "weight_ptr", "smooth_total_ptr")
    dtypes = {name: "*fp32" for name in pointers} | {"target_ptr": "*i64", "logits_ptr": "*bf16"}
    dtypes |= {"row_data_ptr": "*fp8e4nv", "col_data_ptr": "*fp8e4nv", "row_scale_ptr": "*u8"}
    dtypes |= {"col_scale_ptr": "*u8", "smoothing_eps": "fp32", "target_weight": "fp32"}
    constexprs = {"HAS_SMOOTHING": True, "HAS_WEIGHT": False, "FP8_MAX": 448.0, "MAX_RCP": 1 / 448.0}
    constexprs |= {"OUT_DTYPE": tl.float8e4nv, "ROWWISE": True, "COLWISE": True, "SWIZZLED": False}
    constexprs |= {"LOAD_MOD": load_mod, "EVEN": even}
    # The launcher's integers as Triton specializes them: the FP8 row stride a multiple of 16.
    divisible = ("data_stride",) + (("stride_row", "n_cols") if load_mod < 0 else ())
    ptx = sm90_ptx(cross_entropy_gluon.cross_entropy_bwd_mxfp8_gluon_kernel, constexprs, dtypes, divisible)
    assert len(re.findall(r"ld\.global[.\w:]*\.v4\.b32", ptx)) == (16 if load_mod > 0 else 8)
    assert len(re.findall(r"ld\.global[.\w:]*\.b16", ptx)) == 0, "a logits element loaded alone"
    stores = re.findall(r"st\.global[.\w:]*\s", ptx)
    assert sum(op.rstrip().endswith((".v2.b32", ".b64")) for op in stores) == 16, stores
    assert "shfl.sync.idx" not in ptx, "a lane exchange for the stores (the padded rows need none)"
    assert ".local" not in ptx, "spills"


# (rows, n_cols, row stride, dtype): every n_cols mod 8, strides wider than n_cols, fp16 / fp32 logits
REALIGNED_CASES = [
    (100, 50257, 50257, torch.bfloat16),
    (77, 4099, 4099, torch.bfloat16),
    (64, 1026, 1026, torch.float16),
    (33, 1028, 1028, torch.bfloat16),
    (40, 1030, 1030, torch.bfloat16),
    (31, 1029, 1029, torch.float32),
    (50, 1031, 1031, torch.bfloat16),
    (96, 3000, 3000, torch.bfloat16),
    (65, 1000, 1003, torch.bfloat16),
    (70, 1001, 1004, torch.float32),
    (32, 130, 133, torch.bfloat16),
    (40, 1000, 1008, torch.bfloat16),  # an aligned row stride, n_cols not a multiple of 16
]


@pytest.mark.gpu
@pytest.mark.parametrize(("n_rows", "n_cols", "stride", "dtype"), REALIGNED_CASES)
@pytest.mark.parametrize(("rowwise", "columnwise"), COPIES)
@pytest.mark.usefixtures("poisoned_empty")
def test_gpu_realigned_mxfp8_gluon_kernel_is_bytes_of_triton_kernel(
    n_rows, n_cols, stride, dtype, rowwise, columnwise, monkeypatch
):
    """Rows that are not 16-byte aligned: the Gluon kernel (spied), realigning them, writes the Triton
    kernel's bytes, with label smoothing, class weights, ignored and masked rows, both FP8 formats and
    both scale layouts."""
    launches = spy_gluon_kernels(monkeypatch)
    buffer, target = ce_inputs(n_rows, stride, dtype, "cuda", seed=n_cols)
    logits = buffer[:, :n_cols]
    target = torch.where(target >= n_cols, target % n_cols, target)
    gen = torch.Generator(device="cuda").manual_seed(n_rows)
    weight = torch.rand(n_cols, generator=gen, device="cuda") + 0.5
    for fp8_dtype, label_smoothing, class_weight, grad_kind, scale_layout in [
        ("e4m3", 0.1, None, "dense", "compact"),
        ("e5m2", 0.0, weight, "expanded", "swizzled"),
    ]:
        lse = ce_kernels.launch_cross_entropy_fwd(logits, target, label_smoothing, IGNORE, class_weight)[1]
        args = (logits, target, lse, grad_rows_for(n_rows, "cuda", grad_kind), label_smoothing, IGNORE)
        args += (fp8_dtype, rowwise, columnwise, scale_layout, 0, 0, class_weight)
        got = ce_kernels.launch_cross_entropy_bwd_mxfp8(*args)
        want = ce_kernels.launch_cross_entropy_bwd_mxfp8(*args, gluon=False)
        for name, g, w in zip(("row_data", "row_scale", "col_data", "col_scale"), got, want, strict=True):
            assert torch.equal(g, w), f"{fp8_dtype} {name}: {int((g != w).sum())} bytes differ"
        assert_mxfp8_scale_padding_is_zero(got[1], got[3], n_rows, n_cols, scale_layout)
    per_16_bytes = 16 // logits.element_size()
    assert [load_mod for load_mod, _ in launches] == [stride % per_16_bytes] * 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("scale_layout", "n_cols", "shard_start", "gluon_runs"),
    [
        ("compact", 3000, 0, True),
        ("swizzled", 3072, 0, False),
        ("swizzled", 3000, 0, True),  # rows that are not 16-byte aligned
        ("compact", 100, 0, False),
        ("compact", 3000, 64, True),
    ],
)
@pytest.mark.usefixtures("poisoned_empty")
def test_gpu_launcher_picks_the_gluon_kernel(scale_layout, n_cols, shard_start, gluon_runs, monkeypatch):
    """On CUDA the launcher runs the Gluon kernel (spied) for >= 128 columns with compact scales or rows
    that are not 16-byte aligned, also for a vocabulary shard (starting at ``shard_start``), the Triton
    one otherwise; the two write the same bytes."""
    launches = spy_gluon_kernels(monkeypatch)
    logits, target = ce_inputs(100, n_cols, torch.bfloat16, "cuda", seed=5)
    lse = ce_kernels.launch_cross_entropy_fwd(logits, target, 0.1, IGNORE)[1]
    grad_rows = grad_rows_for(100, "cuda", "dense")
    shard = (shard_start, n_cols + 2 * shard_start) if shard_start else (0, 0)
    args = (logits, target, lse, grad_rows, 0.1, IGNORE, "e4m3", True, True, scale_layout, *shard)
    got = ce_kernels.launch_cross_entropy_bwd_mxfp8(*args)
    assert [grid for _, grid in launches] == ([(4 * math.ceil(n_cols / 128),)] if gluon_runs else [])
    want = ce_kernels.launch_cross_entropy_bwd_mxfp8(*args, gluon=False)
    for name, g, w in zip(("row_data", "row_scale", "col_data", "col_scale"), got, want, strict=True):
        assert torch.equal(g, w), f"{name}: {int((g != w).sum())} bytes differ"
    assert_mxfp8_scale_padding_is_zero(got[1], got[3], 100, n_cols, scale_layout)


@pytest.mark.gpu
@pytest.mark.parametrize(("rowwise", "columnwise"), COPIES[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_gpu_mxfp8_grad_kernel_contract_one_copy_other_dtypes(rowwise, columnwise, dtype, gluon):
    logits, target = ce_inputs(1000, 50257, dtype, "cuda", seed=3)
    lse = ce_kernels.launch_cross_entropy_fwd(logits, target, 0.1, IGNORE)[1]
    check_mxfp8_contract(
        logits,
        target,
        lse,
        grad_rows_for(1000, "cuda", "dense"),
        0.1,
        "e5m2",
        rowwise,
        columnwise,
        "swizzled",
        gluon=gluon,
    )


# ------------------------------------------------------------------------------ the launchers' plans

PLAN_VARIANTS = [
    {},
    {"layout": "permuted"},
    {"layout": "row-strided"},
    {"smoothing": 0.1},
    {"weight": True},
    {"target": torch.int32},
    {"grad_rows": "expanded"},
    {"z_loss": 1e-3, "softcap": 5.0},
    {"dtype": torch.float32},
    {"ignore_index": 3},
    {"mean": False, "fp8": ("e5m2", True, False, "swizzled")},
    {"grad_loss": "scalar"},
    {"grad_loss": "rows", "layout": "row-strided"},
    {},
]


def launcher_outputs(variant: dict, device: str) -> list[torch.Tensor]:
    """Every output of the six cross-entropy launchers (the MXFP8 loss's and the reduced loss's too) for
    one shape (40 x 96) and ``variant``'s layout and options, as bit patterns."""
    logits, target = ce_inputs(40, 96, variant.get("dtype", torch.bfloat16), device)
    if variant.get("layout") == "permuted":
        logits = logits.t().contiguous().t()
    elif variant.get("layout") == "row-strided":
        logits = torch.cat([logits, logits[:, :8]], 1)[:, :96]
    target = target.to(variant.get("target", torch.int64))
    gen = torch.Generator().manual_seed(4)
    weight = (torch.rand(96, generator=gen) + 0.5).to(device) if variant.get("weight") else None
    grad_rows = grad_rows_for(40, device, variant.get("grad_rows", "dense"))
    options = (variant.get("smoothing", 0.0), variant.get("ignore_index", IGNORE))
    features = (weight, variant.get("z_loss", 0.0), variant.get("softcap", 0.0))
    fp8, rowwise, columnwise, scale_layout = variant.get("fp8", ("e4m3", True, True, "compact"))
    loss_rows, stats = ce_kernels.launch_cross_entropy_fwd(logits, target, *options, *features)
    reduced = ce_kernels.launch_cross_entropy_reduce(
        loss_rows, target, options[1], variant.get("mean", True), weight
    )
    grad = ce_kernels.launch_cross_entropy_bwd(logits, target, stats, grad_rows, *options, 0, 0, *features)
    payload = ce_kernels.launch_cross_entropy_bwd_mxfp8(
        logits, target, stats, grad_rows, *options, fp8, rowwise, columnwise, scale_layout, 0, 0, *features
    )
    reduction = "mean" if variant.get("mean", True) else "sum"
    grad_loss = None
    if variant.get("grad_loss") == "scalar":
        grad_loss = (torch.rand((), generator=gen) + 0.5).to(device)
    elif variant.get("grad_loss") == "rows":  # every other element: a stride the plan must key on
        reduction, grad_loss = "none", (torch.rand(80, generator=gen) + 0.5).to(device)[::2]
    fused = ce_kernels.launch_cross_entropy_mxfp8_grad(
        logits, target, grad_loss, *options, reduction, fp8, rowwise, columnwise, scale_layout, *features
    )
    reduced_loss = ce_kernels.launch_cross_entropy_reduced(
        logits, target, *options, variant.get("mean", True), *features
    )
    outputs = [loss_rows, stats, *reduced, grad, *payload, *fused, *reduced_loss]
    return [t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]) for t in outputs]


def plans_follow_layouts_and_options(device: str) -> None:
    """The launchers keep one plan per specialization: calls of one shape with other strides, dtypes and
    options, one after another (each finding the earlier calls' plans), give the bytes of the same
    call made with no plan stored."""
    assert_plans_follow(launcher_outputs, PLAN_VARIANTS, device)


@pytest.mark.interp
def test_interp_launcher_plans_follow_layouts_and_options():
    plans_follow_layouts_and_options("cpu")


@pytest.mark.gpu
def test_gpu_launcher_plans_follow_layouts_and_options():
    plans_follow_layouts_and_options("cuda")


# ------------------------------------------------------------------- public API through the kernels
# (spy_launchers: tests/conftest.py)


def require_cpu_kernels():
    assert lowp_ops.library.cpu_runs_triton(), "the interp suite needs LOWP_OPS_CPU_KERNELS=triton"


@pytest.mark.interp
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_interp_public_cross_entropy_runs_the_kernels_end_to_end(reduction, spy_launchers):
    require_cpu_kernels()
    logits2d, target1d = ce_inputs(39, 301, torch.bfloat16, "cpu", special_rows=False)
    logits2d[2, :200] = NEG_INF
    logits, target = logits2d.view(3, 13, 301), target1d.view(3, 13)
    gen = torch.Generator().manual_seed(2)
    grad_loss = torch.rand((3, 13) if reduction == "none" else (), generator=gen) + 0.5
    leaf = logits.clone().requires_grad_()
    loss = lowp_ops.cross_entropy(leaf, target, label_smoothing=0.1, reduction=reduction, classes_last=True)
    (grad,) = torch.autograd.grad(loss, leaf, grad_outputs=grad_loss)
    forward = "launch_cross_entropy_fwd" if reduction == "none" else "launch_cross_entropy_reduced"
    assert {forward, "launch_cross_entropy_bwd"} <= set(spy_launchers)
    assert torch.equal(leaf.detach(), logits)

    want_loss, want_grad, row_weight = cross_entropy_oracle(
        logits, target, grad_loss, label_smoothing=0.1, ignore_index=IGNORE, reduction=reduction
    )
    assert_close_fp32(loss.detach(), want_loss, rtol=1e-5, atol=ce_loss_fp32_atol(logits), what="loss")
    assert_within_ulps(grad, want_grad, slack=ce_grad_fp32_slack(logits, row_weight), what="grad")

    fused_loss, payload = lowp_ops.cross_entropy_with_mxfp8_grad(
        logits, target, grad_loss, label_smoothing=0.1, reduction=reduction, scale_layout="swizzled"
    )
    assert "launch_cross_entropy_mxfp8_grad" in spy_launchers
    assert torch.equal(bits(fused_loss), bits(loss.detach()))
    quantized = lowp_ops.mxfp8_quantize(grad, scale_layout="swizzled")
    for field in ("row_data", "row_scale", "col_data", "col_scale"):
        assert torch.equal(
            getattr(payload, field).view(torch.uint8), getattr(quantized, field).view(torch.uint8)
        ), field


@pytest.mark.interp
def test_interp_opcheck_through_the_kernels():
    require_cpu_kernels()
    logits, target = ce_inputs(37, 75, torch.bfloat16, "cpu")
    logits[4] = 0.5  # opcheck compares with assert_close: no NaN row here
    permuted = logits.t().contiguous().t()
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_fwd.default, (permuted.requires_grad_(), target, 0.1, IGNORE)
    )
    _, lse = torch.ops.lowp.cross_entropy_fwd(logits, target, 0.1, IGNORE)
    grad_rows = grad_rows_for(37, "cpu", "expanded")
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_bwd.default, (logits, target, lse, grad_rows, 0.1, IGNORE)
    )
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_bwd_mxfp8.default,
        (permuted.detach(), target, lse, grad_rows, 0.1, IGNORE, "e4m3", True, True, "swizzled"),
    )
    x = masked_softmax_inputs(37, 75, torch.float32, "cpu", softmax_kernels.MAX_BLOCK)
    torch.library.opcheck(torch.ops.lowp.softmax_fwd.default, (x.requires_grad_(), True, "zero"))
    torch.library.opcheck(torch.ops.lowp.logsumexp.default, (x.t().contiguous().t().nan_to_num(neginf=-5.0),))


# ----------------------------------------------------------------------------- the loss reduction kernel


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.interp), pytest.param("cuda", marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize(
    "n_rows", [0, 1, 4097, 3 * ce_kernels.REDUCE_BLOCK + 5, ce_kernels.REDUCE_MAX_ROWS + 1]
)
def test_cross_entropy_reduce_kernel_matches_reference(device, mean, n_rows):
    if device == "cpu" and n_rows > ce_kernels.REDUCE_BLOCK + 1:
        pytest.skip("the interpreter runs the loop; two blocks are enough there")
    gen = torch.Generator().manual_seed(n_rows)
    loss_rows = torch.rand(n_rows, generator=gen) * 10
    target = torch.randint(0, 100, (n_rows,), generator=gen)
    target[::3] = IGNORE
    loss_rows[target == IGNORE] = 0.0  # as the forward writes them
    loss_rows, target = loss_rows.to(device), target.to(device)
    loss, grad_scale = ce_kernels.launch_cross_entropy_reduce(loss_rows, target, IGNORE, mean)
    want_loss, want_scale = ce_ref.cross_entropy_reduce(loss_rows, target, IGNORE, mean)
    # Same count, IEEE divisions: the scale is exact; the sums differ in order only.
    assert torch.equal(bits(grad_scale), bits(want_scale))
    # Every row ignored (n_rows 0 or 1 here): 0 / 0, NaN in both.
    torch.testing.assert_close(loss, want_loss, rtol=2e-6, atol=0.0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n_cols", "dtype"), [(4096, torch.bfloat16), (1000, torch.float16), (333, torch.float32)]
)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_gpu_select_free_tiles_equal_the_full_formula(n_cols, dtype, label_smoothing):
    check_select_free_tiles(n_cols, dtype, "cuda", label_smoothing)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n_rows", "n_cols", "dtype"),
    [(1000, 50257, torch.bfloat16), (77, 32001, torch.float16), (5, 4100, torch.float32)],
)
def test_gpu_row_segment_backward_equals_the_tile_kernel(n_rows, n_cols, dtype):
    check_row_segments_equal_tiles(n_rows, n_cols, dtype, "cuda")


@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize(("n_cols", "scale_layout"), [(300, "compact"), (301, "swizzled"), (256, "compact")])
def test_mxfp8_launcher_arguments_bind_to_the_kernel_parameters(gluon, n_cols, scale_layout, monkeypatch):
    """The launcher's positional and keyword arguments bind one to one to the kernel it picks (Gluon or
    Triton), checked on this machine without running either: a kernel that gains or loses a parameter
    the launcher does not follow fails here, not only on a GPU."""
    import inspect

    from lowp_ops.kernels import cross_entropy_gluon

    if gluon and cross_entropy_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    module, name = (
        (cross_entropy_gluon, "cross_entropy_bwd_mxfp8_gluon_kernel")
        if gluon
        else (ce_kernels, "cross_entropy_bwd_mxfp8_kernel")
    )
    kernel = getattr(module, name)
    params = [p.name for p in kernel.jit_function.params]
    bound = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, num_warps, **meta):
                signature = inspect.Signature(
                    [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params]
                )
                bound.append(signature.bind(*args, **meta).arguments)

            return launch

        def bind(self, grid, *, exact_ints=True, **meta):  # the launchers' plans bind the kernel once
            return lambda *args: self[grid](*args, **meta)

    monkeypatch.setattr(module, name, Spy())
    logits, target = ce_inputs(40, n_cols, torch.bfloat16, "cpu")
    lse = ce_ref.cross_entropy_fwd(logits, target, 0.0, IGNORE)[1]
    args = (
        logits,
        target,
        lse,
        grad_rows_for(40, "cpu", "dense"),
        0.0,
        IGNORE,
        "e4m3",
        True,
        True,
        scale_layout,
    )
    ce_kernels.launch_cross_entropy_bwd_mxfp8(*args, gluon=gluon)
    assert len(bound) == 1 and list(bound[0]) == params
    assert bound[0]["n_cols"] == n_cols and bound[0]["rows"] == 40
    assert bound[0]["row_scale_cols"] == math.ceil(math.ceil(n_cols / 32) / 4) * 4


@pytest.mark.interp
def test_interp_gluon_backward_refuses_rows_past_its_int32_offsets():
    """The Gluon MXFP8 backward's in-tile offsets are int32: asked for it explicitly (``gluon=True``), rows
    of 2^26 elements (32 rows past 2^31) raise instead of reading wrapped addresses."""
    storage = torch.zeros(2**26 + 128, dtype=torch.bfloat16)  # 128 MiB: two rows 2^26 elements apart
    logits = storage.as_strided((2, 128), (2**26, 1))
    target, stats, grad_rows = torch.zeros(2, dtype=torch.int64), torch.zeros(2, 2), torch.ones(2)
    args = (logits, target, stats, grad_rows, 0.0, IGNORE, "e4m3", True, True, "compact")
    with pytest.raises(ValueError, match="gluon=False"):
        ce_kernels.launch_cross_entropy_bwd_mxfp8(*args, gluon=True)
