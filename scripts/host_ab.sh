#!/usr/bin/env bash
# Host time per call of two trees of the library on one machine: the lowp_ops package at OLD (a
# directory holding an older lowp_ops/, e.g. `git archive <commit> lowp_ops | tar -x -C <dir>`) and this
# tree's, each through this tree's benchmarks/bench_host_overhead.py, alternating OLD, NEW, OLD, NEW
# (runs of one machine drift; the alternation shows it). Logs under $OUT.
# HOST_ONLY: the --only list (case-name substrings, comma-separated; may hold spaces).
#   OLD=scratch/old_tree HOST_ARGS="--calls 100" HOST_ONLY="compiled" bash scripts/host_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1
for round in $(seq "${ROUNDS:-2}"); do
    for tree in "$OLD" "$PWD"; do
        label="$([ "$tree" = "$PWD" ] && echo new || echo old)"
        echo "== $label (round $round)"
        # shellcheck disable=SC2206
        args=(${HOST_ARGS:---calls 100})
        [ -n "${HOST_ONLY:-}" ] && args+=(--only "$HOST_ONLY")
        PYTHONPATH="$tree" timeout "${HOST_TIMEOUT:-300}" python benchmarks/bench_host_overhead.py \
            "${args[@]}" 2>&1 | tee "$OUT/host_${label}_${round}.log" | grep -v "^wrote"
    done
done
