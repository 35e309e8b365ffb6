#!/usr/bin/env bash
# python/run_pytest.sh EXTENSION LIBFORKSAFE SHM_MANAGER: runs python/tests with pytest on
# Debian's /usr/bin/python3 (3.11, with python3-numpy and python3-pytest; `python3` on PATH may be
# a pyenv shim without them), on the forksafe package assembled in a temporary folder by
# python/assemble_package.sh. Writes pytest's JUnit XML where Bazel reads test results.
set -euo pipefail
PYTHON=/usr/bin/python3
if ! "$PYTHON" -c "import pytest" 2>/dev/null; then
  echo "python_test: $PYTHON cannot import pytest: run bash tools/install_deps.sh (python3-pytest)" >&2
  exit 1
fi
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/forksafe_python.XXXXXX")"
trap 'rm -rf "$work"' EXIT
bash python/assemble_package.sh "$work" "$1" "$2" "$3"
echo "python_test: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])')), package in $work"
export PYTHONPATH="$work"
export PYTHONDONTWRITEBYTECODE=1
# Descriptor 3 is the test's real stderr, kept for conftest.py's watchdog (pytest captures 2).
exec 3>&2
export FORKSAFE_PYTEST_STACKS_FD=3
exec "$PYTHON" -m pytest -p no:cacheprovider -q -rs \
  ${XML_OUTPUT_FILE:+--junitxml="$XML_OUTPUT_FILE"} python/tests
