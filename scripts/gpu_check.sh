#!/usr/bin/env bash
# GPU check, run from the repository root on a CUDA machine (torch >= 2.11, triton >= 3.6, pytest and
# hypothesis already installed; no network needed):
#
#   bash scripts/gpu_check.sh                 # everything: gpu tests, cudagraph tests, all benchmarks
#   bash scripts/gpu_check.sh tests           # gpu + cudagraph tests       (or: gpu, cudagraph)
#   bash scripts/gpu_check.sh bench           # every benchmarks/bench_*.py (or a name: mxfp8, bench_mxfp8)
#
# Logs go to $OUT (a temporary directory if unset), in few files: gpu_tests.log, cudagraph_tests.log
# (one PASS/FAIL line per test, each test in its own process: a failed capture poisons its process),
# bench.log, and the benchmarks' JSON. Exits nonzero if any test or benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/peer_wheels.sh

# Which parts to run: none given means all; a name that is not a part selects one benchmark.
run_gpu=0 run_cudagraph=0 benches=()
[ $# -eq 0 ] && set -- tests bench
for part in "$@"; do
    case "$part" in
        tests) run_gpu=1 run_cudagraph=1 ;;
        gpu) run_gpu=1 ;;
        cudagraph) run_cudagraph=1 ;;
        bench) benches+=(benchmarks/bench_*.py) ;;
        *)
            name="${part%.py}"
            name="bench_${name#bench_}"
            if [ -f "benchmarks/$name.py" ]; then
                benches+=("benchmarks/$name.py")
            else
                echo "unknown part '$part' (tests, gpu, cudagraph, bench, or a benchmarks/bench_<name>.py)"
                exit 2
            fi
            ;;
    esac
done

summary=()
failed=0
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"

if [ "$run_gpu" -eq 1 ]; then
    echo "== gpu tests -> $OUT/gpu_tests.log"
    # cudagraph tests run below, one per process, even when also marked gpu.
    python3 -m pytest -q -m "gpu and not cudagraph" > "$OUT/gpu_tests.log" 2>&1
    status=$?
    last_line="$(tail -n 1 "$OUT/gpu_tests.log")"
    # Exit code 5: no test collected, not a failure.
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
        failed=1
        grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log" | head -n 30
    fi
    summary+=("gpu tests: exit $status; $last_line")
fi

if [ "$run_cudagraph" -eq 1 ]; then
    log="$OUT/cudagraph_tests.log"
    echo "== cudagraph tests, one process each -> $log"
    : > "$log"
    verdicts="$(CUDAGRAPH_LOG="$log" bash scripts/cudagraph_each.sh)"
    status=$?
    echo "$verdicts" | tee -a "$log"
    passed=$(grep -c "^PASS" <<< "$verdicts") skipped=$(grep -c "^SKIP" <<< "$verdicts")
    failed_cg=$(grep -c "^FAIL" <<< "$verdicts")
    [ "$status" -ne 0 ] && failed=1
    summary+=("cudagraph tests: $passed passed, $skipped skipped, $failed_cg failed")
fi

if [ "${#benches[@]}" -gt 0 ]; then
    log="$OUT/bench.log"
    echo "== benchmarks -> $log (JSON in $OUT)"
    for bench in "${benches[@]}"; do
        echo "==== $bench ($(date -u +%H:%M:%S))" >> "$log"
        python3 "$bench" >> "$log" 2>&1
        status=$?
        [ "$status" -ne 0 ] && failed=1
        summary+=("benchmark $bench: exit $status")
    done
fi

echo "== summary (logs in $OUT)"
printf '  %s\n' "${summary[@]}"
exit "$failed"
