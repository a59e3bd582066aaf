#!/usr/bin/env bash
# GPU check of the NVFP4 recipe, the nvfp4 quantizers' host path, the one-pass eligibility and the dGLU:
# their GPU tests (the frozen CUDA-kernel counts included), each cudagraph test of those files in its
# own process, and the NVFP4 host-overhead rows. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
files=(tests/test_dispatch.py tests/test_nvfp4.py tests/test_nvfp4_kernels.py tests/test_nvfp4_decode.py
    tests/test_grouped_mlp.py tests/test_swiglu_kernels.py tests/test_cross_entropy_overwrite.py
    tests/test_cross_entropy_kernels.py)
timeout 360 python -m pytest -q -m "gpu and not cudagraph" -n 6 -p no:cacheprovider "${files[@]}" > "$OUT/gpu.log" 2>&1
tail -n 1 "$OUT/gpu.log"
grep -E "^(FAILED|ERROR) " "$OUT/gpu.log" | head -n 20
timeout 300 bash scripts/cudagraph_each.sh tests/test_nvfp4_decode.py tests/test_cross_entropy_overwrite.py \
    tests/test_swiglu_kernels.py 2>&1 | tee "$OUT/cudagraph.log" | grep -v "^PASS" ; grep -c "^PASS" "$OUT/cudagraph.log"
python benchmarks/bench_host_overhead.py --no-compile --calls 100 --only "nvfp4,mxfp8_quantize" > "$OUT/host.log" 2>&1
cat "$OUT/host.log"
