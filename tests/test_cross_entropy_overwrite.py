"""``cross_entropy(..., overwrite_logits=True)``: the forward writes the gradient over the logits, the
backward returns it scaled in place (``lowp::cross_entropy_fwd_bwd_``, ``lowp::cross_entropy_scale_grad_``).

The oracle is the default path (logits untouched, the gradient from the backward kernel): the same
bytes when ``grad_loss`` is 1 or a power of two, one more rounding otherwise. CPU (references), the
interpreter (kernels on CPU tensors), the GPU, and a CUDA-graph replay with ``grad_loss`` 1 and not 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import lowp_ops
from lowp_ops import library

NEG_INF = float("-inf")
IGNORE = -100


def inputs(rows: int, cols: int, device: str = "cpu", dtype=torch.bfloat16, seed: int = 0):
    """Logits with a masked leading block, an ignored all -inf row and sparse -inf; every 5th row ignored."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, cols, generator=gen) * 3
    logits[torch.rand(rows, cols, generator=gen) < 0.05] = NEG_INF
    logits[0, : cols // 3] = NEG_INF
    target = torch.randint(0, cols, (rows,), generator=gen)
    target[::5] = IGNORE
    if rows > 1:
        logits[1] = NEG_INF
        target[1] = IGNORE
    return logits.to(dtype).to(device), target.to(device)


def both_paths(logits, target, grad_loss=None, **kwargs):
    """(loss, gradient) of the default path and of overwrite_logits=True, the logits a non-leaf."""
    results = []
    for overwrite in (False, True):
        leaf = logits.clone().requires_grad_()
        loss = lowp_ops.cross_entropy(leaf * 1, target, overwrite_logits=overwrite, **kwargs)
        main = loss[0] if isinstance(loss, tuple) else loss
        seed = torch.ones_like(main) if grad_loss is None else torch.full_like(main, grad_loss)
        (grad,) = torch.autograd.grad(main, leaf, seed)
        results.append((main.detach(), grad))
    return results


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


OPTIONS = [
    {"reduction": "mean"},
    {"reduction": "sum", "label_smoothing": 0.1},
    {"reduction": "none", "z_loss": 1e-3},
    {"reduction": "mean", "softcap": 5.0, "label_smoothing": 0.2},
    {"reduction": "mean", "weight": "classes"},
]


def _options(options: dict, cols: int, device: str) -> dict:
    options = dict(options)
    if options.get("weight") == "classes":
        options["weight"] = torch.rand(cols, generator=torch.Generator().manual_seed(5)).to(device) + 0.5
    return options


def _check_paths(device: str, rows: int, cols: int, options: dict, dtype=torch.bfloat16) -> None:
    logits, target = inputs(rows, cols, device, dtype)
    options = _options(options, cols, device)
    for grad_loss in (None, 4.0, 0.5):  # 1 and powers of two: the same bytes
        (loss, grad), (loss_ow, grad_ow) = both_paths(logits, target, grad_loss, **options)
        assert torch.equal(bits(loss), bits(loss_ow))
        assert torch.equal(bits(grad), bits(grad_ow)), (options, grad_loss)
    (_, grad), (_, grad_ow) = both_paths(logits, target, 0.3, **options)
    # Another factor rounds twice (and forms the row factor in another order): within two ulps.
    finite = grad.isfinite()
    assert torch.equal(finite, grad_ow.isfinite())
    ulp = 2 * torch.finfo(dtype).eps * grad[finite].float().abs()
    assert ((grad_ow[finite].float() - grad[finite].float()).abs() <= ulp + 1e-30).all()


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_overwrite_gives_the_default_paths_loss_and_gradient(options, dtype):
    _check_paths("cpu", 37, 70, options, dtype)


@given(
    rows=st.integers(1, 40),
    cols=st.integers(2, 90),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    smoothing=st.sampled_from([0.0, 0.1]),
    exponent=st.integers(-3, 3),
    seed=st.integers(0, 2**16),
)
def test_overwrite_equals_the_default_path_for_any_shape(rows, cols, reduction, smoothing, exponent, seed):
    """Property: for grad_loss = 2^k the loss and gradient bytes of both paths agree."""
    logits, target = inputs(rows, cols, seed=seed)
    (loss, grad), (loss_ow, grad_ow) = both_paths(
        logits, target, 2.0**exponent, reduction=reduction, label_smoothing=smoothing
    )
    assert torch.equal(bits(loss), bits(loss_ow))
    assert torch.equal(bits(grad), bits(grad_ow))


@pytest.mark.interp
@pytest.mark.parametrize("options", OPTIONS)
def test_interp_overwrite_gives_the_default_paths_loss_and_gradient(options):
    _check_paths("cpu", 37, 300, options)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 32000), (333, 50257), (4096, 129280)])
