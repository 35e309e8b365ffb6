#!/usr/bin/env bash
# Builds and runs the four consumers of examples/consumers/ against this checkout, the ways a
# user consumes the package (docs/building.md, "The package"; docs/python.md):
#   cmake       tools/install.sh into a temporary prefix, then find_package(forksafe CONFIG)
#   pkg-config  the same install, then g++ $(pkg-config --cflags --libs forksafe)
#   bazel       an outside workspace: local_repository + forksafe_dependencies(), @forksafe//:forksafe
#   python      the same install, then /usr/bin/python3 examples/consumers/python/framework.py
# Each C++ one builds examples/consumers/framework.cc and runs it (it exits non-zero on any
# mismatch). A fifth check, bazel-visibility, expects the outside workspace to be refused a
# dependency on an internal/ library. Prints one line per check, then "consumers: N/5 ok in S s";
# exits non-zero if any failed.
# The temporary prefix is removed and the outside workspace's Bazel server stopped at the end,
# also on failure. That workspace builds forksafe again (fastbuild) in its own output base,
# kept in $FORKSAFE_CONSUMER_OUTPUT_BASE (default ~/.cache/forksafe-consumer) so that a re-run is
# incremental.
#   bash tools/consumers.sh
set -uo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"

work="$(mktemp -d "${TMPDIR:-/tmp}/forksafe-consumers.XXXXXX")"
prefix="$work/prefix"
output_base="${FORKSAFE_CONSUMER_OUTPUT_BASE:-$HOME/.cache/forksafe-consumer}"
bazel_ws="$root/examples/consumers/bazel"
outside_bazel() { (cd "$bazel_ws" && bazel --output_base="$output_base" "$@"); }
cleanup() {
  outside_bazel shutdown >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

started=$SECONDS
passed=0; failed=0
# report NAME STATUS BUILD_SECONDS RUN_SECONDS LOG: the consumer's line; its log's tail if failed.
report() {
  if [ "$2" -eq 0 ]; then
    passed=$((passed + 1))
    printf 'consumer %-10s PASSED  (build %3d s, run %2d s)\n' "$1" "$3" "$4"
  else
    failed=$((failed + 1))
    if [ "$5" = /dev/null ]; then
      printf 'consumer %-10s FAILED  (not built: tools/install.sh failed, above)\n' "$1"
    else
      printf 'consumer %-10s FAILED  (build %3d s, run %2d s); the end of its log:\n' "$1" "$3" "$4"
      tail -n 40 "$5" | sed 's/^/    /'
    fi
  fi
}

# build_and_run NAME BINARY BUILD_COMMAND...: runs the build, then the binary (bounded).
build_and_run() {
  local name="$1" binary="$2"; shift 2
  local log="$work/$name.log" status=0 t0=$SECONDS build_s run_s=0
  "$@" >"$log" 2>&1 || status=$?
  build_s=$((SECONDS - t0))
  if [ "$status" -eq 0 ]; then
    t0=$SECONDS
    timeout 300 "$binary" >>"$log" 2>&1 || status=$?
    run_s=$((SECONDS - t0))
    [ "$status" -eq 0 ] || echo "framework exited with status $status" >>"$log"
  fi
  report "$name" "$status" "$build_s" "$run_s" "$log"
}

echo "=== consumers: install into $prefix"
install_log="$work/install.log"
if bash tools/install.sh --prefix "$prefix" >"$install_log" 2>&1; then
  sed -n '/^forksafe .* installed in /,$p' "$install_log"
  export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"

  build_and_run cmake "$work/cmake/framework" \
    bash -c "cmake -S examples/consumers/cmake -B '$work/cmake' -DCMAKE_PREFIX_PATH='$prefix' \
               -DCMAKE_BUILD_TYPE=Release && cmake --build '$work/cmake'"

  build_and_run pkg-config "$work/pkg-config/framework" \
    bash -c "mkdir -p '$work/pkg-config' &&
             bash examples/consumers/pkg-config/build.sh '$work/pkg-config/framework'"

  # Nothing to build: the install holds the extension. The "binary" runs the program.
  printf '#!/bin/sh\nexec /usr/bin/python3 "%s/examples/consumers/python/framework.py" "%s"\n' \
    "$root" "$prefix" > "$work/python-consumer"
  chmod +x "$work/python-consumer"
  build_and_run python "$work/python-consumer" true
else
  echo "tools/install.sh --prefix $prefix failed; the end of its log:"
  tail -n 40 "$install_log" | sed 's/^/    /'
  report cmake 1 0 0 /dev/null
  report pkg-config 1 0 0 /dev/null
  report python 1 0 0 /dev/null
fi

# The outside Bazel workspace needs no install: it builds forksafe from this checkout.
build_and_run bazel "$work/bazel-framework" \
  bash -c "cd '$bazel_ws' && bazel --output_base='$output_base' build --symlink_prefix=/ \
             //:framework && cp \"\$(bazel --output_base='$output_base' info bazel-bin)/framework\" \
             '$work/bazel-framework'"

# The same workspace may not depend on forksafe's internal/ libraries: analysing
# //:internal_probe (a dependency on @forksafe//mp:process_internal) must fail on visibility.
probe_log="$work/bazel-visibility.log"; t0=$SECONDS
outside_bazel build --nobuild --symlink_prefix=/ //:internal_probe >"$probe_log" 2>&1
if grep -q "is not visible from target" "$probe_log"; then
  report bazel-visibility 0 $((SECONDS - t0)) 0 "$probe_log"
else
  echo "an outside workspace could depend on @forksafe//mp:process_internal" >>"$probe_log"
  report bazel-visibility 1 $((SECONDS - t0)) 0 "$probe_log"
fi

echo "consumers: $passed/$((passed + failed)) ok in $((SECONDS - started)) s"
[ "$failed" -eq 0 ]
