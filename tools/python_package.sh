#!/usr/bin/env bash
# Builds the Python package from this checkout and assembles it in a folder that Debian's
# /usr/bin/python3 can import it from (docs/python.md, "From a checkout"):
#   bash tools/python_package.sh [DIR]      (default: python-package/ in the checkout)
# DIR/forksafe then holds python/forksafe/*.py, the extension _forksafe.so and libforksafe.so.0
# (the extension's RUNPATH has $ORIGIN). Use it with PYTHONPATH=DIR /usr/bin/python3. Installs
# the Debian packages it needs first (tools/install_deps.sh); re-running replaces the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-python-package}"
bash tools/install_deps.sh
echo "forksafe: building //python:_forksafe.so and //:libforksafe.so (optimized)"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! bazel build --compilation_mode=opt //python:_forksafe.so //:libforksafe.so >"$log" 2>&1; then
  grep -v "linux-sandbox" "$log" >&2
  echo "python_package.sh: the build failed (output above)" >&2
  exit 1
fi
bin="$(bazel info --compilation_mode=opt bazel-bin 2>/dev/null)"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"
rm -rf "$dest/forksafe"
mkdir -p "$dest/forksafe"
(cd python/forksafe && find . -name '*.py' -exec install -m 644 -D {} "$dest/forksafe/{}" \;)
install -m 755 "$bin/python/_forksafe.so" "$dest/forksafe/_forksafe.so"
install -m 755 "$bin/libforksafe.so" "$dest/forksafe/libforksafe.so.0"
echo "forksafe: the Python package is in $dest/forksafe; use it with"
echo "  PYTHONPATH=$dest /usr/bin/python3 -c 'import forksafe; print(forksafe.__version__)'"
