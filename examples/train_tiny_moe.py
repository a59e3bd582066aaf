"""Train a tiny MoE language model whose every low-precision piece is a ``lowp`` op.

- attention probabilities: ``lowp_ops.softmax`` (masked-safe; the causal mask is -inf);
- router probabilities: ``lowp_ops.softmax`` over the experts, top-k routing;
- experts: ``lowp_ops.nn.GroupedSwiGLUMLP`` (grouped GEMMs, fused dGLU backward, recipe bf16 / mxfp8 /
  nvfp4; the fp32 router probabilities get an fp32 gradient);
- LM head + loss: ``lowp_ops.linear_cross_entropy`` with the logits gradient written as MXFP8 and fed
  to the dgrad / wgrad GEMMs.

The model runs under ``torch.compile(fullgraph=True)``; on CUDA the whole training step (forward,
backward, AdamW) is captured in one CUDA graph and replayed. The text is generated deterministically
(a small grammar, byte-level tokens), so the run needs no download. The last line printed is::

    steps=<n> first_loss=<x> last_loss=<y> graph_breaks=<k> recompiles=<r> tokens_per_s=<t>

Usage: ``python examples/train_tiny_moe.py --steps 30`` (CPU, reference kernels), or
``--device cuda`` (Triton kernels, CUDA graph), ``--recipe mxfp8``, ``--plot losses.png`` (trains the
three recipes and saves their loss curves side by side).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import struct
import sys
import time
import zlib

import torch
import torch.nn.functional as F

import lowp_ops

RECIPES = ("bf16", "mxfp8", "nvfp4")
VOCAB = 256  # bytes
# Expert groups are padded to this many rows on the device (MXFP8 blocks run 32 tokens along a group).
GROUP_ALIGN = 32


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


def batches(data: torch.Tensor, batch: int, seq: int, steps: int, seed: int = 0):
    """``steps`` (inputs, targets) pairs of shape (batch, seq), drawn with a fixed generator."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1].long(), window[:, 1:].long()


# ----------------------------------------------------------------------------------------------- model


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = lowp_ops.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(batch, seq, dim))