@pytest.mark.parametrize("options", OPTIONS)
def test_gpu_overwrite_gives_the_default_paths_loss_and_gradient(shape, options):
    _check_paths("cuda", *shape, options)


@pytest.mark.gpu
def test_gpu_overwrite_saves_the_gradient_buffer():
    """Peak memory of forward + backward drops by the N x V gradient (bf16) against the default path. The
    logits are a view of the leaf, whose backward allocates nothing (``leaf * 1``'s would allocate the
    N x V product of the gradient on either path)."""
    logits, target = inputs(4096, 32000, "cuda")
    peaks = []
    for overwrite in (False, True):
        leaf = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = lowp_ops.cross_entropy(leaf.view_as(leaf), target, overwrite_logits=overwrite)
        (grad,) = torch.autograd.grad(loss, leaf)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del loss, grad, leaf
    gradient_bytes = logits.numel() * logits.element_size()
    assert peaks[0] - peaks[1] >= 0.9 * gradient_bytes, peaks


def test_the_logits_hold_the_gradient_and_autograd_refuses_their_saved_use():
    logits, target = inputs(9, 40, dtype=torch.float32)
    leaf = logits.clone().requires_grad_()
    capped = torch.tanh(leaf)  # saves its output for its backward
    lowp_ops.cross_entropy(capped, target, overwrite_logits=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lowp_ops.cross_entropy(capped, target, overwrite_logits=True).backward()

    hidden = logits.clone().requires_grad_()
    head = hidden * 2
    lowp_ops.cross_entropy(head, target, overwrite_logits=True)
    doubled = (logits * 2).requires_grad_()
    (want,) = torch.autograd.grad(lowp_ops.cross_entropy(doubled, target), doubled)
    assert torch.equal(bits(head.detach()), bits(want))


def test_overwrite_takes_classes_in_dim_1_with_no_other_dims_past_them():
    """(N, C, 1) logits are their own rows: the gradient lands in them, as for (N, C)."""
    logits, target = inputs(8, 40, dtype=torch.float32)
    leaf = logits.view(8, 40, 1).requires_grad_()
    head = leaf * 2
    lowp_ops.cross_entropy(head, target.view(8, 1), overwrite_logits=True)
    doubled = (logits * 2).requires_grad_()
    (want,) = torch.autograd.grad(lowp_ops.cross_entropy(doubled, target), doubled)
    assert torch.equal(bits(head.detach().view(8, 40)), bits(want))


def test_without_a_gradient_the_logits_stay_untouched():
    logits, target = inputs(9, 40)
    before = logits.clone()
    with torch.no_grad():
        loss = lowp_ops.cross_entropy(logits, target, overwrite_logits=True)
    assert torch.equal(bits(logits), bits(before))
    assert torch.equal(loss, lowp_ops.cross_entropy(logits, target))


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("leaf", ValueError, "not a leaf"),
        ("non-contiguous", ValueError, "contiguous"),
        ("classes in dim 1", ValueError, "contiguous logits with classes in the last dim"),
        ("classes in dim 1, contiguous", ValueError, "contiguous logits with classes in the last dim"),
        ("process group", ValueError, "process_group"),
        ("not a bool", TypeError, "overwrite_logits must be a bool"),
        ("fp16", ValueError, "bf16 or fp32 logits"),
    ],
)
def test_bad_overwrite_arguments_raise(case, error, match):
    logits, target = inputs(8, 40, dtype=torch.float32)
    leaf = logits.requires_grad_()
    kwargs = {"overwrite_logits": True}
    x = leaf * 1
    if case == "leaf":
        x = leaf
    elif case == "non-contiguous":
        x = torch.cat([leaf, leaf], 1)[:, :40]  # rows 80 apart
    elif case == "classes in dim 1":
        x, target = (leaf * 1).view(2, 4, 40).transpose(1, 2), target.view(2, 4)
    elif case == "classes in dim 1, contiguous":  # (N, C, d) rows are a copy of the input
        x, target = (leaf * 1).view(2, 40, 4), target.view(2, 4)
    elif case == "process group":
        kwargs["process_group"] = object()
    elif case == "fp16":
        x = leaf.half() * 1
    else:
        kwargs["overwrite_logits"] = 1
    with pytest.raises(error, match=match):
        lowp_ops.cross_entropy(x, target, **kwargs)


