#!/usr/bin/env bash
# One device call after a change to launchers or kernels: the GPU tests of the given test files, the
# host-overhead table (with the peers' losses; HOST_ARGS: its flags, default the whole table), then each
# cudagraph test of those files in its own process. Logs under $OUT.
#   bash scripts/gpu_final_check.sh tests/test_mxfp8_kernels.py tests/test_nvfp4_kernels.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/peer_wheels.sh
files=("$@")
timeout "${TEST_TIMEOUT:-240}" python -m pytest -q -m "gpu and not cudagraph" -n 6 -p no:cacheprovider "${files[@]}" > "$OUT/gpu.log" 2>&1
tail -n 1 "$OUT/gpu.log"
grep -E "^(FAILED|ERROR) " "$OUT/gpu.log" | head -n 20
# shellcheck disable=SC2086
timeout "${HOST_TIMEOUT:-210}" python benchmarks/bench_host_overhead.py ${HOST_ARGS:---calls 100} > "$OUT/host.log" 2>&1
cat "$OUT/host.log"
timeout "${GRAPH_TIMEOUT:-100}" bash scripts/cudagraph_each.sh "${files[@]}" 2>&1 | tee "$OUT/cudagraph.log" | grep -v "^PASS"
grep -c "^PASS" "$OUT/cudagraph.log"
