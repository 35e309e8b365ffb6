#!/usr/bin/env bash
# tools/thread_safety.sh: builds the whole library (//:forksafe, //:libforksafe.so) and the Python
# extension with clang-14, `-Wall -Wextra -Wthread-safety -Werror` (.bazelrc: build:thread_safety),
# so that state declared ABSL_GUARDED_BY(mu) (runtime/internal/mutex.h) and touched without `mu`,
# or a function that needs a lock called without it, fails. Prints "thread safety: PASSED" or
# "thread safety: FAILED" with the compiler's findings, and exits non-zero on failure.
#
# Bazel runs under its own output base (the compiler differs from the default build's), without
# convenience symlinks; its server is shut down at the end. Needs clang-14 (tools/install_deps.sh).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if ! command -v clang-14 >/dev/null 2>&1; then
  echo "thread safety: clang-14 is missing; run tools/install_deps.sh" >&2
  echo "thread safety: FAILED"
  exit 2
fi
output_base="${FORKSAFE_THREAD_SAFETY_OUTPUT_BASE:-$HOME/.cache/forksafe-thread-safety/$(echo "$root" | md5sum | cut -c1-12)}"
bazel_cmd=(bazel --output_base="$output_base")
trap '"${bazel_cmd[@]}" shutdown >/dev/null 2>&1 || true' EXIT
log="$(mktemp /tmp/forksafe-thread-safety.XXXXXX)"
targets=(//:forksafe //:libforksafe.so //python:_forksafe.so)
echo "thread safety: building ${targets[*]} with clang-14 -Wthread-safety -Werror (output base $output_base)"
if "${bazel_cmd[@]}" build --config=thread_safety --symlink_prefix=/ --keep_going "${targets[@]}" \
    >"$log" 2>&1; then
  echo "thread safety: PASSED"
  rm -f "$log"
  exit 0
fi
grep -E "warning:|error:" "$log" | grep -v "^ERROR: Build did NOT" | sort -u | head -60 >&2
echo "thread safety: $(grep -c -E 'error: .*-Wthread-safety' "$log" || true) thread-safety finding(s); full log: $log" >&2
echo "thread safety: FAILED"
exit 1
