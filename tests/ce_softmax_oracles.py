"""Float64 oracles for the cross entropy and the softmax family, and ulp-based comparisons.

Written from the math (docs/cross_entropy.md#loss-and-gradient), independently of ``lowp_ops``: nothing
here imports the package, so a test that compares against these oracles can fail.
"""

from __future__ import annotations

import math

import torch

# Explicit mantissa bits and the exponent of the smallest subnormal of each dtype.
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
MIN_SUBNORMAL_EXP = {torch.float32: -149, torch.bfloat16: -133, torch.float16: -24}
FP32_UNIT = 2.0**-24
"""Unit roundoff of fp32: the error scale of the fp32 math inside the ops."""


# ------------------------------------------------------------------------------------ log-sum-exp


def logsumexp64(x: torch.Tensor) -> torch.Tensor:
    """float64 log Σ exp over the last dim; an all -inf row gives -inf (never NaN from -inf - -inf)."""
    x = x.double()
    row_max = x.amax(dim=-1, keepdim=True)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    return (shift + torch.exp(x - shift).sum(dim=-1, keepdim=True).log()).squeeze(-1)


def row_stats64(x: torch.Tensor) -> torch.Tensor:
    """float64 ``(2, N)`` row statistics of ``(N, V)`` logits as the cross-entropy ops define them: the row
    maximum (0 when it is infinite) and ``log Σ exp(x - shift)`` (NaN for a row holding +inf)."""
    x = x.double()
    row_max = x.amax(dim=-1)
    shift = torch.where(row_max.abs() == float("inf"), 0.0, row_max)
    log_sum = torch.exp(x - shift.unsqueeze(-1)).sum(dim=-1).log()
    return torch.stack([shift, torch.where(log_sum == float("inf"), float("nan"), log_sum)])


def row_stats32(x: torch.Tensor) -> torch.Tensor:
    """:func:`row_stats64` rounded to fp32: valid row statistics to feed a cross-entropy backward."""
    return row_stats64(x).float()


def lse_of(stats: torch.Tensor) -> torch.Tensor:
    """float64 log-sum-exp from ``(2, N)`` row statistics (shift + log_sum)."""
    return stats[0].double() + stats[1].double()


def assert_row_stats_close(stats: torch.Tensor, x: torch.Tensor, what: str = "row_stats") -> None:
    """``stats`` (2, N) fp32 are the row statistics of ``x``: the shift exactly the fp32 row maximum, the
    log-sum within a few fp32 roundoffs of float64 (no term grows with the logits' magnitude)."""
    want = row_stats64(x)
    assert stats.shape == want.shape and stats.dtype == torch.float32, f"{what}: {stats.dtype} {stats.shape}"
    got = stats.cpu().double()
    assert torch.equal(got[0], want[0]), f"{what}: shift is not the row maximum"
    finite = torch.isfinite(want[1])
    assert torch.equal(torch.isnan(got[1]), torch.isnan(want[1])), f"{what}: NaN log_sum positions differ"
    assert torch.equal(got[1][~finite & ~torch.isnan(want[1])], want[1][~finite & ~torch.isnan(want[1])])
    error = (got[1] - want[1])[finite].abs()
    allowed = 8 * FP32_UNIT * (1 + want[1][finite].abs())
    assert bool((error <= allowed).all()), f"{what}: log_sum off by {float((error - allowed).max())} beyond"


def softmax64(x: torch.Tensor) -> torch.Tensor:
    """float64 softmax over the last dim (NaN for an all -inf row, like PyTorch)."""
    x = x.double()
    return torch.exp(x - logsumexp64(x).unsqueeze(-1))


# ---------------------------------------------------------------------------------- cross entropy


