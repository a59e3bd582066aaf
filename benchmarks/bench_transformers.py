"""Training throughput and peak memory of whole transformers models: stock, Liger and lowp_ops.

Four causal LMs built from configs (no downloads, random weights drawn from a fixed seed, bf16, sdpa
attention; eager for Gemma 2, whose attention soft-capping sdpa does not take): a ~1.5B-parameter Llama
(Llama-3.2-1B shapes with untied embeddings), a small Qwen3-MoE (64 experts, top-8) and, on request
(``--models gemma2,gemma3``), Gemma 2 2B's shapes (a 256000-token vocabulary, final-logit soft-capping at
30) and Gemma 3 1B's (a 262144-token vocabulary).
Each is trained with

- ``stock``: transformers as installed (MoE experts through its default experts implementation);
- ``liger``: Liger-Kernel's full patch for the model (RMSNorm, RoPE, SwiGLU / GeGLU / fused MoE experts,
  fused linear cross entropy); ``liger-loss``: Liger with only its fused linear cross entropy (lowp's scope);
- ``lowp``: ``apply_lowp_ops(model)`` (LM head + loss through ``linear_cross_entropy``, every RMSNorm
  through ``rms_norm``, the dense SwiGLU MLPs through ``swiglu``; on the MoE also ``experts="bf16"``;
  on Gemma the LM head and loss and the ``1 + weight`` RMSNorms: its GeGLU MLPs stay transformers');
  opt-in ``lowp-mxfp8`` (``grad_format="mxfp8_e4m3"``, MoE experts ``"mxfp8"``)
  and ``lowp-nvfp4`` (MoE experts ``"nvfp4"``); ``lowp-no-rms-norm``: ``lowp`` with the RMSNorms left to
  transformers (``rms_norm=False``); ``lowp-rms-norm-kernel``: ``lowp`` with the RMSNorms through
  ``rms_norm`` also when compiled (``rms_norm=True``; the default ``"eager"`` leaves compiled norms to
  Inductor); ``lowp-no-mlp``: ``lowp`` with the dense MLPs left to transformers (``mlp=False``);
  ``lowp-small-chunks``: ``lowp`` with the loss's chunks of at most 2^26 logits however few tokens
  that is (no ``MIN_LOSS_CHUNK_TOKENS`` floor),

eager and compiled (default regional: ``layer.compile()`` on every decoder layer; ``--compile-scope
model``: ``model.compile()``, the whole model; no CUDA graphs). A step is forward with ``labels`` (the
model computes the loss), backward, AdamW (``fused=True`` on CUDA, lr 1e-4) and ``zero_grad``. After
the warm-up steps (compilation happens there) the timed steps run between two ``cuda.synchronize``:
tokens/s = batch x seq x steps / seconds; peak = ``max_memory_allocated`` over the timed steps (weights,
AdamW state, gradients and activations), its reset after the warm-up. Every (model, impl, mode) case runs
in its own fresh subprocess (Liger patches transformers classes globally), under a per-case timeout and a
global budget (``--budget-seconds``, default 225: no case starts once it is spent; the run order is the
liger and lowp rows, then stock, then liger-loss, so a cut keeps the comparison and prints the commands
of the cases it dropped); a failed case prints its error tail and the run goes on. The losses of one
model must agree across implementations (same weights and tokens): a warning is printed where they do not.

Run (H200, <= ~4 min): ``python benchmarks/bench_transformers.py``; CPU smoke (tiny configs, Liger skipped):
``python benchmarks/bench_transformers.py --tiny --modes eager``. Markdown tables on stdout, JSON to
``--json`` or ``$OUT/bench_transformers.json`` (else ``./bench_transformers.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

RESULT_TAG = "BENCH_TRANSFORMERS_RESULT "
MODELS = ("llama", "qwen3moe", "gemma2", "gemma3")
DEFAULT_MODELS = ("llama", "qwen3moe")
MODEL_TYPES = {"llama": "llama", "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3_text"}
MODES = ("eager", "compiled")
IMPLS = (
    "stock",
    "liger",
    "liger-loss",
    "lowp",
    "lowp-mxfp8",
    "lowp-nvfp4",
    "lowp-no-rms-norm",
    "lowp-rms-norm-kernel",
    "lowp-no-mlp",
    "lowp-small-chunks",
)
DEFAULT_IMPLS = ("stock", "liger", "liger-loss", "lowp")
PRIORITY = (("liger", "lowp"), ("stock",), ("liger-loss",))
"""Tiers of the run order (each over every (mode, model) group; other impls last): a tight budget cuts the
later tiers first and keeps the lowp-versus-Liger comparison."""

LIGER_FLAGS = {
    "liger": {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True},
    "liger-loss": {"rope": False, "rms_norm": False, "swiglu": False, "fused_linear_cross_entropy": True},
}
LIGER_PATCH = {
    "llama": "apply_liger_kernel_to_llama",
    "qwen3moe": "apply_liger_kernel_to_qwen3_moe",
    "gemma2": "apply_liger_kernel_to_gemma2",
    "gemma3": "apply_liger_kernel_to_gemma3_text",
}
ATTENTION = {"gemma2": "eager"}
"""The attention implementation where it is not ``"sdpa"``."""
LIGER_MLP_FLAG = {"gemma2": "geglu", "gemma3": "geglu"}
"""Liger's name for its MLP kernel's flag where it is not ``swiglu``."""
LOWP_OPTIONS = {
    "lowp": {"grad_format": None, "experts": "bf16"},
    "lowp-mxfp8": {"grad_format": "mxfp8_e4m3", "experts": "mxfp8"},
    "lowp-nvfp4": {"grad_format": None, "experts": "nvfp4"},
    "lowp-no-rms-norm": {"grad_format": None, "experts": "bf16", "rms_norm": False},
    "lowp-rms-norm-kernel": {"grad_format": None, "experts": "bf16", "rms_norm": True},
    "lowp-no-mlp": {"grad_format": None, "experts": "bf16", "mlp": False},
    "lowp-small-chunks": {"grad_format": None, "experts": "bf16"},
}
SMALL_CHUNK_IMPLS = ("lowp-small-chunks",)
"""``lowp`` with the loss in chunks of at most 2^26 logits however few tokens that is (no 1024-token
floor: ``MIN_LOSS_CHUNK_TOKENS`` 256), to measure what the floor saves."""
QUANTIZED_IMPLS = ("lowp-mxfp8", "lowp-nvfp4")
LOSS_RTOL = {"bf16": 0.02, "quantized": 0.05}
"""Relative agreement of a case's first and final loss with stock's (bf16 numerics, a few AdamW steps)."""

CONFIGS = {
    "llama": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "qwen3moe": {
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 3072,
        "moe_intermediate_size": 768,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "gemma2": {
        "hidden_size": 2304,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": 9216,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "hidden_size": 1152,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 6912,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "tie_word_embeddings": True,
    },
}
TINY_CONFIGS = {
    "llama": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "qwen3moe": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "gemma2": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "sliding_window": 32,
        "tie_word_embeddings": True,
    },
}
FULL_DEFAULTS = {"batch": 1, "seq": 4096, "steps": 10, "warmup": 3, "case_timeout": 150, "budget": 225}
TINY_DEFAULTS = {"batch": 2, "seq": 64, "steps": 3, "warmup": 2, "case_timeout": 120, "budget": 600}
MIN_START_SECONDS = {"eager": 20, "compiled": 45}
"""A case starts only with this much of the budget left (a compiled one spends ~10-40 s compiling)."""
INIT_STD = 0.02
LEARNING_RATE = 1e-4
WEIGHT_SEED, DATA_SEED = 0, 1


# ------------------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; unset sizes take the full or ``--tiny`` defaults."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {MODELS}")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma list of {IMPLS}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    parser.add_argument("--compile-scope", choices=("regional", "model"), default="regional")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10, tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, tiny 2)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 4096, tiny 64)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 1, tiny 2)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs: a CPU smoke run")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="lowp impls: the loss's tokens per chunk (default: automatic)",
    )
    parser.add_argument("--case-timeout", type=float, default=None, help="seconds per case (default 150)")
    parser.add_argument(
        "--budget-seconds", type=float, default=None, help="whole run (default 225); later cases skipped"
    )
    parser.add_argument("--json", default=None, help="output path (default $OUT/bench_transformers.json)")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: MODEL:IMPL:MODE
    args = parser.parse_args(argv)
    defaults = TINY_DEFAULTS if args.tiny else FULL_DEFAULTS
    for name in ("batch", "seq", "steps", "warmup", "case_timeout"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.budget_seconds is None:
        args.budget_seconds = defaults["budget"]
    args.models = _choices(args.models, MODELS, "--models")
    args.impls = _choices(args.impls, IMPLS, "--impls")
    args.modes = _choices(args.modes, MODES, "--modes")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    return args


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """A comma list checked against ``allowed``, in the order given."""
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: unknown {unknown or 'empty list'}; choose from {list(allowed)}")
    return chosen


def child_command(args: argparse.Namespace, case: tuple[str, str, str]) -> list[str]:
    """The command line that runs one case in a fresh interpreter."""
    command = [sys.executable, os.path.abspath(__file__), "--case", ":".join(case)]
    for flag, value in (
        ("--steps", args.steps),
        ("--warmup", args.warmup),
        ("--seq", args.seq),
        ("--batch", args.batch),
        ("--compile-scope", args.compile_scope),
    ):
        command += [flag, str(value)]
    if args.chunk_size is not None:
        command += ["--chunk-size", str(args.chunk_size)]
    return command + (["--tiny"] if args.tiny else [])


# ------------------------------------------------------------------------------------ one case (child)


class SkipCase(Exception):
    """The case cannot run here (reason in the message); not a failure."""


def build_model(model_name: str, impl: str, tiny: bool, device, chunk_size: int | None = None):
    """The model of ``model_name`` with ``impl`` applied, on ``device`` in bf16, weights from WEIGHT_SEED.
    Liger patches the transformers module before the model is built (its documented order).
    ``chunk_size``: the lowp loss's tokens per chunk (None: automatic)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if impl in LIGER_FLAGS:
        apply_liger(model_name, impl, device)
    config = AutoConfig.for_model(MODEL_TYPES[model_name], **(TINY_CONFIGS if tiny else CONFIGS)[model_name])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=ATTENTION.get(model_name, "sdpa")
        )
    init_weights(model, WEIGHT_SEED)
    if impl in LOWP_OPTIONS:
        apply_lowp(model, model_name, impl, chunk_size)
    return model.train()


