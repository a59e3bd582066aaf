"""Host time per call of every public lowp_ops function next to the PyTorch code it replaces.

At small shapes the GPU work is a few microseconds, so the host (Python, dispatch, launches) sets the
pace. Each case runs ``--calls`` calls back to back with one ``torch.cuda.synchronize()`` at the end; the
host time is the loop's time before that sync, divided by the calls (median of ``--repeats`` loops);
``wall`` includes the sync. Our loops and the baseline's alternate (ours, baseline, ours, ...), so that
a drift of the host's speed during a case moves both sides alike. Eager first, then ``torch.compile``
(default mode, no CUDA graphs) for the cross entropy, the softmax, the LM head and the grouped MLP.

    python benchmarks/bench_host_overhead.py            # table; JSON to $OUT/host_overhead.json
    python benchmarks/bench_host_overhead.py --profile  # also cProfile's top entries for a few calls
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import lowp_ops

try:
    from _common import environment, import_liger, import_te_cross_entropy_function, write_json
except ImportError:  # run from the repository root
    from benchmarks._common import environment, import_liger, import_te_cross_entropy_function, write_json


def alternating_host_and_wall_us(fns, calls: int, repeats: int) -> list[tuple[float, float]]:
    """For each of ``fns``, the median over ``repeats`` loops of ``calls`` calls: (host us per call before
    the final sync, wall us per call with it). The functions' loops alternate (one loop of each per
    repeat), so that a drift of the host's speed moves them alike."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns:
        for _ in range(3):
            fn()
    sync()
    host, wall = [[] for _ in fns], [[] for _ in fns]
    for _ in range(repeats):
        for index, fn in enumerate(fns):
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            issued = time.perf_counter()
            sync()
            done = time.perf_counter()
            host[index].append((issued - start) / calls * 1e6)
            wall[index].append((done - start) / calls * 1e6)
    return [(statistics.median(h), statistics.median(w)) for h, w in zip(host, wall, strict=True)]


def host_and_wall_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    """Median over ``repeats`` loops of ``calls`` calls of ``fn``: (host us per call before the final
    sync, wall us per call with it)."""
    return alternating_host_and_wall_us([fn], calls, repeats)[0]


def fwd_bwd(forward, *leaves):
    """A call that runs ``forward()`` and its backward, clearing the leaves' gradients first."""

    def step():
        for leaf in leaves:
            leaf.grad = None
        out = forward()
        out.backward(torch.ones_like(out))

    return step


def peer_loss_cases(
    logits: torch.Tensor, target: torch.Tensor, torch_ce
) -> list[tuple[str, object, str, object]]:
    """The peers' Python-and-Triton losses on the same logits (N, V) next to the same ``F.cross_entropy``
    step: TransformerEngine's ``CrossEntropyFunction`` (from ``--te-site`` / ``LOWP_BENCH_TE_SITE``) and
    Liger's ``LigerCrossEntropyFunction`` (a wheel on the path), each as one autograd node whose forward
    launches Triton kernels. Liger's forward reads a count back to the host (it waits for the GPU); TE's
    backward skips its launch when ``grad_output`` is 1 after comparing it on the host (``torch.equal``)."""
    if not logits.is_cuda:
        return []
    cases = []
    te = import_te_cross_entropy_function(os.environ.get("LOWP_BENCH_TE_SITE"))
    if te is not None:
        rows, vocab = logits.shape
        te_loss = lambda: te.apply(logits.view(1, rows, vocab), target, 0.0, True, None, -100, False)
        cases.append(
            (
                "peer: TE 2.20.2 CrossEntropyFunction fwd+bwd",
                fwd_bwd(te_loss, logits),
                "F.cross_entropy fwd+bwd",
                torch_ce,
            )
        )
    liger = import_liger("ops.cross_entropy", "LigerCrossEntropyFunction")
    if liger is not None:
        liger_loss = lambda: liger.apply(logits * 1, target, None, -100, 0.0, 0.0, "mean", None)[0]
        cases.append(
            (
                "peer: Liger CrossEntropyFunction fwd+bwd of logits * 1",
                fwd_bwd(liger_loss, logits),
                "F.cross_entropy fwd+bwd of logits * 1",
                fwd_bwd(lambda: F.cross_entropy(logits * 1, target), logits),
            )
        )
    return cases


