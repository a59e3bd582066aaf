#!/usr/bin/env bash
# GPU check of the MXFP8 and cross-entropy kernels in one device call: their GPU tests, then the
# benchmarks that measure them (rows that are not 16-byte aligned, the MXFP8 quantizer, host time).
# Logs in $OUT (a temporary directory if unset). QUICK=1: the fused-backward tests and the unaligned
# cross-entropy figures only.
#
#   bash scripts/gpu_mxfp8_ce_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
tests=(tests/test_cross_entropy_kernels.py tests/test_mxfp8_kernels.py tests/test_dispatch.py)
select=()
if [ "${QUICK:-0}" = 1 ]; then
    select=(-k "mxfp8 or gluon or realigned or launcher or kernel_count")
else
    tests+=(tests/test_mxfp8.py tests/test_cross_entropy.py tests/test_linear_cross_entropy_kernels.py tests/test_mxfp8_gemm.py)
fi
timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -m "gpu and not cudagraph" -n 12 -p no:cacheprovider \
    "${tests[@]}" "${select[@]}" > "$OUT/gpu_tests.log" 2>&1
echo "== gpu tests exit $?"; grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2; grep -E "^FAILED" "$OUT/gpu_tests.log" | head
timeout 90 python3 benchmarks/bench_cross_entropy.py --shapes 8192x50257 > "$OUT/bench_ce.log" 2>&1
echo "== bench_cross_entropy exit $?"; grep -E "^\| 8192|copy" "$OUT/bench_ce.log"
timeout 60 python3 benchmarks/probe_unaligned_rows.py --shapes 8192x50257,4096x129280 2>&1 | grep -v Warn | tee "$OUT/probe.log"
timeout 60 python3 benchmarks/probe_mxfp8_call_parts.py --shapes 8192x50257 2>&1 | grep -v Warn | tee "$OUT/call_parts.log"
[ "${QUICK:-0}" = 1 ] && exit 0
timeout 100 python3 benchmarks/bench_mxfp8.py --no-sweep --no-compile 2>&1 | grep -E "^\|" | tee "$OUT/bench_mxfp8.log"
timeout 100 python3 benchmarks/bench_host_overhead.py --no-compile --calls 100 \
    --only "cross_entropy,mxfp8_quantize,mxfp8_dequantize" 2>&1 | grep -v Warn | tee "$OUT/host.log"