def apply_liger(model_name: str, impl: str, device) -> None:
    """Liger's patch of ``model_name`` with the flags of ``impl``; SkipCase where it cannot run."""
    if device.type != "cuda":
        raise SkipCase(f"Liger's kernels need CUDA (device is {device.type})")
    from _common import import_liger

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        patch = import_liger("transformers", LIGER_PATCH[model_name])
    if patch is None:
        raise SkipCase(printed.getvalue().strip() or "liger_kernel.transformers does not import")
    flags = dict(LIGER_FLAGS[impl])
    flags[LIGER_MLP_FLAG.get(model_name, "swiglu")] = flags.pop("swiglu")
    patch(cross_entropy=False, **flags)


def apply_lowp(model, model_name: str, impl: str, chunk_size: int | None = None) -> None:
    """``apply_lowp_ops`` with the options of ``impl`` (experts only on the MoE model) and ``chunk_size``."""
    from lowp_ops.integrations.transformers import apply_lowp_ops

    options = dict(LOWP_OPTIONS[impl])
    if chunk_size is not None:
        options["chunk_size"] = chunk_size
    if impl in SMALL_CHUNK_IMPLS:  # each case runs in its own process: the change stays in it
        from lowp_ops.integrations.transformers import head

        head.MIN_LOSS_CHUNK_TOKENS = 256
    if model_name != "qwen3moe":
        options.pop("experts")
        if impl == "lowp-nvfp4":
            raise SkipCase(f"lowp-nvfp4 changes only MoE experts; {model_name} has none")
    apply_lowp_ops(model, **options)


