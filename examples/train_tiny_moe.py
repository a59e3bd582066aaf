"""Train a tiny MoE language model whose every low-precision piece is a ``lowp`` op.

- attention probabilities: ``lowp_ops.softmax`` (masked-safe; the causal mask is -inf);
- router probabilities: ``lowp_ops.softmax`` over the experts, top-k routing;
- experts: ``lowp_ops.nn.GroupedSwiGLUMLP`` (grouped GEMMs, fused dGLU backward, recipe bf16 / mxfp8 /
  nvfp4; the fp32 router probabilities get an fp32 gradient);
- LM head + loss: ``lowp_ops.linear_cross_entropy``; with the mxfp8 and nvfp4 recipes the logits
  gradient is written as MXFP8 and fed to the dgrad / wgrad GEMMs (bf16 recipe: a bf16 gradient, so
  that the bf16 model has no FP8 anywhere, as the baseline).

``--baseline`` trains the same model (same parameters and initialization) in plain PyTorch instead:
``torch.softmax``, bf16 experts on two ``torch._grouped_mm`` with ``silu(gate) * linear * probs`` between
them, and ``F.cross_entropy`` on the full logits.

``--mode`` picks how a step runs: ``graph`` (the default on CUDA: the step under
``torch.compile(fullgraph=True)``, then captured in one CUDA graph with AdamW and replayed),
``compiled`` (the default on CPU: ``torch.compile`` without CUDA graphs) or ``eager`` (no compile). The
text is generated deterministically (a small grammar, byte-level tokens), so the run needs no download.
Each run prints one line (wrapped here)::

    model=<lowp|baseline> recipe=<r> device=<d> mode=<m> steps=<n> first_loss=<x> last_loss=<y>
    graph_breaks=<k> recompiles=<r> tokens_per_s=<t> peak_memory_mib=<MiB, or n/a on CPU>

tokens/s counts the steps after the first ``WARMUP_STEPS + 1`` (compilation, warm-up and
the CUDA-graph capture happen there): ``n/a`` for runs of no more steps than those.
Usage: ``python examples/train_tiny_moe.py --steps 30`` (CPU,
reference kernels), ``--device cuda`` (Triton kernels), ``--recipe mxfp8``, ``--plot losses.png``
(trains the three recipes, and the baseline with ``--baseline``, and plots their loss curves).
Needs the ``examples`` extra (tqdm, matplotlib): ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import lowp_ops

try:
    from tqdm import tqdm
except ImportError as error:  # pragma: no cover - the message is the point
    raise SystemExit(f'{error}: install the examples extra: pip install -e ".[examples]"') from error

RECIPES = ("bf16", "mxfp8", "nvfp4")
MODES = ("graph", "compiled", "eager")
VOCAB = 256  # bytes
# Expert groups are padded to this many rows on the device (MXFP8 blocks run 32 tokens along a group).
GROUP_ALIGN = 32
WARMUP_STEPS = 3  # steps run before the CUDA-graph capture (mode "graph")
LOSS_DISPLAY_EVERY = 10  # the progress bar reads the loss (a host sync) this often

Softmax = Callable[..., torch.Tensor]


# ------------------------------------------------------------------------------------------------ data


def tiny_corpus(n_chars: int, seed: int = 0) -> bytes:
    """Deterministic English-like text from a small grammar (learnable structure, no download)."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "every child", "the engineer", "a bird"]
    verbs = ["sees", "likes", "builds", "finds", "carries", "paints", "follows"]
    objects = ["a red ball", "the small house", "two green apples", "the long road", "a quiet song"]
    tails = ["today", "at night", "in the park", "with care", "again and again", "near the river"]
    parts = []
    size = 0
    while size < n_chars:
        sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}. "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts).encode()[:n_chars]


def batches(
    data: torch.Tensor, batch: int, seq: int, steps: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (inputs, targets) int64 pairs of shape (batch, seq), drawn with a fixed generator."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1].long(), window[:, 1:].long()


# ----------------------------------------------------------------------------------------------- model


class CausalSelfAttention(torch.nn.Module):
    """Multi-head causal attention whose probabilities come from ``softmax`` (lowp's or torch's)."""

    def __init__(self, dim: int, heads: int, softmax: Softmax):
        super().__init__()
        self.heads, self.softmax = heads, softmax
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = self.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(batch, seq, dim))


