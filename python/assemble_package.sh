#!/usr/bin/env bash
# python/assemble_package.sh DEST EXTENSION LIBFORKSAFE SHM_MANAGER: lays out the forksafe Python
# package in DEST/forksafe, replacing what is there: python/forksafe/**.py, EXTENSION as
# _forksafe.so, LIBFORKSAFE as libforksafe.so.0 (the extension's RUNPATH has $ORIGIN) and
# SHM_MANAGER as forksafe-shm-manager (the file_system strategy's manager, found by the library
# beside libforksafe.so.0: mp/internal/shm_manager.h). The one layout of a package from a build:
# tools/python_package.sh, the python tests (python/run_pytest.sh) and bench/peers/run.sh use it.
# tools/install.sh lays out an install (libforksafe.so in <libdir>, the manager in
# <libdir>/forksafe/).
set -euo pipefail
if [ $# -ne 4 ]; then
  echo "usage: python/assemble_package.sh DEST EXTENSION LIBFORKSAFE SHM_MANAGER" >&2
  exit 2
fi
mkdir -p "$1"
dest="$(cd "$1" && pwd)/forksafe"
src="$(cd "$(dirname "$0")" && pwd)/forksafe"
for f in "$2" "$3" "$4"; do
  [ -f "$f" ] || { echo "assemble_package.sh: $f is missing (build it first)" >&2; exit 1; }
done
rm -rf "$dest"
mkdir -p "$dest"
(cd "$src" && find . -name '*.py' -exec install -m 644 -D {} "$dest/{}" \;)
install -m 755 "$2" "$dest/_forksafe.so"
install -m 755 "$3" "$dest/libforksafe.so.0"
install -m 755 "$4" "$dest/forksafe-shm-manager"
