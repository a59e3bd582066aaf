#!/usr/bin/env bash
# The whole GPU suite in five concurrent pytest processes (compiles are CPU-bound; the tests are small
# for an H200's memory), then every cudagraph test in its own process. Logs under $OUT (or a temporary
# directory): gpu_<group>.log, cudagraph.log (one PASS/SKIP/FAIL line per test), cudagraph_output.log (their
# output). H200 (S9-7): 394 passed, 17 skipped (two-GPU tests) and 15 + 2 cudagraph tests in 349 s.
# Exits nonzero if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
limit="${GPU_TEST_SECONDS:-420}"
declare -A groups=(
    [loss]="tests/test_cross_entropy_kernels.py tests/test_softmax_kernels.py tests/test_vocab_parallel.py tests/test_linear_vocab_parallel.py"
    [nvfp4]="tests/test_nvfp4_kernels.py tests/test_nvfp4_decode.py"
    [moe]="tests/test_grouped_mlp.py tests/test_swiglu_kernels.py tests/test_train_tiny_moe.py tests/test_mxfp8_gemm.py"
    [lmhead]="tests/test_linear_cross_entropy.py tests/test_linear_cross_entropy_kernels.py tests/test_mxfp8_kernels.py"
)
# Any other test file (one added later) in a fifth process.
rest="tests"
for files in "${groups[@]}"; do
    for file in $files; do rest+=" --ignore=$file"; done
done
groups[rest]="$rest"
pids=()
for name in "${!groups[@]}"; do
    # shellcheck disable=SC2086 # the group is a list of files
    TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" timeout "$limit" python3 -m pytest -q -m "gpu and not cudagraph" \
        ${groups[$name]} > "$OUT/gpu_$name.log" 2>&1 &
    pids+=("$!:$name")
done
failed=0
for entry in "${pids[@]}"; do
    wait "${entry%%:*}"
    status=$?
    echo "gpu ${entry#*:}: exit $status, $(tail -n 1 "$OUT/gpu_${entry#*:}.log")"
    [ "$status" -ne 0 ] && [ "$status" -ne 5 ] && failed=1
done
# Each cudagraph test in its own process, four at a time.
mapfile -t ids < <(python3 -m pytest --collect-only -q -m cudagraph 2>/dev/null | grep "::")
printf '%s\n' "${ids[@]}" | xargs -P 4 -I{} bash -c \
    'out="$(timeout 300 python3 -m pytest -q "$1" 2>&1)"; s=$?; printf -- "---- %s\n%s\n" "$1" "$out" >> "$2/cudagraph_$BASHPID.log";
     last="$(tail -n 1 <<< "$out")"
     if [ $s -ne 0 ]; then echo "FAIL (exit $s) $1"; elif grep -q passed <<< "$last"; then echo "PASS $1"; else echo "SKIP $1 ($last)"; fi' \
    _ {} "$OUT" \
    > "$OUT/cudagraph.log"
cat "$OUT"/cudagraph_[0-9]*.log > "$OUT/cudagraph_output.log" 2>/dev/null && rm -f "$OUT"/cudagraph_[0-9]*.log
cat "$OUT/cudagraph.log"
grep -q "^FAIL" "$OUT/cudagraph.log" && failed=1
exit $failed
