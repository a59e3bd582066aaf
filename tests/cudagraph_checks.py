"""Helpers of the CUDA-graph tests (``@pytest.mark.cudagraph``), which live in the test file of the op
they capture: manual capture of forward+backward replays bit-identically to eager with new inputs, and
``torch.compile(mode="reduce-overhead")`` never skips cudagraphs.

A failed capture poisons its process (docs/registration.md#cuda-graph-tests): run each test alone
(``scripts/cudagraph_each.sh`` does). Every test is self-contained: its own inputs, warm-up, capture
and eager comparison.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
IGNORE = -100
# The four tensors of an MXFP8 payload (MXFP8Tensor fields).
PAYLOAD_FIELDS = ("row_data", "row_scale", "col_data", "col_scale")


def ce_inputs(seed: int, n_rows: int = 512, n_cols: int = 32000) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA bf16 logits (n_rows, n_cols) with a masked leading block in one row, and int64 targets
    (n_rows,) with every 5th row ignored (-100)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(n_rows, n_cols, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    logits[seed % n_rows, :5000] = NEG_INF
    target = torch.randint(0, n_cols, (n_rows,), generator=gen, device="cuda")
    target[seed % 5 :: 5] = IGNORE
    return logits, target


def warm_up(step, *args, iterations: int = 3) -> None:
    """Run ``step`` on a side stream (compiles the Triton kernels, fills the allocator) before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)


def capture(step, warm_up_iterations: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, static outputs) of ``step()`` captured after ``warm_up_iterations`` calls on a side
    stream (:func:`warm_up`: compiles the kernels, sets up NCCL's communicators)."""
    warm_up(step, iterations=warm_up_iterations)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    return graph, static_out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs compare by their bits)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    )
