"""``cross_entropy(..., overwrite_logits=True)`` next to the default path on the GPU: forward+backward
time (CUDA-graph replays, rotating logits copies; byte floor 6 B/element as a ratio to a same-run copy)
and the peak memory the call allocates above the logits (the default path allocates the N x V gradient).
Run: ``PYTHONPATH=. python3 benchmarks/bench_overwrite_logits.py [N V]``.
"""

from __future__ import annotations

import torch
from _common import copy_bandwidth_tbs, gpu_script_args, graph_ms, rotating

import lowp_ops


def main() -> None:
    def shape(parser):
        parser.add_argument("n_rows", type=int, nargs="?", default=4096, help="rows N (default 4096)")
        parser.add_argument("vocab", type=int, nargs="?", default=129280, help="classes V (default 129280)")

    args = gpu_script_args(__doc__, shape)
    n_rows, vocab = args.n_rows, args.vocab
    torch.manual_seed(0)
    base = (torch.randn(n_rows, vocab, device="cuda") * 3).bfloat16()
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    _, copy_tbs = copy_bandwidth_tbs()
    leaves = [base.clone().requires_grad_() for _ in range(3)]

    def default(x):
        return torch.autograd.grad(lowp_ops.cross_entropy(x, target), x)

    def overwrite(x):
        # a view is the non-leaf; after the in-place write autograd hands its gradient to the base
        return torch.autograd.grad(lowp_ops.cross_entropy(x.view_as(x), target, overwrite_logits=True), x)

    for name, fn in (("default", default), ("overwrite_logits=True", overwrite)):
        ms = graph_ms(rotating(leaves, fn))
        x = base.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(x)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        pct = 100 * 6 * n_rows * vocab / ms / 1e9 / copy_tbs
        print(f"{n_rows}x{vocab} cross_entropy fwd+bwd, {name}: {ms:.4f} ms (graph), {pct:.1f}% of copy"
              f" ({copy_tbs:.3f} TB/s); peak above the logits {peak:.3f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