def test_fp16_logits_are_refused_where_a_loss_scale_would_be_lost():
    """fp16 logits raise. Why: the gradient written for grad_loss = 1 rounds ``p / N`` to fp16 before a
    loss scale (``torch.amp.GradScaler``'s 2^16) multiplies it, where the default path scales first: the
    unscaled loss's fp16 gradient scaled afterwards is over 10x further from float64 than the scaled
    loss's (measured here on the default path's own gradients)."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, 2048, (4096,), generator=gen)
    half = torch.randn(4096, 2048, generator=gen).half().requires_grad_()
    (lowp_ops.cross_entropy(half, target) * 2.0**16).backward()
    scaled_first = half.grad.double()
    exact = half.detach().double().requires_grad_()
    (F.cross_entropy(exact, target) * 2.0**16).backward()
    half.grad = None
    lowp_ops.cross_entropy(half, target).backward()
    scaled_after = half.grad.double() * 2.0**16

    def error(got):
        return float((got - exact.grad).norm() / exact.grad.norm())

    assert error(scaled_after) > 10 * error(scaled_first)
    with pytest.raises(ValueError, match="bf16 or fp32 logits"):
        lowp_ops.cross_entropy(half * 1, target, overwrite_logits=True)


def test_scale_grad_rows_reference_leaves_rows_of_factor_one_alone():
    logits, _ = inputs(6, 40)
    factors = torch.tensor([1.0, 2.0, 0.3, 1.0, float("nan"), -1.0])
    scaled = logits.clone()
    library.cross_entropy_scale_grad_(scaled, factors)
    assert torch.equal(bits(scaled[[0, 3]]), bits(logits[[0, 3]]))
    want = (logits.float() * factors[:, None]).to(logits.dtype)
    assert torch.equal(bits(scaled), bits(want))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overwrite_compiles_without_graph_breaks(device, padded):
    """Compiled, the in-place ops go through the dispatcher (CUDA: the kernels registered there). With
    ``force_shape_pad`` Inductor pads the head's matmul on CUDA, so the ops get a row-strided view of the
    logits (its choice is otherwise a benchmark's: the test failed on some runs before the ops took
    strided views)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_shape_pad=padded):
        compiled_overwrite_matches_eager(device)


def compiled_overwrite_matches_eager(device: str) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50).to(device)
    hidden = torch.randn(12, 16).to(device)
    target = torch.randint(0, 50, (12,)).to(device)

    def step(h, t, overwrite):
        return lowp_ops.cross_entropy(head(h), t, overwrite_logits=overwrite)

    want = step(hidden, target, False)
    want.backward()
    want_grad, head.weight.grad = head.weight.grad.clone(), None
    assert torch._dynamo.explain(step)(hidden, target, True).graph_break_count == 0
    got = torch.compile(step, fullgraph=True)(hidden, target, True)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(head.weight.grad, want_grad)


