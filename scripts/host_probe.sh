#!/usr/bin/env bash
# Host-overhead probe on a CUDA machine: the eager table, then cProfile of chosen cases ($OUT/*.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d)}"
python benchmarks/bench_host_overhead.py --no-compile 2>&1 | tee "$OUT/host_table.log"
for case in "cross_entropy fwd+bwd" "softmax fwd 256" "linear_cross_entropy" "nvfp4_quantize row+col RHT, given" "grouped_swiglu_mlp bf16"; do
    python benchmarks/bench_host_overhead.py --no-compile --calls 50 --repeats 1 --profile --only "$case" > "$OUT/profile_${case%% *}.log" 2>&1
done
