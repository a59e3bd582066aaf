"""Loss per training step of one transformers model under several implementations, fp32 beside bf16.

Where two bf16 implementations end a short run at different losses, this tells a wrong gradient from
rounding that AdamW carries into another trajectory: each variant is the same model, weights, tokens and
optimizer as ``bench_transformers.py`` builds (``--tiny`` for its small configs on the CPU), and

- ``stock``: transformers as installed;
- ``lowp``: ``apply_lowp_ops(model)``; ``lowp-no-rms-norm``: the LM head and loss only;
- ``stock-fp32-head``: transformers' model with the final-logit soft-cap switched off in its forward,
  the cap and the cross entropy then computed in fp32 by PyTorch from its bf16 logits: the math that
  lowp's fused head does, through PyTorch (stock computes the cap in the logits' dtype);
- ``stock-fp32``: transformers' model in fp32 weights and activations: the trajectory of exact math.

A variant whose trajectory departs from the fp32 one no more than another correct bf16 variant does is
rounding, not a wrong result. Prints a table of losses per step and each variant's largest distance from
the fp32 trajectory. Run (H200, Gemma 2 2B shapes): ``python benchmarks/probe_loss_trajectory.py --model
gemma2 --steps 12``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_transformers as bench
import torch
import torch.nn.functional as F

VARIANTS = ("stock-fp32", "stock", "lowp", "lowp-no-rms-norm", "stock-fp32-head")


def build(model_name: str, variant: str, tiny: bool, device: torch.device):
    """The model of ``variant``: bench_transformers' weights, in fp32 for ``stock-fp32``, else bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        bench.MODEL_TYPES[model_name], **(bench.TINY_CONFIGS if tiny else bench.CONFIGS)[model_name]
    )
    dtype = torch.float32 if variant == "stock-fp32" else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=bench.ATTENTION.get(model_name, "sdpa")
        )
    bench.init_weights(model, bench.WEIGHT_SEED)
    if variant.startswith("lowp"):
        bench.apply_lowp(model, model_name, variant)
    return model.train()


def loss_of(model, variant: str, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss; ``stock-fp32-head`` caps and reduces its bf16 logits in fp32."""
    if variant != "stock-fp32-head":
        return model(input_ids=input_ids, labels=labels, use_cache=False).loss
    cap = model.config.final_logit_softcapping
    model.config.final_logit_softcapping = None
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        model.config.final_logit_softcapping = cap
    z = logits[:, :-1].float()
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return F.cross_entropy(z.flatten(0, 1), labels[:, 1:].flatten())


def trajectory(args: argparse.Namespace, variant: str, device: torch.device) -> list[float]:
    """Losses of ``args.steps`` AdamW steps on one fixed batch (bench_transformers' data)."""
    model = build(args.model, variant, args.tiny, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    input_ids, labels = bench.make_batch(model.config.vocab_size, 1, args.seq, device)
    losses = []
    for _ in range(args.steps):
        loss = loss_of(model, variant, input_ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    out = [float(v) for v in torch.stack(losses).cpu()]
    del model, optimizer, losses
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma2", choices=bench.MODELS)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=bench.LEARNING_RATE)
    parser.add_argument("--seq", type=int, default=None, help="tokens (default 4096, tiny 64)")
    parser.add_argument("--tiny", action="store_true", help="bench_transformers' tiny config, any device")
    args = parser.parse_args(argv)
    args.seq = args.seq or (64 if args.tiny else 4096)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{args.model}, {args.seq} tokens, AdamW lr {args.lr}, {args.steps} steps, {device}")
    rows = {}
    for variant in variants:
        start = time.perf_counter()
        rows[variant] = trajectory(args, variant, device)
        print(f"{variant}: {time.perf_counter() - start:.0f} s", flush=True)
    print("\n| step | " + " | ".join(variants) + " |")
    print("|---:|" + "---:|" * len(variants))
    for step in range(args.steps):
        print(f"| {step} | " + " | ".join(f"{rows[v][step]:.4f}" for v in variants) + " |")
    if "stock-fp32" in rows:
        exact = torch.tensor(rows["stock-fp32"])
        for variant in variants:
            gap = (torch.tensor(rows[variant]) - exact).abs() / exact.abs()
            print(f"{variant}: largest relative distance from fp32 {gap.max():.4f} (step {gap.argmax()})")


if __name__ == "__main__":
    main()
