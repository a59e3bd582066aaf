#!/usr/bin/env bash
# One device call that checks a change and measures it against an older tree on the same machine: the
# GPU tests of the given test files, each of their cudagraph tests in its own process, the host-time
# table of both trees (scripts/host_ab.sh; HOST_ARGS, HOST_ONLY), and the example's training step of both trees
# and of the plain-PyTorch baseline (MOE_RUNS: "mode:recipe" items; recipe "baseline" = --baseline).
# OLD: a directory holding the older lowp_ops/. Logs under $OUT.
#   OLD=scratch/old_tree MOE_RUNS="compiled:bf16 compiled:baseline" bash scripts/gpu_ab_round.sh tests/test_x.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export OUT PYTHONUNBUFFERED=1
files=("$@")
[ "${#files[@]}" -gt 0 ] && bash scripts/gpu_test_files.sh "${files[@]}"
[ -n "${HOST_ARGS:-}${HOST_ONLY:-}" ] && bash scripts/host_ab.sh
for run in ${MOE_RUNS:-}; do
    mode="${run%%:*}" recipe="${run##*:}"
    for tree in "$OLD" "$PWD"; do
        label="$([ "$tree" = "$PWD" ] && echo new || echo old)"
        if [ "$recipe" = baseline ]; then
            [ "$label" = old ] && continue  # the baseline does not use the library's ops
            flags=(--baseline)
        else
            flags=(--recipe "$recipe")
        fi
        echo "== tiny MoE $mode $recipe ($label)"
        PYTHONPATH="$tree" timeout "${MOE_TIMEOUT:-240}" python examples/train_tiny_moe.py --device cuda \
            --steps "${MOE_STEPS:-60}" --mode "$mode" "${flags[@]}" 2>/dev/null | tail -n 1
    done
done
