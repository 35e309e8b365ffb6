#!/usr/bin/env bash
# tools/format.sh [--check]: formats every C++ file of the repository (git ls-files *.h *.cc, but
# third_party/) with clang-format-14 and the repository's .clang-format. With --check it changes
# nothing: it lists the files that are not formatted, prints "format: PASSED" or "format: FAILED",
# and exits non-zero when any is not. Needs clang-format-14 (tools/install_deps.sh installs it).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
mode="${1:-apply}"
case "$mode" in apply|--check) ;; *) echo "usage: tools/format.sh [--check]" >&2; exit 2 ;; esac
if ! command -v clang-format-14 >/dev/null 2>&1; then
  echo "format: clang-format-14 is missing; run tools/install_deps.sh" >&2
  echo "format: FAILED"
  exit 2
fi
mapfile -t files < <(git ls-files '*.h' '*.cc' | grep -v '^third_party/')
if [ "$mode" = apply ]; then
  clang-format-14 -i "${files[@]}"
  echo "format: formatted ${#files[@]} files"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  if ! clang-format-14 --dry-run -Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if [ "${#bad[@]}" -gt 0 ]; then
  echo "format: ${#bad[@]} of ${#files[@]} files are not formatted (run bash tools/format.sh):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "format: FAILED"
  exit 1
fi
echo "format: ${#files[@]} files checked"
echo "format: PASSED"
