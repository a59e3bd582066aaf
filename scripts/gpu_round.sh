#!/usr/bin/env bash
# One device call after a change to the grouped MLP's recipes and the host paths: the GPU tests of the
# touched files, each cudagraph test of them in its own process, the frozen CUDA-kernel counts, the
# NVFP4 MLP probe and the eager host-overhead table. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
files=(tests/test_nvfp4_decode.py tests/test_grouped_mlp.py tests/test_dispatch.py tests/test_nvfp4.py
    tests/test_softmax.py tests/test_cross_entropy.py tests/test_train_tiny_moe.py)
timeout 300 python -m pytest -q -m "gpu and not cudagraph" -n 6 -p no:cacheprovider "${files[@]}" > "$OUT/gpu.log" 2>&1
tail -n 3 "$OUT/gpu.log"
grep -E "^(FAILED|ERROR) " "$OUT/gpu.log" | head -n 20
timeout 240 bash scripts/cudagraph_each.sh tests/test_grouped_mlp.py tests/test_nvfp4_decode.py 2>&1 | tee "$OUT/cudagraph.log"
python benchmarks/probe_nvfp4_mlp.py > "$OUT/nvfp4_mlp.log" 2>&1
grep -E "host|kernels per" "$OUT/nvfp4_mlp.log"
python benchmarks/bench_host_overhead.py --no-compile --calls 100 > "$OUT/host.log" 2>&1
cat "$OUT/host.log"
python - > "$OUT/kernel_counts.log" 2>&1 <<'PY'
import sys

import torch

sys.path.insert(0, "tests")
from test_dispatch import _launch_cases

cases = _launch_cases("cuda")
for name in ("grouped_swiglu_mlp nvfp4 fwd+bwd", "grouped_swiglu_mlp mxfp8 fwd+bwd", "grouped_swiglu_mlp bf16 fwd+bwd"):
    cases[name]()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cases[name]()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(name, len(kernels))
PY
cat "$OUT/kernel_counts.log"
