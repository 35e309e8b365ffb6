#!/usr/bin/env bash
# The main demo: installs what is missing, builds, and runs examples/runtime_demo.
#   bash tools/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
exec bazel run --ui_event_filters=-info,-stdout,-stderr --noshow_progress //examples:runtime_demo