def eager_cases(device: str) -> list[tuple[str, object, str, object]]:
    """(case, ours, baseline name, baseline) at small shapes."""
    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=bf16, grad=False):
        t = torch.randn(*shape, device=device, dtype=torch.float32, generator=gen).to(dtype)
        return t.requires_grad_(grad)

    cases = []
    # cross entropy, 512 x 32000 bf16
    logits = randn(512, 32000, grad=True)
    target = torch.randint(0, 32000, (512,), device=device, generator=gen)
    torch_ce = fwd_bwd(lambda: F.cross_entropy(logits, target), logits)
    cases.append(
        (
            "cross_entropy fwd+bwd 512x32000",
            fwd_bwd(lambda: lowp_ops.cross_entropy(logits, target), logits),
            "F.cross_entropy fwd+bwd",
            torch_ce,
        )
    )
    cases.append(
        (
            "cross_entropy fwd+bwd, overwrite_logits 512x32000",
            fwd_bwd(lambda: lowp_ops.cross_entropy(logits * 1, target, overwrite_logits=True), logits),
            "F.cross_entropy fwd+bwd of logits * 1",
            fwd_bwd(lambda: F.cross_entropy(logits * 1, target), logits),
        )
    )
    narrow = randn(512, 8192, grad=True)  # one pass (rows of at most 8192 classes)
    narrow_target = target % 8192
    cases.append(
        (
            "cross_entropy fwd+bwd, overwrite_logits 512x8192",
            fwd_bwd(lambda: lowp_ops.cross_entropy(narrow * 1, narrow_target, overwrite_logits=True), narrow),
            "F.cross_entropy fwd+bwd of logits * 1",
            fwd_bwd(lambda: F.cross_entropy(narrow * 1, narrow_target), narrow),
        )
    )
    plain = logits.detach()
    cases.append(
        (
            "cross_entropy_with_mxfp8_grad 512x32000",
            lambda: lowp_ops.cross_entropy_with_mxfp8_grad(plain, target),
            "F.cross_entropy fwd+bwd",
            torch_ce,
        )
    )
    cases += peer_loss_cases(logits, target, torch_ce)
    # softmax family, 256 x 4096
    x = randn(256, 4096, grad=True)
    xd = x.detach()
    for name, ours, theirs in (
        ("softmax", lowp_ops.softmax, torch.softmax),
        ("log_softmax", lowp_ops.log_softmax, torch.log_softmax),
        ("logsumexp", lowp_ops.logsumexp, torch.logsumexp),
    ):
        cases.append(
            (
                f"{name} fwd 256x4096",
                lambda o=ours: o(xd, -1),
                f"torch.{name} fwd",
                lambda t=theirs: t(xd, -1),
            )
        )
        cases.append(
            (
                f"{name} fwd+bwd 256x4096",
                fwd_bwd(lambda o=ours: o(x, -1), x),
                f"torch.{name} fwd+bwd",
                fwd_bwd(lambda t=theirs: t(x, -1), x),
            )
        )
    # formats, 256 x 4096 bf16; the baseline is one aten reduction
    xq = randn(256, 4096)
    amax = lambda: xq.abs().amax()
    q = lowp_ops.mxfp8_quantize(xq)
    cases.append(
        ("mxfp8_quantize row+col 256x4096", lambda: lowp_ops.mxfp8_quantize(xq), "x.abs().amax()", amax)
    )
    cases.append(("mxfp8_dequantize 256x4096", lambda: lowp_ops.mxfp8_dequantize(q), "x.abs().amax()", amax))
    given = xq.abs().amax().float().reshape(1)
    cases.append(
        (
            "nvfp4_quantize row+col RHT, given amax",
            lambda: lowp_ops.nvfp4_quantize(
                xq, columnwise=True, rht=True, amax_rowwise=given, amax_columnwise=given
            ),
            "x.abs().amax()",
            amax,
        )
    )
    cases.append(
        (
            "nvfp4_quantize row+col RHT, amax + SR",
            lambda: lowp_ops.nvfp4_quantize(xq, columnwise=True, rht=True, stochastic_rounding=True),
            "x.abs().amax()",
            amax,
        )
    )
    nq = lowp_ops.nvfp4_quantize(xq, columnwise=True, rht=True)
    cases.append(("nvfp4_dequantize rowwise", lambda: lowp_ops.nvfp4_dequantize(nq), "x.abs().amax()", amax))
    splits = torch.tensor([64, 0, 96, 32, 0, 32, 16, 16], device=device)
    cases.append(
        (
            "nvfp4_group_quantize row+col RHT, 8 experts",
            lambda: lowp_ops.nvfp4_group_quantize(xq, splits, columnwise=True, rht=True),
            "x.abs().amax()",
            amax,
        )
    )
    # LM head + loss: 512 tokens, H 1024, V 32000
    hidden, weight = randn(512, 1024, grad=True), randn(32000, 1024, grad=True)
    cases.append(
        (
            "linear_cross_entropy fwd+bwd 512x1024x32000",
            fwd_bwd(lambda: lowp_ops.linear_cross_entropy(hidden, weight, target), hidden, weight),
            "F.linear + F.cross_entropy(float) fwd+bwd",
            fwd_bwd(lambda: F.cross_entropy(F.linear(hidden, weight).float(), target), hidden, weight),
        )
    )
    # grouped MLP: 512 tokens, 8 experts, H 1024, F 512
    tokens, experts, h, f = 512, 8, 1024, 512
    xt = randn(tokens, h, grad=True)
    w1, w2 = randn(experts, 2 * f, h, grad=True), randn(experts, h, f, grad=True)
    probs = torch.rand(tokens, device=device, generator=gen).requires_grad_(True)
    mlp_splits = torch.tensor([64, 32, 96, 64, 0, 128, 64, 64], device=device, dtype=torch.int32)
    offs = torch.cumsum(mlp_splits, 0, dtype=torch.int32)

    def plain_mlp():
        c = torch._grouped_mm(xt, w1.transpose(-2, -1), offs=offs)
        gate, lin = c.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * lin.float() * probs.unsqueeze(-1)).to(torch.bfloat16)
        return torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)

    plain_step = fwd_bwd(plain_mlp, xt, w1, w2, probs)
    for recipe in ("bf16", "mxfp8", "nvfp4"):
        cases.append(
            (
                f"grouped_swiglu_mlp {recipe} fwd+bwd T512 E8",
                fwd_bwd(
                    lambda r=recipe: lowp_ops.grouped_swiglu_mlp(xt, w1, w2, mlp_splits, probs, recipe=r),
                    xt,
                    w1,
                    w2,
                    probs,
                ),
                "2x torch._grouped_mm + silu*lin*probs fwd+bwd",
                plain_step,
            )
        )
    module = lowp_ops.nn.GroupedSwiGLUMLP(num_experts=experts, hidden=h, ffn=f, recipe="bf16", device=device)
    cases.append(
        (
            "nn.GroupedSwiGLUMLP bf16 fwd+bwd T512 E8",
            # the weights' gradients cleared as the baseline's are (no accumulation kernels)
            fwd_bwd(lambda: module(xt, mlp_splits, probs), xt, probs, *module.parameters()),
            "2x torch._grouped_mm + silu*lin*probs fwd+bwd",
            plain_step,
        )
    )
    c = randn(tokens, 2 * f, grad=True)
    cases.append(
        (
            "swiglu fwd+bwd T512 F512",
            fwd_bwd(lambda: lowp_ops.swiglu(c, probs), c, probs),
            "silu*lin*probs fwd+bwd",
            fwd_bwd(
                lambda: (F.silu(c[:, :f].float()) * c[:, f:].float() * probs.unsqueeze(-1)).to(
                    torch.bfloat16
                ),
                c,
                probs,
            ),
        )
    )
    normed = randn(tokens, 2048, grad=True)
    norm_weight = torch.ones(2048, device=device, dtype=bf16, requires_grad=True)

    def llama_rms_norm():
        hidden = normed.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5)
        return norm_weight * hidden.to(bf16)

    cases += [
        (
            "rms_norm fwd T512 H2048",
            lambda: lowp_ops.rms_norm(normed.detach(), norm_weight.detach(), 1e-5),
            "F.rms_norm fwd",
            lambda: F.rms_norm(normed.detach(), (2048,), norm_weight.detach(), 1e-5),
        ),
        (
            "rms_norm fwd+bwd T512 H2048",
            fwd_bwd(lambda: lowp_ops.rms_norm(normed, norm_weight, 1e-5), normed, norm_weight),
            "transformers' LlamaRMSNorm formula fwd+bwd",
            fwd_bwd(llama_rms_norm, normed, norm_weight),
        ),
    ]
    grad_h = randn(tokens, f)
    cases.append(
        (
            "dglu T512 F512",
            lambda: lowp_ops.dglu(grad_h, c.detach(), probs.detach(), mlp_splits),
            "x.abs().amax()",
            amax,
        )
    )
    return cases