def init_weights(model, seed: int) -> None:
    """Equal weights whatever the implementation: each parameter is drawn from a generator seeded by
    ``seed`` and its name (so Liger's replacement modules, which initialize on their own, and the order of
    parameters do not matter); 1-D parameters (norm weights) are ones."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            generator = torch.Generator(device=param.device)
            generator.manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
            param.normal_(0.0, INIT_STD, generator=generator)


def compile_model(model, scope: str) -> None:
    """Regional (each decoder layer) or whole-model ``torch.compile``, in place."""
    if scope == "model":
        model.compile()
        return
    for layer in model.model.layers:
        layer.compile()


def make_batch(vocab: int, batch: int, seq: int, device):
    """(input_ids, labels): uniform random tokens from DATA_SEED; the model shifts the labels itself."""
    import torch

    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    return tokens, tokens.clone()


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The case a single-case probe builds (``probe_train_memory.py``, ``profile_train_step.py``)."""
    parser.add_argument("--model", default="qwen3moe", choices=MODELS)
    parser.add_argument("--impl", default="lowp", choices=IMPLS)
    parser.add_argument("--compiled", action="store_true", help="regional torch.compile")
    parser.add_argument("--top", type=int, default=25, help="rows of the report")


def probe_case(args: argparse.Namespace, warmup: int):
    """(model, optimizer, batch) of the probe's case on CUDA, batch 1 x 4096, after ``warmup`` steps."""
    import torch

    device = torch.device("cuda")
    model = build_model(args.model, args.impl, False, device)
    if args.compiled:
        compile_model(model, "regional")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    batch = make_batch(model.config.vocab_size, 1, 4096, device)
    for _ in range(warmup):
        train_step(model, optimizer, *batch)
    torch.cuda.synchronize()
    return model, optimizer, batch


