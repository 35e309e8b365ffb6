#!/usr/bin/env bash
# Runs the whole test suite: installs what is missing, then `bazel test //...`, then prints a
# summary line "N passed, N failed, N skipped" counted over GoogleTest cases.
#   bash tools/test.sh [extra bazel flags, e.g. --config=asan]
# With FORKSAFE_SANITIZERS="asan ubsan" the suite runs again under each of those configurations
# and the summary line counts every run (CI does this). With FORKSAFE_SOAK_SCALE=0.1 the soak
# tests (tests/soak, tagged manual; see tools/soak.sh) run too, at that fraction of full size;
# with FORKSAFE_FUZZ_SECONDS=30 each fuzz target (tools/fuzz.sh) runs 30 s. After the plain
# suite, the package's four consumers are built and run (tools/consumers.sh; each counts as one
# test); FORKSAFE_CONSUMERS=0 skips them. FORKSAFE_STATIC_CHECKS=1 adds the format check and the
# thread-safety build (clang-14), one test each.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh || exit 1

log="$(mktemp)"
started="$(mktemp)"  # its mtime marks the start of this run (see the /dev/shm check below)
trap 'rm -f "$log" "$started"' EXIT
passed=0; failed=0; skipped=0
failed_list=()  # what failed, one entry each, repeated at the end next to the summary line
failed_detail=()  # for each failed test target: its failing cases and first assertions
leak_checked=0; leak_found=0
status=0

# Runs the suite once with the given flags and adds its GoogleTest counts to the totals.
run_suite() {
  echo "=== bazel test $* ${targets:-//...}"
  suite_label="$*"
  bazel test --keep_going "$@" ${targets:-//...} 2>&1 | grep -v "linux-sandbox" | tee "$log"
  local run_status=${PIPESTATUS[0]}
  [ "$run_status" -ne 0 ] && status=$run_status
  local before_passed=$passed before_failed=$failed
  count_results
  if [ "$passed" -eq "$before_passed" ] && [ "$failed" -eq "$before_failed" ] &&
     [ "$run_status" -ne 0 ]; then
    failed=$((failed + 1))  # the build itself failed before any test ran
    failed_list+=("the build of ${targets:-//...}${suite_label:+ [$suite_label]}")
  fi
}

count_results() {
testlogs="$(bazel info bazel-testlogs 2>/dev/null)"
# One line per test target: "//pkg:name   PASSED in 0.1s" (or FAILED, TIMEOUT, ...).
while read -r target result _; do
  case "$result" in
    PASSED|FAILED|TIMEOUT|FLAKY|INCOMPLETE|NO|"FAILED_TO_BUILD") ;;
    *) continue ;;
  esac
  rel="${target#//}"; rel="${rel/://}"
  xml="$testlogs/$rel/test.xml"
  t=0; f=0; s=0
  # A target that did not build (or got no status) this run may have an old test.xml: ignore it.
  if [ "$result" = "FAILED_TO_BUILD" ] || [ "$result" = "NO" ]; then xml=/nonexistent; fi
  if [ -f "$xml" ]; then
    # GoogleTest's XML carries the totals on <testsuites ...>; pytest's JUnit XML
    # (python/run_pytest.sh, all on one line) on its one <testsuite ...>, skips included.
    head_line="$(grep -o -m1 '<testsuites [^>]*>' "$xml" || true)"
    if [ -z "$head_line" ]; then head_line="$(grep -o -m1 '<testsuite [^>]*>' "$xml" || true)"; fi
    attr() { sed -n "s/.* $1=\"\([0-9]*\)\".*/\1/p" <<<"$head_line"; }
    t="$(attr tests)"; t=${t:-0}
    f="$(attr failures)"; f=${f:-0}
    e="$(attr errors)"; f=$((f + ${e:-0}))
    s="$(attr skipped)"
    if [ -z "$s" ]; then s="$(grep -o '<skipped' "$xml" | wc -l)"; fi
  fi
  if [ "$result" != "PASSED" ] && [ "$f" -eq 0 ]; then
    f=1  # crashed, timed out or did not build: count the target as one failure
  fi
  passed=$((passed + t - f - s)); failed=$((failed + f)); skipped=$((skipped + s))
  if [ "$f" -gt 0 ]; then
    failed_list+=("$target $result ($f case(s))${suite_label:+ [$suite_label]}")
    # What a reader of CI's tail needs to start: the failing cases and their first assertions
    # (or, for a crash or timeout, the log's last lines).
    if [ -f "$testlogs/$rel/test.log" ]; then
      detail="$(grep -E '^\[  FAILED  \] [A-Za-z]|^(FAILED|ERROR) ' "$testlogs/$rel/test.log" | sort -u | head -5
                grep -A4 -E ': Failure$|^E  ' "$testlogs/$rel/test.log" | head -15)"
      [ -z "$detail" ] && detail="$(tail -8 "$testlogs/$rel/test.log")"
      # A child that hung: the first one's thread stacks (tests/support/child_process.h).
      stacks="$(sed -n '/^child [0-9]* still running/,/^=== end of stacks of hung child/p' \
                  "$testlogs/$rel/test.log" | grep -E '^(===|Thread |#|\(|\* |  task |    \[k\] |child [0-9]+ still)' | head -90)"
      [ -n "$stacks" ] && detail="$detail"$'\n'"$stacks"
      failed_detail+=("--- $target${suite_label:+ [$suite_label]}" "$detail")
    fi
  fi
  # The leak check (tests/support/leak_check.h) ends each binary with
  # "forksafe leak check: N test(s) checked, M leaked, ...".
  if [ -f "$testlogs/$rel/test.log" ] && [ -f "$xml" ]; then
    read -r lc lk < <(sed -n 's/^forksafe leak check: \([0-9]*\) test(s) checked, \([0-9]*\) leaked.*/\1 \2/p' \
                        "$testlogs/$rel/test.log" | tail -1)
    leak_checked=$((leak_checked + ${lc:-0})); leak_found=$((leak_found + ${lk:-0}))
  fi
