#!/usr/bin/env bash
# python/run_pytest.sh EXTENSION LIBFORKSAFE: runs python/tests with pytest on Debian's
# /usr/bin/python3 (3.11, with python3-numpy and python3-pytest; `python3` on PATH may be a pyenv
# shim without them), on the forksafe package assembled in a temporary folder: python/forksafe,
# the extension as forksafe/_forksafe.so and libforksafe.so as forksafe/libforksafe.so.0 (the
# extension's RUNPATH has $ORIGIN). Writes pytest's JUnit XML where Bazel reads test results.
set -euo pipefail
PYTHON=/usr/bin/python3
ext="$1"
lib="$2"
if ! "$PYTHON" -c "import pytest" 2>/dev/null; then
  echo "python_test: $PYTHON cannot import pytest: run bash tools/install_deps.sh (python3-pytest)" >&2
  exit 1
fi
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/forksafe_python.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/forksafe"
cp -rL python/forksafe/. "$work/forksafe/"
cp -L "$ext" "$work/forksafe/_forksafe.so"
cp -L "$lib" "$work/forksafe/libforksafe.so.0"
echo "python_test: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])')), package in $work"
export PYTHONPATH="$work"
export PYTHONDONTWRITEBYTECODE=1
# Descriptor 3 is the test's real stderr, kept for conftest.py's watchdog (pytest captures 2).
exec 3>&2
export FORKSAFE_PYTEST_STACKS_FD=3
exec "$PYTHON" -m pytest -p no:cacheprovider -q -rs \
  ${XML_OUTPUT_FILE:+--junitxml="$XML_OUTPUT_FILE"} python/tests
