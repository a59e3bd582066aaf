#!/usr/bin/env bash
# Host-overhead probe on a CUDA machine: the eager table, then cProfile of chosen cases ($OUT/*.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d)}"
python benchmarks/bench_host_overhead.py --no-compile 2>&1 | tee "$OUT/host_table.log"
# "=name": one case's whole name (bench_host_overhead.py --only), so each profile holds that case alone.
for case in "cross_entropy fwd+bwd 512x32000" "softmax fwd 256x4096" "linear_cross_entropy fwd+bwd 512x1024x32000" "nvfp4_quantize row+col RHT, given amax" "grouped_swiglu_mlp bf16 fwd+bwd T512 E8"; do
    python benchmarks/bench_host_overhead.py --no-compile --calls 50 --repeats 1 --profile --only "=$case" > "$OUT/profile_${case%% *}.log" 2>&1
done