def cross_entropy_oracle(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor | float,
    *,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss, dlogits, per-row weight), all float64; ``logits`` (..., V), ``target`` logits.shape[:-1].

    Per non-ignored row, with lse the masked-safe log-sum-exp and ls the label smoothing:
    ``loss = (1 - ls)(lse - x_y) + ls (lse - mean(x))`` and ``dloss/dx = softmax(x) - ls/V - (1 - ls)
    onehot(y)``, times the upstream gradient of that row (``grad_loss / #non-ignored`` for mean).
    Ignored rows: loss 0, gradient 0. Mean over zero rows: NaN loss (0/0), zero gradient.
    """
    n_cols = logits.shape[-1]
    x = logits.detach().double().reshape(-1, n_cols)
    y = target.reshape(-1).long()
    valid = y != ignore_index
    lse = logsumexp64(x)
    target_logit = x.gather(1, y.clamp(0, n_cols - 1).unsqueeze(1)).squeeze(1)
    row_loss = (1.0 - label_smoothing) * (lse - target_logit)
    if label_smoothing > 0:
        row_loss = row_loss + label_smoothing * (lse - x.mean(dim=1))
    row_loss = torch.where(valid, row_loss, 0.0)

    grad_loss = torch.as_tensor(grad_loss, dtype=torch.float64)
    n_valid = valid.sum().double()
    if reduction == "none":
        loss = row_loss.view(target.shape)
        row_weight = grad_loss.reshape(-1).double()
    elif reduction == "sum":
        loss = row_loss.sum()
        row_weight = grad_loss.expand(y.shape)
    else:
        loss = row_loss.sum() / n_valid
        row_weight = (grad_loss / n_valid).expand(y.shape)

    onehot = torch.nn.functional.one_hot(y.clamp(0, n_cols - 1), n_cols).double()
    grad = softmax64(x) - label_smoothing / n_cols - (1.0 - label_smoothing) * onehot
    grad = torch.where(valid.unsqueeze(1), grad * row_weight.unsqueeze(1), 0.0)
    return loss, grad.view(logits.shape), torch.where(valid, row_weight, 0.0)


def ce_grad_fp32_slack(logits: torch.Tensor, row_weight: torch.Tensor) -> torch.Tensor:
    """Absolute error bound (float64, logits' shape) of a gradient computed in fp32 math.

    ``exp(x - lse)`` in fp32 has an absolute error of a few units of roundoff times ``p (1 + |x| + |lse|)``;
    the subtractions of ``ls/V`` and ``1 - ls`` add a few units of roundoff of 1. All times |row weight|.
    """
    n_cols = logits.shape[-1]
    x = logits.detach().double().reshape(-1, n_cols)
    lse = logsumexp64(x)
    p = softmax64(x)
    magnitude = (
        torch.where(torch.isfinite(x), x.abs(), 0.0)
        + torch.where(torch.isfinite(lse), lse.abs(), 0.0)[:, None]
    )
    slack = 8 * FP32_UNIT * (torch.where(p > 0, p, 0.0) * (2 + magnitude) + 1)
    return (slack * row_weight.abs().unsqueeze(1)).view(logits.shape)


def ce_loss_fp32_atol(logits: torch.Tensor) -> float:
    """Absolute error bound of one row's loss computed in fp32 math: a few units of roundoff of the
    magnitudes involved (lse, x_y and the mean of the row; the row sum has ~log2(V) rounding levels)."""
    n_cols = logits.shape[-1]
    x = logits.detach().double()
    finite = torch.where(torch.isfinite(x), x.abs(), 0.0)
    largest = float(finite.amax()) if finite.numel() else 0.0
    return 16 * FP32_UNIT * (4 + 3 * largest + math.log(n_cols) + 1) * (2 + math.log2(n_cols))


# ------------------------------------------------------------------------------------ comparisons


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each magnitude in ``values`` (float64 in, float64 out)."""
    magnitude = values.double().abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^exponent, m in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(magnitude), exponent - 1 - MANTISSA_BITS[dtype])
    smallest = 2.0 ** MIN_SUBNORMAL_EXP[dtype]
    return torch.where(magnitude == 0, smallest, spacing.clamp(min=smallest))


def assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor, what: str) -> torch.Tensor:
    """NaN where ``want`` is NaN, the same infinities; returns the mask of positions finite in both."""
    got = got.double()
    want = want.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN positions differ"
    assert torch.equal(torch.isposinf(got), torch.isposinf(want)), f"{what}: +inf positions differ"
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf positions differ"
    return torch.isfinite(want)


def assert_within_ulps(
    got: torch.Tensor,
    want64: torch.Tensor,
    *,
    ulps: float = 1.0,
    slack: torch.Tensor | float = 0.0,
    what: str = "value",
) -> None:
    """``|got - dtype(want64)| <= ulps * ulp + slack`` elementwise, where ``dtype`` is got's dtype.

    ``slack`` (absolute, float64) covers the fp32 roundoff of the computation before its final rounding
    (cancellation can make that larger than one ulp of a tiny result).
    """
    dtype = got.dtype
    assert got.shape == want64.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want64.shape)}"
    finite = assert_same_nonfinite(got, want64.to(dtype), what)
    rounded = want64.to(dtype).double()
    got64 = got.double()
    spacing = torch.maximum(ulp(rounded, dtype), ulp(got64, dtype))
    allowed = ulps * spacing + torch.as_tensor(slack, dtype=torch.float64)
    error = torch.where(finite, (got64 - rounded).abs(), 0.0)
    excess = torch.where(finite, error - allowed, float("-inf"))
    if excess.numel() and float(excess.max()) > 0:
        worst = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements off by more than {ulps} ulp; "
            f"worst at flat index {worst}: got {got64.flatten()[worst].item()!r}, "
            f"want {want64.double().flatten()[worst].item()!r} (rounded {rounded.flatten()[worst].item()!r})"
        )


