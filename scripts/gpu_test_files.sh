#!/usr/bin/env bash
# The GPU tests of the given test files in six processes, then each of their cudagraph tests in its own
# process; logs $OUT/gpu.log and $OUT/cudagraph.log, a summary on stdout. TEST_TIMEOUT, GRAPH_TIMEOUT.
#   bash scripts/gpu_test_files.sh tests/test_grouped_mlp.py tests/test_dispatch.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "${TEST_TIMEOUT:-240}" python -m pytest -q \
    -m "gpu and not cudagraph" -n 6 -p no:cacheprovider "$@" > "$OUT/gpu.log" 2>&1
tail -n 1 "$OUT/gpu.log"
grep -E "^(FAILED|ERROR) " "$OUT/gpu.log" | head -n 20
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "${GRAPH_TIMEOUT:-100}" bash scripts/cudagraph_each.sh "$@" 2>&1 \
    | tee "$OUT/cudagraph.log" | grep -v "^PASS"
echo "cudagraph PASS: $(grep -c "^PASS" "$OUT/cudagraph.log")"