def compiled_cases(device: str) -> list[tuple[str, object, str, object]]:
    """The same function written with lowp ops and with plain PyTorch, each under torch.compile."""
    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(1)
    randn = lambda *s: torch.randn(*s, device=device, generator=gen).to(bf16).requires_grad_(True)
    cases = []
    logits = randn(512, 32000)
    target = torch.randint(0, 32000, (512,), device=device, generator=gen)
    ours = torch.compile(lambda lg, t: lowp_ops.cross_entropy(lg, t))
    theirs = torch.compile(lambda lg, t: F.cross_entropy(lg, t))
    cases.append(
        (
            "compiled cross_entropy fwd+bwd",
            fwd_bwd(lambda: ours(logits, target), logits),
            "compiled F.cross_entropy",
            fwd_bwd(lambda: theirs(logits, target), logits),
        )
    )
    x = randn(256, 4096)
    ours_sm = torch.compile(lambda v: lowp_ops.softmax(v, -1))
    theirs_sm = torch.compile(lambda v: torch.softmax(v, -1))
    cases.append(
        (
            "compiled softmax fwd+bwd",
            fwd_bwd(lambda: ours_sm(x), x),
            "compiled torch.softmax",
            fwd_bwd(lambda: theirs_sm(x), x),
        )
    )
    hidden, weight = randn(512, 1024), randn(32000, 1024)
    ours_lm = torch.compile(lambda a, w, t: lowp_ops.linear_cross_entropy(a, w, t))
    theirs_lm = torch.compile(lambda a, w, t: F.cross_entropy(F.linear(a, w).float(), t))
    cases.append(
        (
            "compiled linear_cross_entropy fwd+bwd",
            fwd_bwd(lambda: ours_lm(hidden, weight, target), hidden, weight),
            "compiled F.linear + F.cross_entropy",
            fwd_bwd(lambda: theirs_lm(hidden, weight, target), hidden, weight),
        )
    )
    tokens, experts, h, f = 512, 8, 1024, 512
    xt, w1, w2 = randn(tokens, h), randn(experts, 2 * f, h), randn(experts, h, f)
    probs = torch.rand(tokens, device=device, generator=gen).requires_grad_(True)
    splits = torch.tensor([64, 32, 96, 64, 0, 128, 64, 64], device=device, dtype=torch.int32)

    def plain_mlp(a, u, v, s, p):
        offs = torch.cumsum(s, 0, dtype=torch.int32)
        c = torch._grouped_mm(a, u.transpose(-2, -1), offs=offs)
        gate, lin = c.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * lin.float() * p.unsqueeze(-1)).to(torch.bfloat16)
        return torch._grouped_mm(act, v.transpose(-2, -1), offs=offs)

    ours_mlp = torch.compile(lambda a, u, v, s, p: lowp_ops.grouped_swiglu_mlp(a, u, v, s, p))
    theirs_mlp = torch.compile(plain_mlp)
    cases.append(
        (
            "compiled grouped_swiglu_mlp bf16 fwd+bwd",
            fwd_bwd(lambda: ours_mlp(xt, w1, w2, splits, probs), xt, w1, w2, probs),
            "compiled plain grouped MLP",
            fwd_bwd(lambda: theirs_mlp(xt, w1, w2, splits, probs), xt, w1, w2, probs),
        )
    )
    for recipe in ("mxfp8", "nvfp4"):  # against the same bf16 plain MLP, as the eager rows
        ours_q = torch.compile(
            lambda a, u, v, s, p, r=recipe: lowp_ops.grouped_swiglu_mlp(a, u, v, s, p, recipe=r)
        )
        cases.append(
            (
                f"compiled grouped_swiglu_mlp {recipe} fwd+bwd",
                fwd_bwd(lambda q=ours_q: q(xt, w1, w2, splits, probs), xt, w1, w2, probs),
                "compiled plain grouped MLP",
                fwd_bwd(lambda: theirs_mlp(xt, w1, w2, splits, probs), xt, w1, w2, probs),
            )
        )
    return cases


