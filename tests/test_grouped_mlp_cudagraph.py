"""CUDA graph: manual capture of the grouped SwiGLU MLP's forward+backward replays bit-identically to
eager when the tokens, probabilities and split sizes change (split sizes are data: never read on the host).

A failed capture poisons its process: run each test in its own process (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import pytest
import torch

import lowp_ops

EXPERTS, HIDDEN, FFN, TOKENS = 8, 512, 256, 2048


def step_inputs(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cuts = torch.sort(torch.randint(0, TOKENS // 32 + 1, (EXPERTS - 1,), generator=gen, device="cuda")).values
    bounds = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), TOKENS // 32)]) * 32
    split_sizes = bounds.diff()  # multiples of 32, some experts empty
    x = (torch.randn(TOKENS, HIDDEN, generator=gen, device="cuda") * 0.5).bfloat16()
    probs = torch.rand(TOKENS, generator=gen, device="cuda")
    dy = (torch.randn(TOKENS, HIDDEN, generator=gen, device="cuda") * 0.1).bfloat16()
    return x, split_sizes, probs, dy


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


@pytest.mark.cudagraph
@pytest.mark.parametrize("recipe", ["bf16"])
def test_manual_capture_of_grouped_mlp_forward_backward_replays_like_eager(recipe):
    torch.manual_seed(0)
    mlp = lowp_ops.nn.GroupedSwiGLUMLP(EXPERTS, HIDDEN, FFN, recipe=recipe, device="cuda")
    static_x, static_splits, static_probs, static_dy = step_inputs(0)
    static_x.requires_grad_()
    static_probs.requires_grad_()

    def step():
        y = mlp(static_x, static_splits, static_probs)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    mlp.zero_grad(set_to_none=True)
    static_x.grad = static_probs.grad = None
    with torch.cuda.graph(graph):
        static_y = step()

    for seed in (1, 2, 3):
        x, split_sizes, probs, dy = step_inputs(seed)
        with torch.no_grad():
            for static, new in (
                (static_x, x),
                (static_splits, split_sizes),
                (static_probs, probs),
                (static_dy, dy),
            ):
                static.copy_(new)
        graph.replay()
        captured = [static_y, static_x.grad, static_probs.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]
        captured = [t.detach().clone() for t in captured]
        eager_x, eager_probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
        fc1_grad, fc2_grad = mlp.fc1_weight.grad, mlp.fc2_weight.grad
        mlp.fc1_weight.grad = mlp.fc2_weight.grad = None
        eager_y = mlp(eager_x, split_sizes, eager_probs)
        eager_y.backward(dy)
        eager = [eager_y.detach(), eager_x.grad, eager_probs.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]
        mlp.fc1_weight.grad, mlp.fc2_weight.grad = fc1_grad, fc2_grad  # the graph's static buffers
        torch.cuda.synchronize()
        for name, got, want in zip(("y", "dx", "dprobs", "dW1", "dW2"), captured, eager, strict=True):
            assert same_bits(got, want), f"{name} differs at replay {seed}"