class MoELayer(torch.nn.Module):
    """Top-k router + grouped SwiGLU experts. Tokens are sorted by expert on the device; each expert's
    group is padded to ``GROUP_ALIGN`` rows inside a buffer of static size (padding rows carry
    probability 0), so no shape depends on the routing and nothing leaves the device."""

    def __init__(self, dim: int, ffn: int, experts: int, top_k: int, recipe: str):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.mlp = lowp_ops.nn.GroupedSwiGLUMLP(experts, dim, ffn, recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, dim = x.shape
        assignments = tokens * self.top_k
        router_probs = lowp_ops.softmax(self.router(x).float(), dim=-1)
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
    def __init__(self, dim: int, heads: int, ffn: int, experts: int, top_k: int, recipe: str):
        super().__init__()
        self.norm1 = torch.nn.RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.norm2 = torch.nn.RMSNorm(dim)
        self.moe = MoELayer(dim, ffn, experts, top_k, recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        batch, seq, dim = x.shape
        return x + self.moe(self.norm2(x).reshape(-1, dim)).view(batch, seq, dim)


class TinyMoELM(torch.nn.Module):
    def __init__(self, dim=64, heads=4, layers=2, ffn=128, experts=4, top_k=2, recipe="bf16", seq=64):
        super().__init__()
        # Token and position embeddings as one-hot matmuls: deterministic backward on every device.
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, dim) * 0.02)
        self.position = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(
            Block(dim, heads, ffn, experts, top_k, recipe) for _ in range(layers)
        )
        self.norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Parameter(torch.randn(VOCAB, dim, dtype=torch.bfloat16) * 0.02)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.one_hot(inputs, VOCAB).float() @ self.embed + self.position[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        hidden = self.norm(x).to(torch.bfloat16).reshape(-1, x.shape[-1])
        return lowp_ops.linear_cross_entropy(hidden, self.head, targets.reshape(-1), grad_format="mxfp8_e4m3")


# -------------------------------------------------------------------------------------------- training


def dynamo_counts() -> tuple[int, int]:
    """(graph breaks, recompiles) seen by Dynamo since the counters were cleared: one compiled function,
    so every graph after the first is a recompile."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    return breaks, max(counters["stats"]["unique_graphs"] - 1, 0)


class Trainer:
    """One training step = compiled forward + backward + AdamW. On CUDA (``cuda_graph``) the first
    ``warmup`` steps run as is, then the step is captured in a CUDA graph and replayed with each new
    batch copied into its static inputs."""

    def __init__(self, model, device: str, batch: int, seq: int, cuda_graph: bool, warmup: int = 3):
        self.model, self.device = model, device
        self.loss_fn = torch.compile(model.loss, fullgraph=True)
        capturable = device == "cuda"
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, capturable=capturable)
        self.cuda_graph, self.warmup = cuda_graph, warmup
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


def progress(step: int, total: int, loss: float, start: float) -> None:
    width = 30
    filled = width * step // total
    rate = step / max(time.perf_counter() - start, 1e-9)
    bar = "#" * filled + "." * (width - filled)
    print(f"\r[{bar}] {step}/{total} loss {loss:.4f} {rate:.1f} it/s", end="", file=sys.stderr, flush=True)
    if step == total:
        print(file=sys.stderr)


def train(args, recipe: str) -> dict:
    torch.manual_seed(args.seed)
    data = torch.frombuffer(bytearray(tiny_corpus(200_000, args.seed)), dtype=torch.uint8)
    model = TinyMoELM(recipe=recipe, seq=args.seq).to(args.device)
    trainer = Trainer(
        model, args.device, args.batch, args.seq, cuda_graph=args.device == "cuda" and not args.no_cuda_graph
    )
    losses = []
    start = time.perf_counter()
    first_step_done = None
    for step, (inputs, targets) in enumerate(batches(data, args.batch, args.seq, args.steps, args.seed), 1):
        loss = trainer.step(inputs.to(args.device), targets.to(args.device))
        losses.append(loss.item())
        if step == 1:
            first_step_done = time.perf_counter()
        progress(step, args.steps, losses[-1], start)
    elapsed = time.perf_counter() - (first_step_done if args.steps > 1 else start)
    timed_steps = max(args.steps - 1, 1)
    breaks, recompiles = dynamo_counts()
    return {
        "recipe": recipe,
        "losses": losses,
        "graph_breaks": breaks,
        "recompiles": recompiles,
        "tokens_per_s": timed_steps * args.batch * args.seq / elapsed,
    }


# ------------------------------------------------------------------------------------------------ plot


def save_plot(path: str, runs: list[dict]) -> None:
    """Loss curves of the runs side by side: matplotlib when installed, else a plain PNG (curves only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _save_plain_png(path, [run["losses"] for run in runs])
        return
    figure, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3), sharey=True)
    for axis, run in zip(axes if len(runs) > 1 else [axes], runs, strict=True):
        axis.plot(range(1, len(run["losses"]) + 1), run["losses"])
        axis.set_title(f"recipe={run['recipe']}")
        axis.set_xlabel("step")
    (axes[0] if len(runs) > 1 else axes).set_ylabel("loss")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def _save_plain_png(path: str, curves: list[list[float]], width: int = 300, height: int = 200) -> None:
    """A grey-scale PNG with one panel per curve (shared y range), drawn without any plotting library."""
    low = min(min(c) for c in curves)
    high = max(max(c) for c in curves)
    span = (high - low) or 1.0
    canvas = [[255] * (width * len(curves)) for _ in range(height)]
    for panel, curve in enumerate(curves):
        x0 = panel * width
        for y in range(height):
            canvas[y][x0] = 0  # panel border
        points = [
            (x0 + 5 + i * (width - 10) // max(len(curve) - 1, 1), 5 + int((high - v) / span * (height - 10)))
            for i, v in enumerate(curve)
        ]
        for (xa, ya), (xb, yb) in itertools.pairwise(points):
            for t in range(max(abs(xb - xa), abs(yb - ya)) + 1):
                f = t / max(abs(xb - xa), abs(yb - ya), 1)
                canvas[round(ya + f * (yb - ya))][round(xa + f * (xb - xa))] = 0
    raw = b"".join(b"\x00" + bytes(row) for row in canvas)

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        )

    header = struct.pack(">IIBBBBB", width * len(curves), height, 8, 0, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b"")
        )


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--recipe", choices=RECIPES, default="mxfp8")
    parser.add_argument("--plot", default=None, help="PNG path: train all three recipes, plot their losses")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cuda-graph", action="store_true", help="CUDA: run the compiled step eagerly")
    parser.add_argument("--losses", default=None, help="write the per-step losses (JSON) to this path")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")

    recipes = [r for r in RECIPES if r != args.recipe] + [args.recipe] if args.plot else [args.recipe]
    runs = []
    for recipe in recipes:
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        runs.append(train(args, recipe))
        if args.plot:
            losses = runs[-1]["losses"]
            print(f"recipe={recipe} first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f}")
    if args.plot:
        save_plot(args.plot, sorted(runs, key=lambda run: RECIPES.index(run["recipe"])))
    run = runs[-1]
    if args.losses:
        with open(args.losses, "w") as f:
            json.dump({"recipe": run["recipe"], "losses": [float.hex(v) for v in run["losses"]]}, f)
    print(
        f"steps={args.steps} first_loss={run['losses'][0]:.4f} last_loss={run['losses'][-1]:.4f} "
        f"graph_breaks={run['graph_breaks']} recompiles={run['recompiles']} "
        f"tokens_per_s={run['tokens_per_s']:.0f}"
    )
    return run


if __name__ == "__main__":
    main()
