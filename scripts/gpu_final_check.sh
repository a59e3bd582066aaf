#!/usr/bin/env bash
# One device call after a change to launchers or kernels: the GPU tests of the given test files and each
# of their cudagraph tests in its own process (scripts/gpu_test_files.sh), then the host-overhead table
# (with the peers' losses; HOST_ARGS: its flags, default the whole table). Logs under $OUT.
#   bash scripts/gpu_final_check.sh tests/test_mxfp8_kernels.py tests/test_nvfp4_kernels.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/peer_wheels.sh
OUT="$OUT" bash scripts/gpu_test_files.sh "$@"
# shellcheck disable=SC2086
timeout "${HOST_TIMEOUT:-210}" python benchmarks/bench_host_overhead.py ${HOST_ARGS:---calls 100} > "$OUT/host.log" 2>&1
cat "$OUT/host.log"