done < <(grep -E '^//[^ ]+ +(\(cached\) +)?(PASSED|FAILED|TIMEOUT|FLAKY|INCOMPLETE|NO STATUS|FAILED TO BUILD)' "$log" \
         | sed -E 's/\(cached\) +//; s/FAILED TO BUILD/FAILED_TO_BUILD/; s/NO STATUS/NO/')
}

# The plain run includes the Python package's tests (//python:python_test, manual: pytest with
# /usr/bin/python3 on the extension built against libforksafe.so; python/BUILD.bazel says why
# the sanitizer runs leave it out).
# Not under a --config (a sanitizer build of the extension cannot be loaded into /usr/bin/python3).
python_target="//python:python_test"
for flag in "$@"; do
  case "$flag" in --config=*|--config) python_target="" ;; esac
done
targets="//... $python_target" run_suite "$@"

# The package's four consumers (tools/consumers.sh: CMake, pkg-config and Python from an install
# into a temporary prefix, and an outside Bazel workspace) each build and run a program of
# examples/consumers/; each counts as one test. FORKSAFE_CONSUMERS=0 skips them.
if [ "${FORKSAFE_CONSUMERS:-1}" != 0 ]; then
  echo "=== bash tools/consumers.sh"
  bash tools/consumers.sh 2>&1 | tee "$log"
  consumers_status=${PIPESTATUS[0]}
  consumers_passed="$(grep -c '^consumer .* PASSED' "$log")"
  consumers_failed="$(grep -c '^consumer .* FAILED' "$log")"
  while read -r line; do failed_list+=("$line"); done < <(grep '^consumer .* FAILED' "$log")
  if [ "$consumers_status" -ne 0 ]; then
    status=1
    if [ "$consumers_failed" -eq 0 ]; then
      consumers_failed=1  # it failed before any consumer ran
      failed_list+=("tools/consumers.sh (before any consumer ran)")
    fi
  fi
  passed=$((passed + consumers_passed)); failed=$((failed + consumers_failed))
fi

