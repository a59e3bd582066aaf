"""Whether two trees of lowp_ops give the same bytes on one device.

For changes that should not alter any result (refactors, launch options that equal Triton's defaults):
the calls of ``public_calls.py`` (every kernel family, forward and backward) run once with each tree's
``lowp_ops``, each in its own process, and every output and gradient is compared bit for bit. On a GPU
this checks what ``compare_ptx.py`` can only predict on the CPU; with ``--device cpu`` it runs the
references (or, under ``TRITON_INTERPRET=1 LOWP_OPS_CPU_KERNELS=triton``, the kernels in the
interpreter).

    git archive <rev> lowp_ops | tar -x -C <old>
    python scripts/compare_bytes.py <old> [<new>, default this repository] [--device cuda]

Prints one line per tensor that differs and a count; exits 1 if any differs or exists in one tree only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def record(device: str, out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from public_calls import run_public_calls

    torch.save(run_public_calls(device), out)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous(), b.contiguous()
    return a.numel() == 0 or torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="a directory holding the old tree's lowp_ops/")
    parser.add_argument("new", type=Path, nargs="?", default=ROOT)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record is not None:
        record(args.device, args.record)
        return 0
    work = Path(tempfile.mkdtemp())
    results = {}
    for side, tree in (("old", args.old), ("new", args.new)):
        out = work / f"{side}.pt"
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
        command = [sys.executable, "-P", __file__, str(args.old), "--device", args.device]
        command += ["--record", str(out)]
        subprocess.run(command, env=env, check=True)
        results[side] = torch.load(out)
    old, new = results["old"], results["new"]
    differ = 0
    for name in sorted(old.keys() | new.keys()):
        if name not in old or name not in new:
            print(f"in one tree only  {name}")
            differ += 1
        elif not same_bytes(old[name], new[name]):
            print(f"DIFFERENT         {name}")
            differ += 1
    total = len(old.keys() | new.keys())
    print(f"{total - differ} of {total} tensors: the same bytes on {args.device} ({work})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