def assert_close_fp32(
    got: torch.Tensor, want64: torch.Tensor, *, rtol: float, atol: float | torch.Tensor, what: str = "value"
) -> None:
    """fp32-level closeness with NaN and infinities required at the same places."""
    assert got.shape == want64.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want64.shape)}"
    finite = assert_same_nonfinite(got, want64, what)
    error = torch.where(finite, (got.double() - want64.double()).abs(), 0.0)
    allowed = rtol * want64.double().abs().nan_to_num(0.0, 0.0, 0.0) + torch.as_tensor(
        atol, dtype=torch.float64
    )
    excess = torch.where(finite, error - allowed, float("-inf"))
    if excess.numel() and float(excess.max()) > 0:
        worst = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} elements beyond rtol={rtol}; worst at flat index {worst}: "
            f"got {got.double().flatten()[worst].item()!r}, want {want64.double().flatten()[worst].item()!r}"
        )


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a tensor (for exact comparisons that also treat NaN == NaN)."""
    view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(view_dtype)


def masked_softmax_inputs(
    n_rows: int, n_cols: int, dtype: torch.dtype, device: str, block: int, seed: int = 0
) -> torch.Tensor:
    """(n_rows, n_cols) inputs of ``dtype``: N(0, 9) with 10% -inf; with 3 rows or more, row 0's first
    ``block`` columns masked, row 1 all -inf and row 2 all but its last ``block`` + 1 columns masked
    (``block``: the kernel's widest row block)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n_rows, n_cols, generator=gen, device=device) * 3
    x[torch.rand(n_rows, n_cols, generator=gen, device=device) < 0.1] = -math.inf
    if n_rows >= 3:
        x[0, : min(block, n_cols - 1)] = -math.inf  # a whole first block masked
        x[1] = -math.inf
        x[2, : max(n_cols - block - 1, 0)] = -math.inf  # all but the last block masked
    return x.to(dtype)


# ------------------------------------------------------------------ z-loss and final-logit soft-capping


def softcap64(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """float64 ``c · tanh(x / c)`` (Gemma's final-logit soft-capping); ``-inf`` stays ``-inf``."""
    if softcap is None:
        return x
    return torch.where(x == float("-inf"), float("-inf"), softcap * torch.tanh(x / softcap))


def features_oracle(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_loss,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(loss, dlogits, z_loss value, lse)`` of ``(N, V)`` logits by float64 autograd, from the
    definitions: logits capped, then ``-(1 - ls) w_y log p_y - (ls / V) Σ_c w_c log p_c + z lse²`` per
    non-ignored row (0 for ignored ones), reduced as ``F.cross_entropy`` (mean over ``Σ w_y``); the
    z-loss value is ``z lse²`` reduced the same way; ``lse`` is per row, of the capped logits."""
    x = logits.detach().double().requires_grad_()
    capped = softcap64(x, softcap)
    lse = torch.logsumexp(capped, dim=1)
    log_p = capped - lse.unsqueeze(1)
    n_vocab = x.shape[1]
    w = torch.ones(n_vocab, dtype=torch.float64) if weight is None else weight.double()
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0).long()
    w_y = w[safe_target]
    nll = -log_p.gather(1, safe_target.unsqueeze(1)).squeeze(1) * w_y
    rows = (1 - label_smoothing) * nll + z_loss * lse * lse
    if label_smoothing > 0:
        rows = rows - label_smoothing / n_vocab * (log_p * w).sum(dim=1)
    rows = torch.where(valid, rows, 0.0)
    z_rows = torch.where(valid, z_loss * lse.detach() ** 2, 0.0)
    denominator = torch.where(valid, w_y, 0.0).sum()
    if reduction == "mean":
        loss, z_value = rows.sum() / denominator, z_rows.sum() / denominator
    elif reduction == "sum":
        loss, z_value = rows.sum(), z_rows.sum()
    else:
        loss, z_value = rows, z_rows
    upstream = torch.as_tensor(grad_loss, dtype=torch.float64).expand(loss.shape)
    (grad,) = torch.autograd.grad(loss, x, grad_outputs=upstream)
    return loss.detach(), grad, z_value, lse.detach()
