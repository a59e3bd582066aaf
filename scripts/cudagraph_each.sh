#!/usr/bin/env bash
# Run the cudagraph-marked tests of the given test files, each in its own process (a failed capture
# poisons its process); prints one PASS/FAIL/SKIP line per test and exits nonzero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=0
mapfile -t ids < <(python3 -m pytest --collect-only -q -m cudagraph "$@" 2>/dev/null | grep "::")
for id in "${ids[@]}"; do
    last="$(timeout 300 python3 -m pytest -q "$id" 2>&1 | tail -n 1)"
    case "$last" in
        *failed*|*error*) verdict=FAIL failed=1 ;;
        *passed*) verdict=PASS ;;
        *) verdict=SKIP ;;
    esac
    echo "$verdict $id ($last)"
done
exit $failed
