"""Whether the installed Triton's Gluon lowers data exchange between the CTAs of a thread-block cluster.

A one-pass cross entropy over rows wider than one SM's shared memory (docs/cross_entropy.md, "The gradient
over the logits") needs the parts of a row, held by several programs, to exchange their statistics; the
parts kernel does it through global memory. A cluster of CTAs could do it through distributed shared
memory (``mapa`` / ``ld.shared::cluster`` and cluster barriers), which Gluon reaches through layouts whose
``cga_layout`` spreads a tensor over the cluster's CTAs. This compiles two minimal kernels for sm_90
(no GPU needed: ``triton.compile`` with a ``GPUTarget``), each on a ``[4, PART]`` tile, one row part per
CTA of a 4-CTA cluster:

- ``reduce``: ``gl.max`` over the axis spread across the CTAs (one reduction across the cluster);
- ``gather``: each CTA's part maximum (a reduction within the CTA), then ``gl.convert_layout`` to a
  layout every CTA holds whole (the exchange alone), then the maximum of the four.

It prints, per kernel, whether it compiled and how many cluster instructions the PTX holds, or the
compiler's error. Run: ``python benchmarks/probe_gluon_clusters.py`` (any machine with Triton and Gluon).
"""

from __future__ import annotations

import argparse

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

CTAS = 4


@gluon.jit
def cluster_reduce_kernel(x_ptr, out_ptr, PART: gl.constexpr, TILE: gl.constexpr):
    rows = gl.arange(0, 4, layout=gl.SliceLayout(1, TILE))
    cols = gl.arange(0, PART, layout=gl.SliceLayout(0, TILE))
    offsets = gl.program_id(0) * 4 * PART + rows[:, None] * PART + cols[None, :]
    x = gl.load(x_ptr + offsets).to(gl.float32)
    m = gl.max(gl.max(x, axis=1), axis=0)  # the second maximum runs across the cluster's CTAs
    gl.store(out_ptr + offsets, (x - m).to(gl.bfloat16))


@gluon.jit
def cluster_gather_kernel(x_ptr, out_ptr, PART: gl.constexpr, TILE: gl.constexpr, WHOLE: gl.constexpr):
    rows = gl.arange(0, 4, layout=gl.SliceLayout(1, TILE))
    cols = gl.arange(0, PART, layout=gl.SliceLayout(0, TILE))
    offsets = gl.program_id(0) * 4 * PART + rows[:, None] * PART + cols[None, :]
    x = gl.load(x_ptr + offsets).to(gl.float32)
    part_max = gl.max(x, axis=1)  # one value per CTA
    every_part = gl.convert_layout(part_max, WHOLE)  # each CTA gets all four
    m = gl.max(every_part, axis=0)
    gl.store(out_ptr + offsets, (x - m).to(gl.bfloat16))


def compile_for_sm90(kernel, constants: dict) -> str:
    """PTX of ``kernel`` at 4 warps and a 4-CTA cluster, or raises the compiler's error."""
    names = ["x_ptr", "out_ptr", *constants]
    signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", **dict.fromkeys(constants, "constexpr")}
    values = {(names.index(name),): value for name, value in constants.items()}
    source = GluonASTSource(kernel, signature, values)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": CTAS}
    )
    return compiled.asm["ptx"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=int, default=4096, help="columns of a CTA's part")
    args = parser.parse_args()
    # Rows of the tile spread over the cluster's CTAs (the CGA bases [[1, 0], [2, 0]]), 8 columns a thread.
    tile = gl.BlockedLayout([1, 8], [1, 32], [1, 4], [1, 0], [[1, 0], [2, 0]])
    whole = gl.BlockedLayout([4], [32], [4], [0], [[0], [0]])  # every CTA holds the whole tensor
    print(f"triton {triton.__version__}, sm_90, {CTAS}-CTA cluster, parts of {args.part} columns")
    cases = {
        "reduce across CTAs": (cluster_reduce_kernel, {"PART": args.part, "TILE": tile}),
        "gather across CTAs": (cluster_gather_kernel, {"PART": args.part, "TILE": tile, "WHOLE": whole}),
    }
    for name, (kernel, constants) in cases.items():
        try:
            ptx = compile_for_sm90(kernel, constants)
        except Exception as error:  # the compiler's verdict is the probe's result
            lines = [line for line in str(error).splitlines() if line.strip()]
            print(f"{name}: does not compile: {type(error).__name__}: {lines[-1] if lines else ''}")
            continue
        counts = {op: ptx.count(op) for op in ("mapa", "shared::cluster", "barrier.cluster")}
        print(f"{name}: compiles; PTX " + ", ".join(f"{op} x{n}" for op, n in counts.items()))


if __name__ == "__main__":
    main()
