#!/usr/bin/env bash
# Runs the soak tests of tests/soak (issue 7, "Load"), which `bazel test //...` skips (they are
# tagged "manual"), and prints each one's figures ("soak: ..." lines) at the end.
#   bash tools/soak.sh [scale] [extra bazel flags]
# scale multiplies the full size (1: a million Queue messages, ten thousand forks, a Pool killed
# at random for 180 s); the default, 0.1, is the CI size (about half a minute here).
set -uo pipefail
cd "$(dirname "$0")/.."
scale="${1:-0.1}"
[ $# -gt 0 ] && shift
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
bazel test --test_env=FORKSAFE_SOAK_SCALE="$scale" --test_output=streamed "$@" \
  //tests/soak:soak 2>&1 | grep -v "linux-sandbox" | tee "$log"
status=${PIPESTATUS[0]}
echo "=== soak figures (scale $scale)"
grep '^soak:' "$log" || echo "no figures: the soak tests did not run"
exit "$status"
