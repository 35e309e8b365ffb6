#!/usr/bin/env bash
# tools/fuzz.sh [seconds-per-target]: builds every libFuzzer target of tests/fuzz/ with clang-14
# (-fsanitize=fuzzer,address,undefined) and runs each for a bounded time (default 30 s), starting
# from its seed corpus and regressions. Prints per target: executions, corpus size, time, crashes.
# Exits non-zero if any target crashed, leaked, timed out or ran out of memory; the inputs that did
# are kept under $FORKSAFE_FUZZ_ARTIFACTS (default /tmp/forksafe-fuzz-artifacts) — fix the decoder
# and add the input to tests/fuzz/regressions/<target>/.
#
# Bazel runs under its own output base (the compiler differs from the default build's) and
# without convenience symlinks; its server is shut down at the end. Needs clang-14 and
# libclang-rt-14-dev (tools/install_deps.sh installs them).
#   FORKSAFE_FUZZ_TARGETS="codec frame"  run only these targets
set -euo pipefail

per_target="${1:-30}"
if ! [[ "$per_target" =~ ^[0-9]+$ ]] || [ "$per_target" -lt 1 ]; then
  echo "usage: tools/fuzz.sh [seconds-per-target]" >&2
  exit 2
fi

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

for tool in clang-14 bazel; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "fuzz: $tool is missing; run tools/install_deps.sh" >&2
    exit 2
  fi
done
if ! ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "fuzz: libFuzzer is missing (libclang-rt-14-dev); run tools/install_deps.sh" >&2
  exit 2
fi

targets=(${FORKSAFE_FUZZ_TARGETS:-codec frame queue tensor_handle child_messages pool_messages})
output_base="${FORKSAFE_FUZZ_OUTPUT_BASE:-$HOME/.cache/forksafe-fuzz/$(echo "$root" | md5sum | cut -c1-12)}"
artifacts="${FORKSAFE_FUZZ_ARTIFACTS:-/tmp/forksafe-fuzz-artifacts}"
bazel_cmd=(bazel --output_base="$output_base")
trap '"${bazel_cmd[@]}" shutdown >/dev/null 2>&1 || true' EXIT

labels=()
for t in "${targets[@]}"; do labels+=("//tests/fuzz:${t}_fuzzer"); done
work="$(mktemp -d /tmp/forksafe-fuzz.XXXXXX)"
echo "fuzz: building ${#targets[@]} targets with clang-14 (output base $output_base)"
if ! "${bazel_cmd[@]}" build --config=fuzz --symlink_prefix=/ "${labels[@]}" >"$work/build.log" 2>&1; then
  grep -E "error|ERROR" "$work/build.log" | tail -40 >&2
  echo "fuzz: the build failed (full log: $work/build.log)" >&2
  exit 1
fi
bin="$("${bazel_cmd[@]}" info --config=fuzz bazel-bin 2>/dev/null)"

mkdir -p "$artifacts"
failed=0
printf '%-16s %12s %8s %8s %8s\n' target executions corpus seconds crashes
for t in "${targets[@]}"; do
  corpus="$work/$t"
  mkdir -p "$corpus"
  cp tests/fuzz/corpus/"$t"/* "$corpus"/ 2>/dev/null || true
  regressions=()
  [ -d "tests/fuzz/regressions/$t" ] && regressions=("tests/fuzz/regressions/$t")
  rm -f "$artifacts/$t"-*
  log="$work/$t.log"
  start=$(date +%s)
  rc=0
  stalled=0
  # -max_total_time bounds the run; the outer timeout bounds a fuzzer that ignores it.
  timeout -k 10 $((per_target + 120)) "$bin/tests/fuzz/${t}_fuzzer" \
    -max_total_time="$per_target" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="$artifacts/$t-" \
    "$corpus" "${regressions[@]}" >"$log" 2>&1 || rc=$?
  seconds=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  # A timeout on a loaded machine can be a stall of the whole machine: it counts only if the
  # input is slow again when replayed alone.
  for slow in "$artifacts/$t"-timeout-*; do
    [ -f "$slow" ] || continue
    if timeout -k 10 120 "$bin/tests/fuzz/${t}_fuzzer" -timeout=10 -runs=3 "$slow" >/dev/null 2>&1; then
      mkdir -p "$artifacts/unreproduced"
      mv "$slow" "$artifacts/unreproduced/"
      echo "fuzz: $t: a timeout did not reproduce when replayed (a stalled machine?); kept in $artifacts/unreproduced" >&2
      [ "$rc" -ne 0 ] && rc=0 && stalled=1
    fi
  done
  crashes=$(find "$artifacts" -maxdepth 1 -name "$t-*" -type f | wc -l)
  if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then crashes=1; fi
  printf '%-16s %12s %8s %8s %8s%s\n' "$t" "${execs:-?}" "$(ls "$corpus" | wc -l)" "$seconds" \
    "$crashes" "$([ "$stalled" -eq 1 ] && echo "  (stopped early by an unreproduced timeout)")"
  if [ "$crashes" -ne 0 ]; then
    failed=1
    echo "fuzz: $t failed (exit $rc); its log:" >&2
    grep -v '^#[0-9]' "$log" | tail -40 >&2
  fi
done
rm -rf "$work"
if [ "$failed" -ne 0 ]; then
  echo "fuzz: FAILED; inputs kept in $artifacts" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${per_target} s each without a crash"