@pytest.mark.cudagraph
@pytest.mark.parametrize("cols", [32000, 8000, 32004])  # wide one pass; one pass; two passes
def test_cudagraph_overwrite_replays_with_grad_loss_one_and_not_one(cols):
    """Capture forward + backward of ``scale * loss`` with the scale a static tensor; replays with scale 1
    and 0.75 equal eager calls (the scaling runs or not by the device's decision)."""
    from cudagraph_checks import capture, same_bits

    logits, target = inputs(512, cols, "cuda")
    static_logits = logits.clone()
    scale = torch.ones((), device="cuda")
    hidden = torch.zeros((), device="cuda", requires_grad=True)

    def step():
        x = static_logits + hidden  # a non-leaf whose gradient is the logits'
        loss = lowp_ops.cross_entropy(x, target, overwrite_logits=True)
        (grad,) = torch.autograd.grad(loss * scale, x)
        return loss.detach(), grad

    graph, (static_loss, static_grad) = capture(step)
    for factor in (1.0, 0.75):
        scale.fill_(factor)
        graph.replay()
        leaf = logits.clone().requires_grad_()
        want_loss = lowp_ops.cross_entropy(leaf, target)
        (want_grad,) = torch.autograd.grad(want_loss * factor, leaf)
        assert same_bits(static_loss, want_loss.detach())
        if factor == 1.0:
            assert same_bits(static_grad, want_grad)
        else:
            torch.testing.assert_close(static_grad.float(), want_grad.float(), rtol=2**-7, atol=0)


# ------------------------------------------------------------------- one pass against the two passes

SINGLE_PASS_OPTIONS = [
    {"reduction": "mean"},
    {"reduction": "sum", "label_smoothing": 0.1},
    {"reduction": "none", "z_loss": 1e-3},
    {"reduction": "mean", "label_smoothing": 0.2, "z_loss": 1e-4},
    {"reduction": "mean", "weight": "classes"},
    {"reduction": "mean", "weight": "classes", "z_loss": 1e-3},
]


def _check_single_pass(
    device: str, rows: int, cols: int, options: dict, scale: float = 1.0, dtype=torch.bfloat16
) -> None:
    """``launch_cross_entropy_fwd_bwd_`` takes the one-pass kernel (counted) and gives the three-launch
    path's loss, row statistics and gradient bytes."""
    from lowp_ops.kernels import cross_entropy_single_pass as single
    from lowp_ops.kernels import cross_entropy_wide_pass as wide

    logits, target = inputs(rows, cols, device, dtype)
    logits = logits * scale
    options = _options(options, cols, device)
    args = (options.get("label_smoothing", 0.0), IGNORE, options["reduction"], options.get("weight"))
    features = (options.get("z_loss", 0.0), 0.0)
    assert single.single_pass_applies(logits, args[0], args[3], 0.0)
    two = logits.clone()
    want_loss, want_stats = single._two_passes(two, target, *args, *features)
    one = logits.clone()
    kernel = single.cross_entropy_fwd_bwd_kernel
    if cols > wide.MAX_BLOCKS * wide.BLOCK:
        kernel = wide.cross_entropy_fwd_bwd_parts_kernel
    elif cols > single.SINGLE_PASS_MAX_COLS:
        kernel = wide.cross_entropy_fwd_bwd_wide_kernel
    launches = []
    original = kernel.launch
    kernel.launch = lambda *a: (launches.append(a), original(*a))
    try:
        loss, stats = single.launch_cross_entropy_fwd_bwd_(one, target, *args, *features)
    finally:
        del kernel.launch
    assert len(launches) == 1
    assert torch.equal(bits(loss), bits(want_loss))
    assert torch.equal(bits(stats), bits(want_stats))
    assert torch.equal(bits(one), bits(two)), options


@pytest.mark.interp
@pytest.mark.parametrize("shape", [(37, 64), (9, 256), (13, 1008)])
@pytest.mark.parametrize("options", SINGLE_PASS_OPTIONS)
def test_interp_single_pass_equals_the_two_passes(shape, options):
    _check_single_pass("cpu", *shape, options)


