#!/usr/bin/env bash
# One device call, several jobs on a two-GPU host: each job is "GPU:LABEL:COMMAND" (GPU "all" runs
# after the per-GPU jobs, alone). Jobs on one GPU run in order, the two GPUs in parallel. Stdout of
# every job goes to one log under $OUT (the device returns few files); benchmark JSON to $OUT/json.
#
#   bash scripts/gpu_batch.sh "1:tune:python benchmarks/tune_kernels.py ce" "0:ce:python benchmarks/bench_cross_entropy.py"
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-$(mktemp -d)}"
rm -rf /tmp/joblogs
mkdir -p "$RESULTS/json" /tmp/joblogs
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/peer_wheels.sh
run_jobs() {  # GPU, then the jobs for it, in order
    local gpu=$1
    shift
    for job in "$@"; do
        local label="${job#*:}" ; label="${label%%:*}"
        local cmd="${job#*:*:}"
        local start=$SECONDS
        if [ "$gpu" = all ]; then
            (OUT="$RESULTS/json" timeout "${JOB_TIMEOUT:-400}" bash -c "$cmd") > "/tmp/joblogs/$label.log" 2>&1
        else
            (CUDA_VISIBLE_DEVICES=$gpu OUT="$RESULTS/json" timeout "${JOB_TIMEOUT:-400}" bash -c "$cmd") \
                > "/tmp/joblogs/$label.log" 2>&1
        fi
        echo "== $label (gpu $gpu) exit $? in $((SECONDS - start)) s" >> "/tmp/joblogs/$label.log"
    done
}
gpu0=() gpu1=() both=()
for job in "$@"; do
    case "${job%%:*}" in
        0) gpu0+=("$job") ;;
        1) gpu1+=("$job") ;;
        *) both+=("$job") ;;
    esac
done
[ ${#gpu0[@]} -gt 0 ] && run_jobs 0 "${gpu0[@]}" &
[ ${#gpu1[@]} -gt 0 ] && run_jobs 1 "${gpu1[@]}" &
wait
[ ${#both[@]} -gt 0 ] && run_jobs all "${both[@]}"
for log in /tmp/joblogs/*.log; do
    echo "######## $(basename "$log" .log)"
    cat "$log"
done > "$RESULTS/jobs.log"
grep -h "^== " /tmp/joblogs/*.log