def train_step(model, optimizer, input_ids, labels):
    """Forward with labels, backward, optimizer step, zero_grad; the detached loss (no host sync)."""
    loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(model, optimizer, batch, args: argparse.Namespace, device) -> dict:
    """Warm-up steps (the first loss is read before any update), then the timed steps."""
    import torch

    start = time.perf_counter()
    first_loss = float(train_step(model, optimizer, *batch))
    for _ in range(args.warmup - 1):
        train_step(model, optimizer, *batch)
    synchronize(device)
    warmup_s = time.perf_counter() - start
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        state_bytes = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = train_step(model, optimizer, *batch)
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = args.batch * args.seq * args.steps
    return {
        "tokens_per_s": tokens / seconds,
        "step_ms": 1e3 * seconds / args.steps,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "state_gib": state_bytes / 2**30 if cuda else None,
        "first_loss": first_loss,
        "final_loss": float(loss),
        "warmup_s": warmup_s,
    }


def dynamo_counts() -> dict:
    """Graphs compiled and graph breaks seen by dynamo in this process."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def run_case(args: argparse.Namespace) -> dict:
    """One (model, impl, mode) case in this process; a result dict (status ok / skipped)."""
    import torch

    model_name, impl, mode = args.case.split(":")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"model": model_name, "impl": impl, "mode": mode, "device": device.type}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    start = time.perf_counter()
    try:
        model = build_model(model_name, impl, args.tiny, device, chunk_size=args.chunk_size)
    except SkipCase as reason:
        return {**result, "status": "skipped", "reason": str(reason)}
    result["params"] = sum(p.numel() for p in model.parameters())
    result["attn_implementation"] = model.config._attn_implementation
    result["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    if mode == "compiled":
        compile_model(model, args.compile_scope)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=device.type == "cuda")
    batch = make_batch(model.config.vocab_size, args.batch, args.seq, device)
    result["setup_s"] = time.perf_counter() - start
    result.update(measure(model, optimizer, batch, args, device))
    if mode == "compiled":
        result.update(dynamo_counts())
    return {**result, "status": "ok"}


# ----------------------------------------------------------------------------------- the run (parent)


def plan_cases(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(model, impl, mode) in run order: the PRIORITY tiers, each over every (mode, model) group, then the
    remaining implementations."""
    groups = [(model, mode) for mode in args.modes for model in args.models]
    tiers = [*PRIORITY, tuple(impl for impl in IMPLS if not any(impl in tier for tier in PRIORITY))]
    return [
        (model, impl, mode) for tier in tiers for model, mode in groups for impl in args.impls if impl in tier
    ]


