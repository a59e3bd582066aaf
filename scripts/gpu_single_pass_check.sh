#!/usr/bin/env bash
# GPU check of the cross entropy's one-pass kernels (gradient written over the logits) in one device
# call: their GPU tests and those of the callers (overwrite_logits, the LM head's chunk step), the
# CUDA-graph replays (each in its own process), then the benchmarks. Logs in $OUT (a temporary
# directory if unset). QUICK=1: the one-pass tests and the probe only.
#
#   bash scripts/gpu_single_pass_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
tests=(tests/test_cross_entropy_overwrite.py)
[ "${QUICK:-0}" = 1 ] || tests+=(tests/test_cross_entropy_kernels.py tests/test_linear_cross_entropy.py
    tests/test_linear_cross_entropy_kernels.py tests/test_vocab_parallel.py tests/test_dispatch.py
    tests/test_cross_entropy.py tests/test_cross_entropy_features_kernels.py tests/test_large_magnitudes.py)
timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -m "gpu and not cudagraph" -n 6 -p no:cacheprovider \
    "${tests[@]}" > "$OUT/gpu_tests.log" 2>&1
echo "== gpu tests exit $?"; grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -1; grep -E "^FAILED" "$OUT/gpu_tests.log" | head
if [ "${QUICK:-0}" != 1 ]; then
    CUDAGRAPH_LOG="$OUT/cudagraph.log" bash scripts/cudagraph_each.sh tests/test_cross_entropy_overwrite.py
fi
timeout "${PROBE_SECONDS:-120}" python3 benchmarks/probe_single_pass.py --lm-head "" \
    --shapes "${SHAPES:-8192x32768,8192x32000,8192x24584,8192x16400,4096x129280}" 2>&1 | grep -v Warn | tee "$OUT/probe.log"
[ "${QUICK:-0}" = 1 ] && exit 0
timeout 90 python3 benchmarks/bench_overwrite_logits.py ${OVERWRITE_SHAPE:-8192 32000} 2>&1 | grep -v Warn | tee "$OUT/overwrite.log"
timeout 120 python3 benchmarks/probe_single_pass.py --shapes 8192x8000 --lm-head "${LM_HEAD:-16384,4096,32768}" 2>&1 \
    | grep -v Warn | tee "$OUT/lm_head.log"
