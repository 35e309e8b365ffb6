#!/usr/bin/env bash
# Builds the framework program with g++ and pkg-config alone, from an installed forksafe
# (tools/install.sh).
#   bash examples/consumers/pkg-config/build.sh [OUTPUT]     (default: ./framework)
# For a prefix other than /usr/local or /usr, set PKG_CONFIG_PATH=<prefix>/lib/pkgconfig.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-framework}"
# -Wl,-rpath: the program finds libforksafe.so.0 in a prefix the dynamic loader does not search
# (also in its spawned children, which re-run this program).
g++ -std=c++17 -O2 -o "$out" "$here/../framework.cc" \
  $(pkg-config --cflags --libs forksafe) \
  -Wl,-rpath,"$(pkg-config --variable=libdir forksafe)"
