"""Whether two trees of lowp_ops compile to the same sm_90 instructions, without a GPU.

For changes that should not alter what runs on the GPU (refactors, interpreter-only branches): the
Triton launches of a set of small public calls are recorded under the Triton interpreter on the CPU
(each kernel's argument types, constexprs and launch options), then every recorded specialization is
compiled for sm_90 by the local Triton and ptxas once against each tree, and the two PTX texts are
compared with their debug information (line numbers, inlining records) removed. The MXFP8 Gluon
backward, which the interpreter does not run, is compiled from a fixed signature; the one-pass Gluon
kernels need Triton 3.6's Gluon API and are not compiled. A kernel's specializations here are those
of the recorded calls' small shapes, not every one a GPU run would compile; an equal result says the
two trees emit the same code for those, not that a GPU test would pass.

    git archive <rev> lowp_ops | tar -x -C <old>
    python scripts/compare_ptx.py <old> [<new>, default this repository]

Prints one line per kernel specialization and exits 1 if any differs or fails to compile in one tree
only.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DTYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
_DEBUG_LINE = re.compile(r"^\s*(\.loc|\.file|\.section|\.b8|\.b16|\.b32|\.b64|//|\$L__)|debug|info_string")


def record_calls() -> dict:
    """Under TRITON_INTERPRET=1: {key: kernel module, name, argument types, constexprs} of each distinct
    specialization the calls of ``public_calls.py`` launch."""
    from lowp_ops.kernels import launch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from public_calls import run_public_calls

    records: dict = {}
    launch_for_real = launch.CachedLaunch.launch

    def recording(self, grid, args, meta, bound=None):
        function = self.jit_function.fn
        types = [_argument_type(value) for value in args]
        constants = {name: _constant(value) for name, value in meta.items()}
        key = f"{function.__module__}.{function.__name__}|{json.dumps(constants, sort_keys=True)}|{types}"
        records.setdefault(
            key, {"module": function.__module__, "name": function.__name__, "types": types, "meta": constants}
        )
        return launch_for_real(self, grid, args, meta, bound)

    launch.CachedLaunch.launch = recording
    try:
        run_public_calls("cpu")
    finally:
        launch.CachedLaunch.launch = launch_for_real
    return records


def _argument_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "none"
    raise TypeError(f"no signature type for {type(value).__name__}")


def _constant(value):
    value = getattr(value, "value", value)
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    return "triton:" + str(value)  # a Triton dtype constexpr, e.g. fp8e4nv


def compile_records(records: dict, out: Path) -> None:
    """Compile each record with the lowp_ops on sys.path for sm_90; one PTX file per record in ``out``
    (or a ``.error`` file)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out.mkdir(parents=True, exist_ok=True)
    target = GPUTarget("cuda", 90, 32)
    for key, record in records.items():
        kernel = getattr(importlib.import_module(record["module"]), record["name"])
        function = getattr(kernel, "jit_function", kernel)
        names = [p.name for p in function.params]
        signature, constants = {}, {}
        for index, name in enumerate(names):
            if index < len(record["types"]) and record["types"][index] != "none":
                signature[name] = record["types"][index]
                continue
            value = record["meta"].get(name, function.params[index].default)
            if isinstance(value, str) and value.startswith("triton:"):
                value = tl.str_to_ty(value.removeprefix("triton:"), None)
            signature[name], constants[(index,)] = "constexpr", value
        options = {k: v for k, v in record["meta"].items() if k in _OPTIONS}
        stem = out / f"{record['name']}-{hashlib.md5(key.encode()).hexdigest()[:8]}"
        try:
            source = ASTSource(function, signature, constants)
            compiled = triton.compile(source, target=target, options=options)
            stem.with_suffix(".ptx").write_text(compiled.asm["ptx"])
        except Exception as error:  # reported per kernel, compared across the trees
            stem.with_suffix(".error").write_text(f"{type(error).__name__}: {error}")
    _compile_gluon_mxfp8_backward(out, target)