def profile(fn, calls: int = 50, top: int = 30) -> str:
    """cProfile's top entries by own time and by cumulative time over ``calls`` calls; backwards run on
    the calling thread here (cProfile sees one thread), not on autograd's worker thread."""
    with torch.autograd.set_multithreading_enabled(False):
        fn()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out = io.StringIO()
    for key in ("tottime", "cumtime"):
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(top)
    return out.getvalue()


def selects(part: str, name: str) -> bool:
    """Whether an ``--only`` part picks the case ``name``: a substring, or with a leading ``=`` the name."""
    return part[1:] == name if part.startswith("=") else part in name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="eager cases only")
    parser.add_argument("--profile", action="store_true", help="cProfile a few calls of each of our cases")
    parser.add_argument(
        "--only",
        default="",
        help="substrings of the case names to run, comma-separated; '=name' matches that whole name only",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = eager_cases(device) + ([] if args.no_compile else compiled_cases(device))
    rows = []
    print(
        f"{'case':52s} {'ours us':>9s} {'base us':>9s} {'ratio':>6s}  baseline   (host us/call; wall in JSON)"
    )
    for name, ours, base_name, base in cases:
        if args.only and not any(selects(part, name) for part in args.only.split(",")):
            continue
        (ours_host, ours_wall), (base_host, base_wall) = alternating_host_and_wall_us(
            [ours, base], args.calls, args.repeats
        )
        ratio = ours_host / base_host
        rows.append(
            dict(
                case=name,
                ours_host_us=ours_host,
                ours_wall_us=ours_wall,
                baseline=base_name,
                baseline_host_us=base_host,
                baseline_wall_us=base_wall,
                ratio=ratio,
            )
        )
        print(f"{name:52s} {ours_host:9.1f} {base_host:9.1f} {ratio:6.2f}  {base_name}", flush=True)
        if args.profile:
            print(profile(ours))
    path = write_json("host_overhead.json", {"env": environment(), "calls": args.calls, "rows": rows})
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
