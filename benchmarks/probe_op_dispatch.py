"""Probe: host cost of calling a Python-implemented op through the dispatcher, by registration kind.

One op of 10 arguments (3 tensors, scalars, a string, an optional tensor) returning two new tensors,
registered three ways: ``torch.library.custom_op`` with an autograd formula (how lowp_ops registers its
ops), ``torch.library.Library.define`` + a CPU kernel + ``register_autograd``, and ``Library.define``
with a ``CompositeImplicitAutograd`` kernel (no Python autograd layer: a floor). Each is called through
``torch.ops`` on small CPU tensors, next to the implementation called directly.

    python benchmarks/probe_op_dispatch.py
"""

from __future__ import annotations

import time

import torch
from torch.library import Library, custom_op

SCHEMA = (
    "(Tensor x, Tensor w, Tensor t, float a, float b, int c, str d, bool e, int f, Tensor? g)"
    " -> (Tensor, Tensor)"
)


def implementation(x, w, t, a, b, c, d, e, f, g):
    return torch.empty_like(x), torch.empty_like(w)


def backward(ctx, grad_x, grad_w):
    return (grad_x, grad_w) + (None,) * 8


def setup_context(ctx, inputs, output):
    pass


def us_per_call(fn, calls: int = 20000) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    op = custom_op("probe_dispatch::via_custom_op", implementation, mutates_args=(), schema=SCHEMA)
    op.register_fake(implementation)
    op.register_autograd(backward, setup_context=setup_context)
    libraries = []
    for name, kernel_key in (("via_library", "CPU"), ("via_composite", "CompositeImplicitAutograd")):
        lib = Library(f"probe_{name}", "DEF")
        lib.define("op" + SCHEMA)
        lib.impl("op", implementation, kernel_key)
        if kernel_key == "CPU":
            torch.library.register_fake(f"probe_{name}::op", implementation, lib=lib)
            torch.library.register_autograd(
                f"probe_{name}::op", backward, setup_context=setup_context, lib=lib
            )
        libraries.append(lib)
    args = (
        torch.randn(4, 4),
        torch.randn(4),
        torch.zeros(4, dtype=torch.long),
        0.1,
        0.2,
        3,
        "s",
        True,
        5,
        None,
    )
    cases = {
        "the implementation, called directly": lambda: implementation(*args),
        "custom_op + register_autograd": lambda: torch.ops.probe_dispatch.via_custom_op.default(*args),
        "Library.define + CPU kernel + register_autograd": lambda: torch.ops.probe_via_library.op.default(
            *args
        ),
        "Library.define + CompositeImplicitAutograd": lambda: torch.ops.probe_via_composite.op.default(*args),
    }
    for name, fn in cases.items():
        print(f"{name:50s} {us_per_call(fn):6.2f} us")


if __name__ == "__main__":
    main()
