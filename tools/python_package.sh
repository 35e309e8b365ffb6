#!/usr/bin/env bash
# Builds the Python package from this checkout and assembles it in a folder that Debian's
# /usr/bin/python3 can import it from (docs/python.md, "From a checkout"):
#   bash tools/python_package.sh [DIR]      (default: python-package/ in the checkout)
# DIR/forksafe then holds python/forksafe/*.py, the extension _forksafe.so, libforksafe.so.0 (the
# extension's RUNPATH has $ORIGIN) and forksafe-shm-manager (python/assemble_package.sh). Use it
# with PYTHONPATH=DIR /usr/bin/python3. Installs
# the Debian packages it needs first (tools/install_deps.sh); re-running replaces the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-python-package}"
bash tools/install_deps.sh
echo "forksafe: building //python:_forksafe.so, //:libforksafe.so and //mp:forksafe-shm-manager (optimized)"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! bazel build --compilation_mode=opt //python:_forksafe.so //:libforksafe.so \
    //mp:forksafe-shm-manager >"$log" 2>&1; then
  grep -v "linux-sandbox" "$log" >&2
  echo "python_package.sh: the build failed (output above)" >&2
  exit 1
fi
bin="$(bazel info --compilation_mode=opt bazel-bin 2>/dev/null)"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"
bash python/assemble_package.sh "$dest" "$bin/python/_forksafe.so" "$bin/libforksafe.so" \
  "$bin/mp/forksafe-shm-manager"
echo "forksafe: the Python package is in $dest/forksafe; use it with"
echo "  PYTHONPATH=$dest /usr/bin/python3 -c 'import forksafe; print(forksafe.__version__)'"
