#!/usr/bin/env bash
# Run the cudagraph-marked tests (of the given test files; none: all of them), each in its own process
# (a failed capture poisons its process). Prints one "PASS|SKIP|FAIL (exit N) <test id>" line per test;
# with CUDAGRAPH_LOG set, every test's full output is appended to that file. Exits nonzero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${CUDAGRAPH_LOG:-/dev/null}"
failed=0
mapfile -t ids < <(python3 -m pytest --collect-only -q -m cudagraph "$@" 2>>"$log" | grep "::")
for id in "${ids[@]}"; do
    output="$(timeout 300 python3 -m pytest -q "$id" 2>&1)"
    status=$?
    printf -- '---- %s\n%s\n' "$id" "$output" >> "$log"
    if [ "$status" -eq 0 ] && tail -n 1 <<< "$output" | grep -q "passed"; then
        verdict=PASS
    elif [ "$status" -eq 0 ]; then
        verdict=SKIP
    else
        verdict="FAIL (exit $status)" failed=1
    fi
    echo "$verdict $id"
done
exit $failed