def skip_reason(case: tuple[str, str, str], cuda: bool) -> str | None:
    """Why a case need not start a subprocess at all (None: run it)."""
    model, impl, _ = case
    if impl in LIGER_FLAGS and not cuda:
        return "Liger's kernels need CUDA (no GPU here)"
    if impl in LIGER_FLAGS and importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed"
    if impl == "lowp-nvfp4" and model != "qwen3moe":
        return f"lowp-nvfp4 changes only MoE experts; {model} has none"
    return None


def child_env() -> dict:
    """This environment with the repository root on PYTHONPATH (lowp_ops importable uninstalled)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run_subprocess(command: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, stdout+stderr); a timed-out case's whole process group (Inductor's
    compile workers included) is killed."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        preexec_fn=os.setpgrp,  # its own process group: a timeout kills its compile workers too
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output


def run_one(args: argparse.Namespace, case: tuple[str, str, str], timeout: float) -> dict:
    """Runs ``case`` in a subprocess; its result, or a failure with the output's tail."""
    model, impl, mode = case
    start = time.perf_counter()
    code, output = run_subprocess(child_command(args, case), timeout)
    base = {"model": model, "impl": impl, "mode": mode, "wall_s": time.perf_counter() - start}
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_TAG):
            return {**json.loads(line[len(RESULT_TAG) :]), "wall_s": base["wall_s"]}
    tail = "\n".join(output.strip().splitlines()[-15:])
    error = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
    print(f"    {model}/{impl}/{mode} failed ({error}); output tail:\n{_indent(tail)}", flush=True)
    return {**base, "status": "failed", "reason": error, "tail": tail}


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())


def run_all(args: argparse.Namespace, cuda: bool) -> list[dict]:
    """Every planned case, each in its own subprocess, within the global budget."""
    deadline = time.perf_counter() + args.budget_seconds
    results = []
    for case in plan_cases(args):
        reason = skip_reason(case, cuda)
        left = deadline - time.perf_counter()
        if reason is None and left < MIN_START_SECONDS[case[2]]:
            reason = f"budget: {left:.0f} s of --budget-seconds {args.budget_seconds:.0f} left"
        if reason is not None:
            result = {"model": case[0], "impl": case[1], "mode": case[2], "status": "skipped"}
            results.append({**result, "reason": reason})
        else:
            results.append(run_one(args, case, min(args.case_timeout, left)))
        print(progress_line(results[-1], args.budget_seconds - (deadline - time.perf_counter())), flush=True)
    return results


def progress_line(r: dict, elapsed: float) -> str:
    """One line per finished case."""
    head = f"[{elapsed:6.1f} s] {r['model']:9s} {r['mode']:8s} {r['impl']:11s}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r.get('reason', '')}"
    peak = "n/a" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f} GiB"
    return (
        f"{head} {r['tokens_per_s']:10.0f} tok/s {r['step_ms']:8.1f} ms/step peak {peak} "
        f"loss {r['first_loss']:.4f} -> {r['final_loss']:.4f} (warm-up {r['warmup_s']:.1f} s, "
        f"case {r['wall_s']:.1f} s)"
    )


