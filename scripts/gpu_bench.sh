#!/usr/bin/env bash
# The kernel benchmarks on one GPU, in order, each under its own time limit: one log in $OUT
# (bench.log, a "== label exit status in N s" line after each), benchmark JSON left in a temporary
# directory. Carried wheels in .whl/ (Liger, tqdm; TE in .whl/te) are installed first (peer_wheels.sh).
#
#   bash scripts/gpu_bench.sh                  # the labels of `order` below (the kernel benchmarks,
#                                              # the host table, the example in each mode)
#   bash scripts/gpu_bench.sh ce mxfp8         # those labels (any key of `jobs`)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
json="$(mktemp -d)"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/peer_wheels.sh
declare -A jobs=(
    [ce]="python3 benchmarks/bench_cross_entropy.py --json $json/ce.json"
    [mxfp8]="python3 benchmarks/bench_mxfp8.py --no-sweep --no-compile --json $json/mxfp8.json"
    [nvfp4]="python3 benchmarks/bench_nvfp4.py --no-sweep --json $json/nvfp4.json"
    [grouped_mlp]="python3 benchmarks/bench_grouped_mlp.py"
    [nvfp4_decode]="python3 benchmarks/bench_nvfp4_decode.py"
    [linear_ce]="python3 benchmarks/bench_linear_cross_entropy.py --quick --no-gemms --json $json/lce.json"
    [host]="python3 benchmarks/bench_host_overhead.py"
    [ce_features]="python3 benchmarks/bench_cross_entropy.py --features --shapes 4096x129280 --json $json/ce_features.json"
    [overwrite]="python3 benchmarks/bench_overwrite_logits.py"
    [single_pass]="python3 benchmarks/probe_single_pass.py"
    [probe]="python3 benchmarks/probe_autograd_thread.py"
    [unaligned]="python3 benchmarks/probe_unaligned_rows.py && python3 benchmarks/bench_cross_entropy.py --shapes 8192x50257 --json $json/ce_unaligned.json"
    [mxfp8_call_parts]="python3 benchmarks/probe_mxfp8_call_parts.py"
    [rms_norm]="python3 benchmarks/bench_rms_norm.py --json $json/rms_norm.json"
    [transformers_vs_liger]="python3 benchmarks/bench_transformers.py --models ${TRANSFORMERS_MODELS:-llama,qwen3moe} --impls liger,lowp --modes eager,compiled --steps 6 --warmup 2 --budget-seconds ${TRANSFORMERS_SECONDS:-200} --json $json/transformers_vs_liger.json"
    [host_profile_ce]="python3 benchmarks/bench_host_overhead.py --no-compile --calls 100 --only cross_entropy --profile"
    [transformers_qwen3moe]="python3 benchmarks/bench_transformers.py --models qwen3moe --impls lowp,liger,stock --modes eager,compiled --steps 6 --warmup 2 --case-timeout 250 --budget-seconds ${TRANSFORMERS_SECONDS:-560} --json $json/transformers_qwen3moe.json"
    [transformers_gemma]="python3 benchmarks/bench_transformers.py --models gemma2,gemma3 --impls lowp,liger,stock --modes eager,compiled --steps 6 --warmup 2 --case-timeout 250 --budget-seconds ${TRANSFORMERS_SECONDS:-560} --json $json/transformers_gemma.json"
    [probe_memory]="python3 benchmarks/probe_train_memory.py --model qwen3moe --impl lowp"
    [host_eager]="python3 benchmarks/bench_host_overhead.py --no-compile --calls 100"
    [host_compiled]="python3 benchmarks/bench_host_overhead.py --calls 100 --only compiled"
    [host_compiled_losses]="python3 benchmarks/bench_host_overhead.py --calls 100 --only 'compiled cross_entropy,compiled softmax'"
    [probe_compiled]="python3 benchmarks/probe_compiled_dispatch.py"
    # three cases of ~50 s each: JOB_TIMEOUT=200
    [moe_steps]="for run in 'lowp --compiled' 'lowp-no-rms-norm --compiled' 'stock --compiled'; do
        python3 benchmarks/profile_train_step.py --model qwen3moe --top 3 --impl \$run; done"
    [host_nvfp4_dequantize]="python3 benchmarks/bench_host_overhead.py --no-compile --only nvfp4_dequantize"
    [transformers]="python3 benchmarks/bench_transformers.py --impls liger,lowp,stock --steps 6 --warmup 2 --budget-seconds ${TRANSFORMERS_SECONDS:-200} --json $json/transformers.json"
)
# The example's training step in each mode: lowp with each expert recipe, then the plain-PyTorch model.
for mode in eager compiled graph; do
    jobs[tiny_moe_$mode]="for run in '--recipe bf16' '--recipe mxfp8' '--recipe nvfp4' --baseline; do
        python3 examples/train_tiny_moe.py --device cuda --steps 60 --mode $mode \$run; done"
    jobs[tiny_moe_${mode}_baseline]="python3 examples/train_tiny_moe.py --device cuda --steps 60 --mode $mode --baseline"
done
order=(ce mxfp8 nvfp4 grouped_mlp nvfp4_decode linear_ce host tiny_moe_eager tiny_moe_compiled tiny_moe_graph)
[ $# -gt 0 ] && order=("$@")
for label in "${order[@]}"; do
    if [ -z "${jobs[$label]+set}" ]; then
        echo "gpu_bench.sh: unknown label $label; labels: ${!jobs[*]}" >&2
        exit 2
    fi
done
for label in "${order[@]}"; do
    start=$SECONDS
    echo "######## $label: ${jobs[$label]}" >> "$OUT/bench.log"
    OUT="$json" timeout "${JOB_TIMEOUT:-300}" bash -c "${jobs[$label]}" >> "$OUT/bench.log" 2>&1
    echo "== $label exit $? in $((SECONDS - start)) s" | tee -a "$OUT/bench.log"
done