@pytest.mark.interp
def test_interp_single_pass_equals_the_two_passes_at_large_magnitudes():
    _check_single_pass("cpu", 17, 128, {"reduction": "mean", "label_smoothing": 0.1}, scale=3e4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 8192), (700, 4096), (300, 5008), (2000, 1024), (64, 16)])
@pytest.mark.parametrize("options", SINGLE_PASS_OPTIONS)
def test_gpu_single_pass_equals_the_two_passes(shape, options):
    _check_single_pass("cuda", *shape, options)


@pytest.mark.gpu
@pytest.mark.parametrize("options", SINGLE_PASS_OPTIONS)
def test_gpu_single_pass_equals_the_two_passes_in_fp32(options):
    """fp32 gradients show every fp32 rounding (bf16's hides most): the z-loss's target term differed
    by one ulp between the one pass and the tile backward when the compiler contracted it in one only."""
    _check_single_pass("cuda", 2048, 1024, options, dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_single_pass_equals_the_two_passes_at_large_magnitudes():
    _check_single_pass("cuda", 256, 8000, {"reduction": "mean", "label_smoothing": 0.1}, scale=3e4)


# One program a row: rows of 2 blocks (the last holding 8 classes), 3, and 4 (the widest; at 16 mod 8
# and 0 mod 16). One program a 32768-class part: 2 parts (the last of 8 classes), 4 (the last of 30976:
# 129280 classes), 3 (the last a whole block and 8 classes) and 8 parts.
WIDE_SHAPES = [(33, 8200), (40, 24584), (96, 32768), (70, 32000)]
PARTS_SHAPES = [(33, 32776), (17, 129280), (40, 65544 + 8192), (9, 262144)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", WIDE_SHAPES + PARTS_SHAPES)
@pytest.mark.parametrize("options", SINGLE_PASS_OPTIONS)
def test_gpu_wide_single_pass_equals_the_two_passes(shape, options):
    _check_single_pass("cuda", *shape, options)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [32768, 98312])  # one program a row; three parts
def test_gpu_wide_single_pass_equals_the_two_passes_at_large_magnitudes(dtype, cols):
    scale = 3e4 if dtype == torch.bfloat16 else 5e3
    _check_single_pass("cuda", 48, cols, {"reduction": "mean", "label_smoothing": 0.1}, scale, dtype)


@pytest.mark.gpu
def test_gpu_single_pass_in_parts_keeps_masked_and_ignored_rows():
    """Rows whose first parts are all -inf (their maximum arrives in a later part), a row of -inf only
    and ignored rows: the two passes' bytes, no NaN where the two passes have none."""
    from lowp_ops.kernels import cross_entropy_single_pass as single

    rows, cols = 6, 3 * 32768 + 40
    logits, target = inputs(rows, cols, "cuda", torch.bfloat16)
    logits[0, : 2 * 32768] = float("-inf")
    logits[1, :] = float("-inf")
    logits[2, 32768:] = float("-inf")
    target[0] = 2 * 32768 + 5
    target[2] = 7
    target[3] = IGNORE
    two = logits.clone()
    want = single._two_passes(two, target, 0.0, IGNORE, "none", None, 0.0, 0.0)
    one = logits.clone()
    got = single.launch_cross_entropy_fwd_bwd_(one, target, 0.0, IGNORE, "none")
    assert torch.equal(bits(got[0]), bits(want[0])) and torch.equal(bits(got[1]), bits(want[1]))
    assert torch.equal(bits(one), bits(two))
    assert not one[[0, 2, 3]].isnan().any()


@pytest.mark.gpu
def test_gpu_wide_single_pass_declines_what_it_cannot_hold():
    """Rows wider than ``MAX_BLOCKS`` blocks, fp32 logits and rows that are not 16-byte aligned take the
    two passes."""
    from lowp_ops.kernels import cross_entropy_wide_pass as wide

    def applies(cols: int, dtype=torch.bfloat16) -> bool:
        return wide.wide_pass_applies(torch.empty(2, cols, dtype=dtype, device="cuda"), 0.0, None, 0.0)

    widest = wide.MAX_BLOCKS * wide.BLOCK
    assert applies(widest) and applies(wide.BLOCK + 8) and applies(widest, torch.float16)
    assert applies(widest + 8) and applies(129280)
    assert not applies(widest, torch.float32)
    assert not applies(wide.BLOCK + 4)


def test_single_pass_declines_what_it_cannot_repeat():
    """Soft-capping, class weights with smoothing, rows not 16-byte aligned and, off CUDA, rows wider
    than one block take the two passes (on CUDA the wide one pass takes those up to 32768 classes:
    ``test_gpu_wide_single_pass_declines_what_it_cannot_hold``)."""
    from lowp_ops.kernels.cross_entropy_single_pass import SINGLE_PASS_MAX_COLS, single_pass_applies

    aligned = torch.empty(4, 64, dtype=torch.bfloat16)
    weight = torch.ones(64)
    assert single_pass_applies(aligned, 0.1, None, 0.0)
    assert single_pass_applies(aligned, 0.0, weight, 0.0)
    assert not single_pass_applies(aligned, 0.0, None, 30.0)
    assert not single_pass_applies(aligned, 0.1, weight, 0.0)
    assert not single_pass_applies(torch.empty(4, 60, dtype=torch.bfloat16), 0.0, None, 0.0)
    assert not single_pass_applies(aligned[:, :32], 0.0, None, 0.0)
    widest = torch.empty(1, SINGLE_PASS_MAX_COLS, dtype=torch.bfloat16)
    assert single_pass_applies(widest, 0.0, None, 0.0)
    assert not single_pass_applies(
        torch.empty(1, SINGLE_PASS_MAX_COLS + 16, dtype=torch.bfloat16), 0.0, None, 0.0
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_opcheck_cross_entropy_fwd_bwd_(reduction, weighted):
    logits, target = inputs(12, 48, dtype=torch.float32)
    logits[logits == NEG_INF] = -30.0  # finite: opcheck compares with NaN != NaN
    logits[1] = 0.0
    weight = torch.rand(48, generator=torch.Generator().manual_seed(3)) + 0.5 if weighted else None
    torch.library.opcheck(
        torch.ops.lowp.cross_entropy_fwd_bwd_.default,
        (logits, target, 0.0 if weighted else 0.1, IGNORE, reduction, weight, 1e-3, 0.0),
    )


def test_cross_entropy_fwd_bwd_refuses_a_bad_reduction():
    logits, target = inputs(8, 40, dtype=torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        library.cross_entropy_fwd_bwd_(logits, target, 0.0, IGNORE, "avg")


def strided_views_take_the_gradient(device: str) -> None:
    """The in-place ops on row-strided views (what a compiled graph hands them where Inductor pads a
    matmul's rows) write the contiguous logits' bytes into the view and nothing past its columns."""
    logits, target = inputs(24, 40, device)
    for reduction in ("mean", "none"):
        padded = torch.cat([logits, torch.full_like(logits[:, :8], 7.0)], 1)
        view, dense = padded[:, :40], logits.clone()
        got = library.cross_entropy_fwd_bwd_(view, target, 0.1, IGNORE, reduction)
        want = library.cross_entropy_fwd_bwd_(dense, target, 0.1, IGNORE, reduction)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(bits(view), bits(dense))
        assert torch.equal(padded[:, 40:], torch.full_like(logits[:, :8], 7.0))
    factors = torch.tensor([1.0, 0.75, 2.0] * 8, device=device)
    library.cross_entropy_scale_grad_(view, factors)
    library.cross_entropy_scale_grad_(dense, factors)
    assert torch.equal(bits(view), bits(dense))
    assert torch.equal(padded[:, 40:], torch.full_like(logits[:, :8], 7.0))


def test_strided_views_take_the_gradient():
    strided_views_take_the_gradient("cpu")


@pytest.mark.interp
def test_interp_strided_views_take_the_gradient():
    strided_views_take_the_gradient("cpu")


@pytest.mark.gpu
def test_gpu_strided_views_take_the_gradient():
    strided_views_take_the_gradient("cuda")