def _compile_gluon_mxfp8_backward(out: Path, target) -> None:
    """The Gluon MXFP8 backward (CUDA only, not recorded on the CPU) at E4M3 row + col, compact scales,
    16-byte aligned rows and rows realigned from an odd stride."""
    import triton
    import triton.language as tl
    from triton.experimental.gluon._runtime import GluonASTSource

    from lowp_ops.kernels import cross_entropy_gluon

    kernel = cross_entropy_gluon.cross_entropy_bwd_mxfp8_gluon_kernel
    if kernel is None:
        return
    function = getattr(kernel, "jit_function", kernel)
    names = [p.name for p in function.params]
    pointers = {"logits_ptr": "*bf16", "target_ptr": "*i64", "row_scale_ptr": "*u8", "col_scale_ptr": "*u8"}
    pointers |= {"row_data_ptr": "*fp8e4nv", "col_data_ptr": "*fp8e4nv"}
    floats = {"smoothing_eps", "target_weight"}
    for load_mod in (-1, 3):
        constants = dict(HAS_SMOOTHING=True, EVEN=True, HAS_WEIGHT=False, FP8_MAX=448.0, MAX_RCP=1.0 / 448.0)
        constants |= dict(OUT_DTYPE=tl.float8e4nv, ROWWISE=True, COLWISE=True, SWIZZLED=False)
        constants["LOAD_MOD"] = load_mod
        signature = {
            n: "constexpr"
            if n in constants
            else pointers.get(n, "*fp32" if n.endswith("_ptr") else "fp32" if n in floats else "i32")
            for n in names
        }
        source = GluonASTSource(function, signature, {(names.index(n),): v for n, v in constants.items()})
        stem = out / f"cross_entropy_bwd_mxfp8_gluon_kernel-load_mod{load_mod}"
        try:
            options = {"num_warps": 2}
            if getattr(kernel, "fp_fusion", None) is not None:  # as its launches compile it
                options["enable_fp_fusion"] = kernel.fp_fusion
            compiled = triton.compile(source, target=target, options=options)
            stem.with_suffix(".ptx").write_text(compiled.asm["ptx"])
        except Exception as error:
            stem.with_suffix(".error").write_text(f"{type(error).__name__}: {error}")


def instructions(ptx: str) -> list[str]:
    """The PTX without its debug information and comments."""
    lines = (re.sub(r"\s*//.*$", "", line) for line in ptx.splitlines() if not _DEBUG_LINE.search(line))
    return [line for line in lines if line.strip()]


def run_step(tree: Path, *args: str, interpret: bool = False) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env |= {"TRITON_INTERPRET": "1", "LOWP_OPS_CPU_KERNELS": "triton"}
    subprocess.run([sys.executable, "-P", __file__, *args], env=env, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="a directory holding the old tree's lowp_ops/")
    parser.add_argument("new", type=Path, nargs="?", default=ROOT)
    parser.add_argument("--step", choices=("record", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--records", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "record":
        args.records.write_text(json.dumps(record_calls(), indent=1))
        return 0
    if args.step == "compile":
        compile_records(json.loads(args.records.read_text()), args.out)
        return 0
    work = Path(tempfile.mkdtemp())
    records = work / "records.json"
    run_step(args.new.resolve(), str(args.old), "--step", "record", "--records", str(records), interpret=True)
    for side, tree in (("old", args.old), ("new", args.new)):
        out = work / side
        step = ("--step", "compile", "--records", str(records), "--out", str(out))
        run_step(tree.resolve(), str(args.old), *step)
    differ = 0
    for old_file in sorted((work / "old").iterdir()):
        new_file = work / "new" / old_file.name
        if old_file.suffix == ".error" or not new_file.exists():
            same = new_file.exists() and old_file.read_text() == new_file.read_text()
            verdict = "same error" if same else "error in one tree"
        else:
            same = instructions(old_file.read_text()) == instructions(new_file.read_text())
            verdict = "same" if same else "DIFFERENT"
        differ += not same
        print(f"{verdict:18s} {old_file.stem}")
    count = len(list((work / "old").iterdir()))
    print(f"{count - differ} of {count} kernel specializations: the same sm_90 instructions ({work})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