# ---------------------------------------------------------------------------------------- reporting


def reference(results: list[dict], model: str) -> dict | None:
    """The stock case of ``model`` the others are checked against (eager first)."""
    for mode in MODES:
        for r in results:
            if (r["model"], r["impl"], r["mode"], r["status"]) == (model, "stock", mode, "ok"):
                return r
    return None


def check_losses(results: list[dict]) -> list[str]:
    """Warnings for losses that disagree with stock's of the same model beyond LOSS_RTOL."""
    warnings = []
    for r in results:
        ref = reference(results, r["model"])
        if r["status"] != "ok" or ref is None or ref is r:
            continue
        rtol = LOSS_RTOL["quantized" if r["impl"] in QUANTIZED_IMPLS else "bf16"]
        for key in ("first_loss", "final_loss"):
            gap = abs(r[key] - ref[key]) / abs(ref[key])
            if not gap <= rtol:  # also catches NaN
                warnings.append(
                    f"WARNING {r['model']}/{r['impl']}/{r['mode']} {key} {r[key]:.4f} vs stock/"
                    f"{ref['mode']} {ref[key]:.4f}: relative gap {gap:.3g} > {rtol}"
                )
    return warnings


def ratios(results: list[dict]) -> list[dict]:
    """tokens/s and peak memory of every lowp case over liger, liger-loss and stock (same model, mode)."""
    ok = {(r["model"], r["impl"], r["mode"]): r for r in results if r["status"] == "ok"}
    rows = []
    for (model, impl, mode), r in ok.items():
        if not impl.startswith("lowp"):
            continue
        for base in ("liger", "liger-loss", "stock"):
            other = ok.get((model, base, mode))
            if other is None:
                continue
            peak = None
            if r.get("peak_gib") is not None and other.get("peak_gib"):
                peak = r["peak_gib"] / other["peak_gib"]
            speed = r["tokens_per_s"] / other["tokens_per_s"]
            met = None if peak is None else bool(speed >= 1.0 and peak <= 1.0)
            row = {"model": model, "mode": mode, "impl": impl, "versus": base}
            rows.append({**row, "tokens_per_s_ratio": speed, "peak_ratio": peak, "target_met": met})
    return rows


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_tables(results: list[dict], ratio_rows: list[dict], scope: str) -> None:
    """The per-case table and the ratio table, in markdown."""
    print(f"\n| model | mode (compiled: {scope}) | impl | tokens/s | ms/step | peak GiB | weights+AdamW GiB "
          "| first loss | final loss | warm-up s | note |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    order = {name: i for i, name in enumerate(IMPLS)}
    for r in sorted(results, key=lambda r: (r["model"], MODES.index(r["mode"]), order[r["impl"]])):
        if r["status"] != "ok":
            blank = "| " * 7
            print(f"| {r['model']} | {r['mode']} | {r['impl']} {blank}| {r['status']}: {r['reason']} |")
            continue
        note = ""
        if r["mode"] == "compiled":
            note = f"{r.get('graphs', '?')} graphs, {r.get('graph_breaks', '?')} breaks"
        print(
            f"| {r['model']} | {r['mode']} | {r['impl']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} "
            f"| {_fmt(r['peak_gib'], '.2f')} | {_fmt(r['state_gib'], '.2f')} | {r['first_loss']:.4f} "
            f"| {r['final_loss']:.4f} | {r['warmup_s']:.1f} | {note} |"
        )
    if ratio_rows:
        print("\n| model | mode | lowp impl | versus | tokens/s ratio | peak ratio | faster and leaner |")
        print("|---|---|---|---|---|---|---|")
        for q in ratio_rows:
            met = "n/a" if q["target_met"] is None else ("yes" if q["target_met"] else "no")
            print(
                f"| {q['model']} | {q['mode']} | {q['impl']} | {q['versus']} | {q['tokens_per_s_ratio']:.3f} "
                f"| {_fmt(q['peak_ratio'], '.3f')} | {met} |"
            )


def versions() -> dict:
    """Installed versions (no imports): torch, triton, transformers, Liger."""
    found = {}
    for key, names in {
        "torch": ("torch",),
        "triton": ("triton",),
        "transformers": ("transformers",),
        "liger_kernel": ("liger-kernel", "liger_kernel"),
    }.items():
        found[key] = None
        for name in names:
            try:
                found[key] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def report(args: argparse.Namespace, results: list[dict], wall_s: float) -> dict:
    """The JSON payload: environment, settings, shapes, cases, ratios and loss warnings."""
    gpus = {r.get("gpu") for r in results if r.get("gpu")}
    configs = TINY_CONFIGS if args.tiny else CONFIGS
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": ", ".join(sorted(gpus)) or "cpu",
        "python": sys.version.split()[0],
        **versions(),
        "settings": {
            "batch": args.batch,
            "seq": args.seq,
            "steps": args.steps,
            "warmup": args.warmup,
            "dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "optimizer": f"AdamW lr={LEARNING_RATE} (fused on CUDA)",
            "compile_scope": args.compile_scope,
            "tiny": args.tiny,
            "budget_seconds": args.budget_seconds,
            "case_timeout": args.case_timeout,
            "lowp_chunk_size": args.chunk_size,
            "wall_s": wall_s,
        },
        "shapes": {model: configs[model] for model in args.models},
        "cases": results,
        "ratios": ratios(results),
        "loss_warnings": check_losses(results),
    }


