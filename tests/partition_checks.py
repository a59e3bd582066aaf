"""What the forward graph saves for the backward when Dynamo traces a function and Inductor's min-cut
partitioner splits the joint graph (no Inductor code generation: the graphs run as traced), and which
``lowp::`` ops the forward and backward graphs call."""

from __future__ import annotations

import torch


def shapes_saved_by_compiled_forward(fn, *args) -> list[tuple[int, ...]]:
    """Compile ``fn`` (fullgraph), run ``fn(*args).float().sum().backward()`` and return the shapes of the
    tensors the partitioned forward graph hands to the backward."""
    return [tuple(value.shape) for value in values_saved_by_compiled_forward(fn, *args)]


def bytes_saved_by_compiled_forward(fn, *args) -> list[int]:
    """The sizes in bytes of those tensors, smallest first."""
    return sorted(v.numel() * v.element_size() for v in values_saved_by_compiled_forward(fn, *args))


def values_saved_by_compiled_forward(fn, *args) -> list[torch.Tensor]:
    """The fake values (shape, dtype) of the tensors the partitioned forward graph hands to the backward."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    forward_graphs = []

    def keep_forward(graph_module, _):
        forward_graphs.append(graph_module)
        return graph_module.forward

    backend = aot_autograd(
        fw_compiler=keep_forward,
        bw_compiler=lambda graph_module, _: graph_module.forward,
        partition_fn=min_cut_rematerialization_partition,
    )
    torch.compile(fn, backend=backend, fullgraph=True)(*args).float().sum().backward()
    (output,) = [node for node in forward_graphs[0].graph.nodes if node.op == "output"]
    return [node.meta["val"] for node in output.args[0][1:] if "val" in node.meta]


def lowp_ops_in_compiled_graphs(fn) -> tuple[object, list[list[str]]]:
    """``(compiled, graphs)``: ``fn`` compiled (fullgraph, the graphs run as traced) and a list that each
    run fills with the ``lowp::`` ops of its forward graph, then of its backward graph, in call order."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def keep(graph_module, _):
        graphs.append([str(n.target) for n in graph_module.graph.nodes if "lowp" in str(n.target)])
        return make_boxed_func(graph_module.forward)

    def backend(graph_module, example_inputs):
        return aot_module_simplified(graph_module, example_inputs, fw_compiler=keep, bw_compiler=keep)

    return torch.compile(fn, backend=backend, fullgraph=True), graphs
