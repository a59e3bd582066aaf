#!/usr/bin/env bash
# Installs lowp_ops with its test extras into the active Python and runs the CPU suite, then the
# Triton-interpreter suite (TRITON_INTERPRET must be set before triton is imported: its own process).
set -uo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 && python -m pip install -q -e ".[test]" || exit 1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}"
status=0
python -m pytest -q -m "not gpu and not cudagraph and not interp" "$@" || status=$?
# The interpreter runs each kernel in one Python thread: one worker per core (1.8x on two cores, where
# the CPU suite, whose compiles use every core already, gained 1.1x and runs as one process). Worksteal:
# a worker that runs out takes tests queued on the other (the suite's tests take 0.1-120 s each).
TRITON_INTERPRET=1 LOWP_OPS_CPU_KERNELS=triton python -m pytest -q -m interp -n auto --dist worksteal "$@"
interp_status=$?
# Exit code 5 means "no tests collected": not a failure of this suite.
[ "$interp_status" -eq 5 ] && interp_status=0
[ "$status" -eq 5 ] && status=0
exit $(( status || interp_status ))