def rerun_command(args: argparse.Namespace, r: dict) -> str:
    """The command that runs one case the budget cut, on its own."""
    extra = " --tiny" if args.tiny else ""
    if args.compile_scope != "regional":
        extra += f" --compile-scope {args.compile_scope}"
    return (
        f"python benchmarks/bench_transformers.py --models {r['model']} --impls {r['impl']} "
        f"--modes {r['mode']} --steps {args.steps} --warmup {args.warmup} --batch {args.batch} "
        f"--seq {args.seq}{extra}"
    )


def json_path(args: argparse.Namespace) -> str:
    if args.json:
        return args.json
    return os.path.join(os.environ.get("OUT") or ".", "bench_transformers.json")


def main() -> None:
    args = parse_args()
    if args.case:
        print(RESULT_TAG + json.dumps(run_case(args)), flush=True)
        return
    import torch  # the parent only asks whether CUDA is there; the cases run in subprocesses

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("no CUDA device: the full-size models need a GPU; use --tiny for a CPU smoke run")
    compile_note = "every decoder layer" if args.compile_scope == "regional" else "the whole model"
    print(
        f"bench_transformers: models {args.models}, impls {args.impls}, modes {args.modes}; "
        f"compiled = torch.compile of {compile_note} ({args.compile_scope}), no CUDA graphs; "
        f"batch {args.batch} x seq {args.seq}, {args.warmup} warm-up + {args.steps} timed steps, "
        f"AdamW lr {LEARNING_RATE}; budget {args.budget_seconds:.0f} s, {args.case_timeout:.0f} s per case"
        + ("" if args.chunk_size is None else f"; lowp loss chunks of {args.chunk_size} tokens"),
        flush=True,
    )
    start = time.perf_counter()
    results = run_all(args, cuda)
    payload = report(args, results, time.perf_counter() - start)
    print_tables(results, payload["ratios"], args.compile_scope)
    for warning in payload["loss_warnings"]:
        print(warning)
    for r in results:
        if r["status"] == "skipped" and r["reason"].startswith("budget"):
            print(f"cut by the budget: {rerun_command(args, r)}")
    path = json_path(args)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"\nwrote {path} ({payload['settings']['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
