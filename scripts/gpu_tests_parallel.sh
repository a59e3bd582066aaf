#!/usr/bin/env bash
# The whole GPU suite: every `-m "gpu and not cudagraph"` test spread over GPU_WORKERS (default 12)
# pytest-xdist workers, test by test (compiles are CPU-bound, the tests small for an H200's memory), then
# every cudagraph test in its own process, CUDAGRAPH_JOBS (default 6) at a time. Arguments (test files,
# or the older "name=file,file" groups) limit both stages to those files. $OUT (or a temporary
# directory) gets, as each stage ends: summary.log (the suite's last line, then one PASS/SKIP/FAIL line
# per cudagraph test), gpu_failures.log (failing tests and their assertion lines), gpu.log (the whole
# output, one line per test), gpu_not_run.log (when the time bound cut the first stage off: the tests
# it did not run) and cudagraph_output.log. GPU_TEST_SECONDS (default 420) bounds the first stage. Until
# 2026-12-04 the suite ran as five processes of whole files, which outgrew one 600 s device call.
# Exits nonzero if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
raw="$(mktemp -d)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
files=()
for spec in "$@"; do
    IFS=, read -ra listed <<< "${spec#*=}"
    files+=("${listed[@]}")
done
[ ${#files[@]} -eq 0 ] && files=(tests)
# worksteal rebalances the long tests that land on one worker (pytest-xdist >= 3.2).
dist=load
python3 -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" 2>/dev/null \
    && dist=worksteal
# -v: one line per test as it ends, so that a run cut off by the time bound names the tests it did not run.
TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" timeout "${GPU_TEST_SECONDS:-420}" python3 -m pytest -v \
    -m "gpu and not cudagraph" -n "${GPU_WORKERS:-12}" --dist "$dist" -p no:cacheprovider "${files[@]}" \
    > "$OUT/gpu.log" 2>&1
status=$?
echo "gpu: exit $status, $(tail -n 1 "$OUT/gpu.log")" | tee -a "$OUT/summary.log"
if [ "$status" -eq 124 ]; then
    # Collected but never reported: what the time bound cut off (gpu_not_run.log).
    python3 -m pytest --collect-only -q -m "gpu and not cudagraph" -p no:cacheprovider "${files[@]}" \
        2>/dev/null | grep "::" | sort > "$raw/collected"
    # pytest-xdist's -v lines: "[gw3] [ 42%] PASSED tests/test_x.py::test_y[a, b]" (ids may hold spaces).
    sed -nE 's/^\[gw[0-9]+\] \[ *[0-9]+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (.*[^ ]) *$/\2/p' \
        "$OUT/gpu.log" | sort -u > "$raw/reported"
    comm -23 "$raw/collected" "$raw/reported" > "$OUT/gpu_not_run.log"
    echo "gpu: $(wc -l < "$OUT/gpu_not_run.log") of $(wc -l < "$raw/collected") tests not run (gpu_not_run.log)" \
        | tee -a "$OUT/summary.log"
fi
failed=0
[ "$status" -ne 0 ] && [ "$status" -ne 5 ] && failed=1
grep -E "^(FAILED|ERROR)|^E   | (FAILED|ERROR) tests/" "$OUT/gpu.log" > "$OUT/gpu_failures.log"
# Each cudagraph test in its own process.
mapfile -t ids < <(python3 -m pytest --collect-only -q -m cudagraph "${files[@]}" 2>/dev/null | grep "::")
printf '%s\n' "${ids[@]}" | xargs -P "${CUDAGRAPH_JOBS:-6}" -I{} bash -c \
    'out="$(timeout 300 python3 -m pytest -q -p no:cacheprovider "$1" 2>&1)"; s=$?
     printf -- "---- %s\n%s\n" "$1" "$out" >> "$2/cudagraph_$BASHPID.log"
     last="$(tail -n 1 <<< "$out")"
     if [ $s -ne 0 ]; then echo "FAIL (exit $s) $1"; elif grep -q passed <<< "$last"; then echo "PASS $1"; else echo "SKIP $1 ($last)"; fi' \
    _ {} "$raw" \
    | tee -a "$OUT/summary.log"
cat "$raw"/cudagraph_[0-9]*.log > "$OUT/cudagraph_output.log" 2>/dev/null
grep -q "^FAIL" "$OUT/summary.log" && failed=1
exit $failed