# With FORKSAFE_STATIC_CHECKS=1 (CI) two checks that build no test: the house format
# (tools/format.sh --check) and the library built with clang-14 -Wthread-safety -Werror
# (tools/thread_safety.sh). Each counts as one test.
if [ "${FORKSAFE_STATIC_CHECKS:-0}" = 1 ]; then
  for check in "format.sh --check" "thread_safety.sh"; do
    echo "=== bash tools/$check"
    # shellcheck disable=SC2086
    if bash tools/$check 2>&1 | tee "$log"; then
      passed=$((passed + 1))
    else
      failed=$((failed + 1)); status=1
      failed_list+=("tools/$check: $(grep -E 'FAILED|findings?' "$log" | head -1)")
    fi
  done
fi

for config in ${FORKSAFE_SANITIZERS:-}; do
  run_suite --config="$config" "$@"
done
if [ -n "${FORKSAFE_SOAK_SCALE:-}" ]; then
  targets=//tests/soak:soak run_suite --test_env=FORKSAFE_SOAK_SCALE="$FORKSAFE_SOAK_SCALE" \
    --test_output=all "$@"
  echo "=== soak figures (scale $FORKSAFE_SOAK_SCALE)"
  grep '^soak:' "$log" || echo "no figures: the soak tests did not run"
fi

# With FORKSAFE_FUZZ_SECONDS=N every libFuzzer target of tests/fuzz runs N seconds
# (tools/fuzz.sh); each target counts as one test: passed when it found no crash.
if [ -n "${FORKSAFE_FUZZ_SECONDS:-}" ]; then
  echo "=== bash tools/fuzz.sh $FORKSAFE_FUZZ_SECONDS"
  bash tools/fuzz.sh "$FORKSAFE_FUZZ_SECONDS" 2>&1 | tee "$log"
  fuzz_status=${PIPESTATUS[0]}
  fuzz_passed=0; fuzz_failed=0
  # Rows of its table: "target executions corpus seconds crashes".
  while read -r name execs corpus secs crashes _; do
    if [ "$crashes" = "0" ]; then
      fuzz_passed=$((fuzz_passed + 1))
    else
      fuzz_failed=$((fuzz_failed + 1)); failed_list+=("fuzz target $name: $crashes crash(es)")
    fi
  done < <(grep -E '^[a-z_]+ +([0-9]+|\?) +[0-9]+ +[0-9]+ +[0-9]+' "$log")
  if [ "$fuzz_status" -ne 0 ]; then
    status=1
    if [ "$fuzz_failed" -eq 0 ]; then
      fuzz_failed=1  # the build failed before any target ran
      failed_list+=("tools/fuzz.sh (before any target ran)")
    fi
  fi
  passed=$((passed + fuzz_passed)); failed=$((failed + fuzz_failed))
fi

# Nothing may be left in /dev/shm by the tests (named segments of the file_system strategy).
# Every test has ended by now, so any forksafe_* entry created during this run is a leftover. The
# pid in a name is no guide here: sandboxed tests have their own pid numbering. Give the shm
# managers a moment to finish, then count what remains. (A forksafe program running beside this
# run would be counted too: run the suite alone.)
leftover=0
for _ in 1 2 3 4 5 6 7 8 9 10; do
  leftover="$(find /dev/shm -maxdepth 1 -name 'forksafe_*' -newer "$started" 2>/dev/null | wc -l)"
  [ "$leftover" -eq 0 ] && break
  sleep 1
done
if [ "$leftover" -ne 0 ]; then
  echo "forksafe: $leftover shared-memory segment(s) made by this run were left in /dev/shm:" >&2
  find /dev/shm -maxdepth 1 -name 'forksafe_*' -newer "$started" -exec ls -l {} + >&2
  failed=$((failed + 1))
  failed_list+=("$leftover /dev/shm segment(s) left behind")
  status=1
fi
echo
if [ "${#failed_list[@]}" -gt 0 ]; then
  if [ "${#failed_detail[@]}" -gt 0 ]; then
    echo "how it failed:"
    printf '%s\n' "${failed_detail[@]}"
    echo
  fi
  echo "what failed:"
  printf '  %s\n' "${failed_list[@]}"
fi
echo "leak check: $leak_checked test(s) checked for descriptors, children, /dev/shm entries and mappings left behind; $leak_found leaked"
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
