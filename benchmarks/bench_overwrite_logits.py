"""``cross_entropy(..., overwrite_logits=True)`` next to the default path on the GPU: forward+backward
time (CUDA-graph replays, rotating logits copies) as a ratio to a same-run copy at each form's byte floor,
and the peak memory the call allocates above the logits (the default path allocates the N x V gradient).

Rows: the default path (forward, then the backward's gradient: floor 6 B/element); the overwrite path
(one read of the logits where the single pass applies: floor 4 B/element, else 6); and the in-place
kernels alone: the single pass in one launch, in its two-launch form (statistics, then gradient: 6 B),
and the two-pass form it replaces (``cross_entropy_fwd`` then ``cross_entropy_bwd_``: 6 B).
Run: ``PYTHONPATH=. python3 benchmarks/bench_overwrite_logits.py [N V]``.
"""

from __future__ import annotations

import sys

import torch
from _common import copy_bandwidth_tbs, graph_ms, rotating

import lowp_ops
from lowp_ops.kernels import cross_entropy as ce_kernels
from lowp_ops.kernels import cross_entropy_single_pass as single_pass


def main() -> None:
    n_rows, vocab = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (4096, 129280)
    torch.manual_seed(0)
    base = (torch.randn(n_rows, vocab, device="cuda") * 3).bfloat16()
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    _, copy_tbs = copy_bandwidth_tbs()
    leaves = [base.clone().requires_grad_() for _ in range(3)]
    plain = [base.clone() for _ in range(3)]
    grad_rows = torch.full((n_rows,), 1.0 / n_rows, device="cuda")
    one_pass = single_pass.single_pass_chunks(base) > 0
    print(f"{n_rows}x{vocab} bf16, copy {copy_tbs:.3f} TB/s; single pass applies: {one_pass}")

    def default(x):
        return torch.autograd.grad(lowp_ops.cross_entropy(x, target), x)

    def overwrite(x):
        # a view is the non-leaf; after the in-place write autograd hands its gradient to the base
        return torch.autograd.grad(lowp_ops.cross_entropy(x.view_as(x), target, overwrite_logits=True), x)

    def single_pass_fused(x):
        single_pass.launch_cross_entropy_fwd_grad_single_pass(x, target, grad_rows, 0.0, -100, fused=True)

    def single_pass_two_launches(x):
        single_pass.launch_cross_entropy_fwd_grad_single_pass(x, target, grad_rows, 0.0, -100, fused=False)

    def two_pass(x):
        _, stats = ce_kernels.launch_cross_entropy_fwd(x, target, 0.0, -100)
        ce_kernels.launch_cross_entropy_bwd_(x, target, stats, grad_rows, 0.0, -100)

    cases = [
        ("default fwd+bwd", default, leaves, 6, True),
        ("overwrite_logits=True fwd+bwd", overwrite, leaves, 4 if one_pass else 6, True),
        ("kernels: single pass, one launch", single_pass_fused, plain, 4, one_pass),
        ("kernels: single pass, two launches", single_pass_two_launches, plain, 6, one_pass),
        ("kernels: forward then cross_entropy_bwd_", two_pass, plain, 6, True),
    ]
    for name, fn, buffers, floor, runs in cases:
        if not runs:
            continue
        ms = graph_ms(rotating(buffers, fn))
        x = base.clone().requires_grad_(buffers is leaves)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(x)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        pct = 100 * floor * n_rows * vocab / ms / 1e9 / copy_tbs
        print(f"{name}: {ms:.4f} ms (graph), {pct:.1f}% of copy at {floor} B/element;"
              f" peak above the logits {peak:.3f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
