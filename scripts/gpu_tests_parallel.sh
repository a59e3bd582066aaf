#!/usr/bin/env bash
# The whole GPU suite in five concurrent pytest processes (compiles are CPU-bound; the tests are small
# for an H200's memory), then every cudagraph test in its own process. $OUT (or a temporary directory)
# gets at most four files, written as each stage ends, so a run cut short still leaves its results:
# summary.log (each group's last line, then one PASS/SKIP/FAIL line per cudagraph test), gpu_failures.log
# (the failing tests' assertion lines of every group), gpu_groups.log (the groups' whole output) and
# cudagraph_output.log. Raw per-process logs stay in a temporary directory. Arguments "name=file,file"
# replace the groups (and limit the cudagraph tests to those files). H200, 2026-12-01: 640 passed,
# 20 skipped (two-GPU tests) in 5 min 12 s, then 18 of the 19 cudagraph tests in the next ~3 min (the
# tiny-MoE one alone takes ~70 s). 2026-12-04 the groups outgrew one 600 s device call (lmhead 394 s,
# nvfp4 378 s, moe 213 s; loss and rest past 420 s): give groups as arguments to split the suite in two.
# Exits nonzero if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
raw="$(mktemp -d)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
limit="${GPU_TEST_SECONDS:-420}"
declare -A groups=(
    [loss]="tests/test_cross_entropy_kernels.py tests/test_softmax_kernels.py tests/test_vocab_parallel.py tests/test_linear_vocab_parallel.py"
    [nvfp4]="tests/test_nvfp4_kernels.py tests/test_nvfp4_decode.py"
    [moe]="tests/test_grouped_mlp.py tests/test_swiglu_kernels.py tests/test_train_tiny_moe.py tests/test_mxfp8_gemm.py"
    [lmhead]="tests/test_linear_cross_entropy.py tests/test_linear_cross_entropy_kernels.py tests/test_mxfp8_kernels.py"
)
cudagraph_files=(tests)
if [ $# -gt 0 ]; then
    # Groups given as arguments, "name=file,file,...": only those files, their cudagraph tests included.
    groups=()
    cudagraph_files=()
    for spec in "$@"; do
        groups[${spec%%=*}]="${spec#*=}"
        groups[${spec%%=*}]="${groups[${spec%%=*}]//,/ }"
        IFS=, read -ra listed <<< "${spec#*=}"
        cudagraph_files+=("${listed[@]}")
    done
else
    # Any other test file (one added later) in a fifth process.
    rest="tests"
    for files in "${groups[@]}"; do
        for file in $files; do rest+=" --ignore=$file"; done
    done
    groups[rest]="$rest"
fi
pids=()
for name in "${!groups[@]}"; do
    # shellcheck disable=SC2086 # the group is a list of files
    TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" timeout "$limit" python3 -m pytest -q -m "gpu and not cudagraph" \
        ${groups[$name]} > "$raw/gpu_$name.log" 2>&1 &
    pids+=("$!:$name")
done
failed=0
for entry in "${pids[@]}"; do
    wait "${entry%%:*}"
    status=$?
    echo "gpu ${entry#*:}: exit $status, $(tail -n 1 "$raw/gpu_${entry#*:}.log")" | tee -a "$OUT/summary.log"
    [ "$status" -ne 0 ] && [ "$status" -ne 5 ] && failed=1
done
cat "$raw"/gpu_*.log > "$OUT/gpu_groups.log"
grep -h -E "^(FAILED|ERROR)|^E   " "$raw"/gpu_*.log > "$OUT/gpu_failures.log"
# Each cudagraph test in its own process, CUDAGRAPH_JOBS (default four) at a time.
mapfile -t ids < <(python3 -m pytest --collect-only -q -m cudagraph "${cudagraph_files[@]}" 2>/dev/null | grep "::")
printf '%s\n' "${ids[@]}" | xargs -P "${CUDAGRAPH_JOBS:-4}" -I{} bash -c \
    'out="$(timeout 300 python3 -m pytest -q "$1" 2>&1)"; s=$?; printf -- "---- %s\n%s\n" "$1" "$out" >> "$2/cudagraph_$BASHPID.log";
     last="$(tail -n 1 <<< "$out")"
     if [ $s -ne 0 ]; then echo "FAIL (exit $s) $1"; elif grep -q passed <<< "$last"; then echo "PASS $1"; else echo "SKIP $1 ($last)"; fi' \
    _ {} "$raw" \
    | tee -a "$OUT/summary.log"
cat "$raw"/cudagraph_[0-9]*.log > "$OUT/cudagraph_output.log" 2>/dev/null
grep -q "^FAIL" "$OUT/summary.log" && failed=1
exit $failed