class PlainGroupedSwiGLUMLP(lowp_ops.nn.GroupedSwiGLUMLP):
    """The baseline's experts: the parameters and initialization of ``GroupedSwiGLUMLP`` (recipe bf16),
    computed in plain PyTorch: ``torch._grouped_mm`` for FC1 and FC2, ``silu(gate) * linear * probs``
    between them, autograd for the backward. x (T, H) bf16 sorted by expert, split_sizes (E,) integer,
    probs (T,) fp32 -> (T, H) bf16."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__(num_experts, hidden, ffn, recipe="bf16")

    def forward(self, x: torch.Tensor, split_sizes: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        group_ends = torch.cumsum(split_sizes, 0, dtype=torch.int32)
        fc1 = torch._grouped_mm(x, self.fc1_weight.transpose(-2, -1), offs=group_ends)
        gate, linear = fc1.chunk(2, dim=-1)  # gate rows first, as GroupedSwiGLUMLP
        hidden = (F.silu(gate) * linear * probs.unsqueeze(-1)).to(x.dtype)
        return torch._grouped_mm(hidden, self.fc2_weight.transpose(-2, -1), offs=group_ends)


class MoELayer(torch.nn.Module):
    """Top-k router + grouped SwiGLU experts. Tokens are sorted by expert on the device; each expert's
    group is padded to ``GROUP_ALIGN`` rows inside a buffer of static size (padding rows carry
    probability 0), so no shape depends on the routing and nothing leaves the device."""

    def __init__(self, dim: int, ffn: int, experts: int, top_k: int, recipe: str, baseline: bool):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.softmax = torch.softmax if baseline else lowp_ops.softmax
        self.router = torch.nn.Linear(dim, experts, bias=False)
        if baseline:
            self.mlp = PlainGroupedSwiGLUMLP(experts, dim, ffn)
        else:
            self.mlp = lowp_ops.nn.GroupedSwiGLUMLP(experts, dim, ffn, recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, dim = x.shape
        assignments = tokens * self.top_k
        router_probs = self.softmax(self.router(x).float(), dim=-1)
        top_probs, top_experts = router_probs.topk(self.top_k, dim=-1)
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
        expert = top_experts.reshape(-1)  # assignment a = token * top_k + j
        counts = F.one_hot(expert, self.experts).sum(0)
        padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        rows = (assignments + self.experts * (GROUP_ALIGN - 1) + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        group_start = torch.cumsum(padded, 0) - padded
        order = torch.argsort(expert, stable=True)
        sorted_expert = expert[order]
        rank_in_expert = (
            torch.arange(assignments, device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
        )
        row_of_sorted = group_start[sorted_expert] + rank_in_expert
        row_of_assignment = torch.empty_like(row_of_sorted).scatter_(0, order, row_of_sorted)
        # The slack rows of the static buffer join the last expert (their probability is 0).
        is_last = torch.arange(self.experts, device=x.device) == self.experts - 1
        split_sizes = padded + is_last * (rows - padded.sum())
        # Gathers and index_copy only: every row is written once, so forward and backward are
        # deterministic (a CUDA-graph replay must reproduce the eager losses bit for bit).
        x_assign = x.to(torch.bfloat16).unsqueeze(1).expand(tokens, self.top_k, dim).reshape(-1, dim)
        x_rows = x_assign.new_zeros(rows, dim).index_copy(0, row_of_assignment, x_assign)
        p_rows = top_probs.new_zeros(rows).index_copy(0, row_of_assignment, top_probs.reshape(-1))
        y_rows = self.mlp(x_rows, split_sizes, p_rows)
        y = y_rows.index_select(0, row_of_assignment).view(tokens, self.top_k, dim).sum(1)
        return y.to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, experts: int, top_k: int, recipe: str, baseline: bool):
        super().__init__()
        self.norm1 = torch.nn.RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, torch.softmax if baseline else lowp_ops.softmax)
        self.norm2 = torch.nn.RMSNorm(dim)
        self.moe = MoELayer(dim, ffn, experts, top_k, recipe, baseline)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        batch, seq, dim = x.shape
        return x + self.moe(self.norm2(x).reshape(-1, dim)).view(batch, seq, dim)


class TinyMoELM(torch.nn.Module):
    """Byte-level MoE LM. ``baseline=False``: lowp ops with the experts' ``recipe``; ``baseline=True``:
    the same model (same parameters, drawn in the same order) in plain PyTorch with bf16 experts."""

    def __init__(
        self, dim=64, heads=4, layers=2, ffn=128, experts=4, top_k=2, recipe="bf16", seq=64, baseline=False
    ):
        super().__init__()
        self.baseline = baseline
        self.head_grad_format = None if recipe == "bf16" else "mxfp8_e4m3"
        # Token and position embeddings as one-hot matmuls: deterministic backward on every device.
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, dim) * 0.02)
        self.position = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(
            Block(dim, heads, ffn, experts, top_k, recipe, baseline) for _ in range(layers)
        )
        self.norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Parameter(torch.randn(VOCAB, dim, dtype=torch.bfloat16) * 0.02)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross entropy (fp32 scalar) of int64 (batch, seq) inputs and targets."""
        x = F.one_hot(inputs, VOCAB).float() @ self.embed + self.position[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        hidden = self.norm(x).to(torch.bfloat16).reshape(-1, x.shape[-1])
        if self.baseline:
            return F.cross_entropy(F.linear(hidden, self.head).float(), targets.reshape(-1))
        return lowp_ops.linear_cross_entropy(
            hidden, self.head, targets.reshape(-1), grad_format=self.head_grad_format
        )


# -------------------------------------------------------------------------------------------- training


def dynamo_counts() -> tuple[int, int]:
    """(graph breaks, recompiles) seen by Dynamo since the counters were cleared: one compiled function,
    so every graph after the first is a recompile."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    return breaks, max(counters["stats"]["unique_graphs"] - 1, 0)


class Trainer:
    """One training step = forward + backward + AdamW; the loss compiled unless ``mode == "eager"``.
    With ``mode == "graph"`` (CUDA) the first ``warmup`` steps run as is, then the step is captured in a
    CUDA graph and replayed with each new batch copied into its static inputs."""

    def __init__(
        self, model: TinyMoELM, device: str, batch: int, seq: int, mode: str, warmup: int = WARMUP_STEPS
    ):
        self.model, self.device = model, device
        self.loss_fn = model.loss if mode == "eager" else torch.compile(model.loss, fullgraph=True)
        # Capturable on every CUDA run, so that graph and compiled runs take the same optimizer steps.
        capturable = device == "cuda"
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, capturable=capturable)
        self.cuda_graph, self.warmup = mode == "graph", warmup
        self.inputs = torch.zeros(batch, seq, dtype=torch.long, device=device)
        self.targets = torch.zeros(batch, seq, dtype=torch.long, device=device)
        self.graph = None
        self.steps_done = 0

    def _step(self) -> torch.Tensor:
        loss = self.loss_fn(self.inputs, self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One step on a (batch, seq) batch -> its loss, an fp32 scalar on the device (not synced)."""
        self.inputs.copy_(inputs)
        self.targets.copy_(targets)
        if not self.cuda_graph or self.steps_done < self.warmup:
            loss = self._step()
        else:
            if self.graph is None:
                torch.cuda.synchronize()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.static_loss = self._step()
            self.graph.replay()
            loss = self.static_loss.clone()
        self.steps_done += 1
        return loss


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_label(baseline: bool, recipe: str) -> str:
    return "plain PyTorch bf16" if baseline else f"lowp {recipe}"


def train(args: argparse.Namespace, recipe: str, baseline: bool) -> dict:
    """Train one model for ``args.steps`` steps -> its losses, Dynamo counts, tokens/s and peak memory."""
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    data = torch.frombuffer(bytearray(tiny_corpus(200_000, args.seed)), dtype=torch.uint8)
    model = TinyMoELM(recipe=recipe, seq=args.seq, baseline=baseline).to(args.device)
    trainer = Trainer(model, args.device, args.batch, args.seq, args.mode)
    untimed = WARMUP_STEPS + 1
    timed = args.steps > untimed
    start = time.perf_counter()
    losses = []
    bar = tqdm(total=args.steps, desc=run_label(baseline, recipe), unit="step", disable=None, file=sys.stderr)
    for step, (inputs, targets) in enumerate(batches(data, args.batch, args.seq, args.steps, args.seed), 1):
        if step == untimed + 1:
            synchronize(args.device)
            start = time.perf_counter()
        losses.append(trainer.step(inputs.to(args.device), targets.to(args.device)))
        bar.update(1)
        if not bar.disable and (step % LOSS_DISPLAY_EVERY == 0 or step == args.steps):
            bar.set_postfix(loss=f"{losses[-1].item():.4f}")
    synchronize(args.device)
    elapsed = time.perf_counter() - start
    bar.close()
    breaks, recompiles = dynamo_counts()
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None
    return {
        "model": "baseline" if baseline else "lowp",
        "recipe": recipe,
        "losses": torch.stack(losses).tolist(),
        "graph_breaks": breaks,
        "recompiles": recompiles,
        "tokens_per_s": (args.steps - untimed) * args.batch * args.seq / elapsed if timed else None,
        "peak_memory_mib": peak,
    }


def summary(args: argparse.Namespace, run: dict) -> str:
    """The one-line result of a run (the module docstring gives its fields)."""
    peak = "n/a" if run["peak_memory_mib"] is None else f"{run['peak_memory_mib']:.1f}"
    speed = "n/a" if run["tokens_per_s"] is None else f"{run['tokens_per_s']:.0f}"
    return (
        f"model={run['model']} recipe={run['recipe']} device={args.device} mode={args.mode} "
        f"steps={args.steps} first_loss={run['losses'][0]:.4f} last_loss={run['losses'][-1]:.4f} "
        f"graph_breaks={run['graph_breaks']} recompiles={run['recompiles']} "
        f"tokens_per_s={speed} peak_memory_mib={peak}"
    )


# ------------------------------------------------------------------------------------------------ plot


def loss_figure(runs: list[dict], title: str):
    """A matplotlib Figure with every run's loss per step on one titled, labelled axis with a legend."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axis = figure.add_subplot()
    for run in runs:
        steps = range(1, len(run["losses"]) + 1)
        baseline = run["model"] == "baseline"
        style = "--" if baseline else "-"
        axis.plot(steps, run["losses"], style, label=run_label(baseline, run["recipe"]))
    axis.set_title(title)
    axis.set_xlabel("training step")
    axis.set_ylabel("cross-entropy loss (nats per byte)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    return figure


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="graph (CUDA: compiled step captured in a CUDA graph; the default there), compiled (the "
        "default on CPU) or eager",
    )
    parser.add_argument("--recipe", choices=RECIPES, default=None, help="the experts' recipe (mxfp8)")
    parser.add_argument(
        "--baseline", action="store_true", help="the same model in plain PyTorch (bf16 experts)"
    )
    parser.add_argument(
        "--plot", default=None, help="PNG path: train the three recipes (and --baseline), plot the losses"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="parameters, text and batches (default 0)")
    parser.add_argument(
        "--losses",
        default=None,
        help="JSON path: each run's per-step losses as exact float.hex() strings (float.fromhex reads them)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    args.mode = args.mode or ("graph" if args.device == "cuda" else "compiled")
    if args.mode == "graph" and args.device != "cuda":
        parser.error("--mode graph captures a CUDA graph: it needs --device cuda (use compiled or eager)")
    if args.baseline and args.recipe not in (None, "bf16"):
        parser.error(f"--baseline trains bf16 experts: --recipe must be bf16 or left out, got {args.recipe}")
    if args.mode == "graph" and args.steps <= WARMUP_STEPS:
        parser.error(
            f"--mode graph captures the step after {WARMUP_STEPS} warm-up steps: --steps must be more"
        )
    if args.plot and args.recipe is not None:
        parser.error("--plot trains every recipe: leave --recipe out")
    if args.plot:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            parser.error('--plot needs matplotlib: pip install -e ".[examples]"')
        formats = Figure().canvas.get_supported_filetypes()
        if Path(args.plot).suffix.lstrip(".").lower() not in formats:
            parser.error(f"--plot: the file's extension picks the image format, one of {sorted(formats)}")
    # Checked before training, which takes minutes: a path that cannot be written fails now.
    for name in ("plot", "losses"):
        path = getattr(args, name)
        if path is not None and not Path(path).resolve().parent.is_dir():
            parser.error(f"--{name}: the folder of {path} does not exist")
    return args


def planned_runs(args: argparse.Namespace) -> list[tuple[str, bool]]:
    """(recipe, baseline) of each run, in order."""
    if args.plot:
        return [(recipe, False) for recipe in RECIPES] + ([("bf16", True)] if args.baseline else [])
    if args.baseline:
        return [("bf16", True)]
    return [(args.recipe or "mxfp8", False)]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from torch._dynamo.utils import counters

    runs = []
    for recipe, baseline in planned_runs(args):
        torch._dynamo.reset()
        counters.clear()
        runs.append(train(args, recipe, baseline))
        print(summary(args, runs[-1]), flush=True)
    if args.plot:
        title = f"Tiny MoE LM on {args.device}, mode {args.mode}: training loss"
        loss_figure(runs, title).savefig(args.plot, dpi=100)
    if args.losses:
        with open(args.losses, "w") as f:
            fields = ("model", "recipe")
            records = [
                {**{k: run[k] for k in fields}, "losses": [v.hex() for v in run["losses"]]} for run in runs
            ]
            json.dump({"runs": records}, f)
    return runs


if __name__ == "__main__":
    main()
