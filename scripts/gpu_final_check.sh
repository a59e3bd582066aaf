#!/usr/bin/env bash
# GPU check of the kernels that share `expert_of_rows` (the dGLU, the NVFP4 scale kernel) and the whole
# host-overhead table with the peers' losses: their GPU tests, `bench_host_overhead.py` (eager and
# compiled), then each cudagraph test of those files in its own process. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/peer_wheels.sh
files=(tests/test_swiglu_kernels.py tests/test_nvfp4_decode.py tests/test_grouped_mlp.py)
timeout 240 python -m pytest -q -m "gpu and not cudagraph" -n 6 -p no:cacheprovider "${files[@]}" > "$OUT/gpu.log" 2>&1
tail -n 1 "$OUT/gpu.log"
grep -E "^(FAILED|ERROR) " "$OUT/gpu.log" | head -n 20
timeout 210 python benchmarks/bench_host_overhead.py --calls 100 > "$OUT/host.log" 2>&1
cat "$OUT/host.log"
timeout 100 bash scripts/cudagraph_each.sh "${files[@]}" 2>&1 | tee "$OUT/cudagraph.log" | grep -v "^PASS"
grep -c "^PASS" "$OUT/cudagraph.log"
