#!/usr/bin/env bash
# Installs the Debian 12 packages forksafe builds with, when any is missing. Safe to re-run.
# Needs root (or sudo); everything comes from Debian's archive (see docs/building.md).
set -euo pipefail

PACKAGES=(
  bazel-bootstrap    # Bazel 4.2.3 (WORKSPACE mode)
  bazel-rules-java   # the rules_java that Bazel 4.2.3 wants, as a local repository
  build-essential    # g++ 12
  libabsl-dev        # Abseil 20220623
  libtbb-dev         # oneTBB 2021.8
  libgtest-dev       # GoogleTest 1.12
  libbenchmark-dev   # Google Benchmark 1.7
  libdlpack-dev      # DLPack 0.6 headers
  libcereal-dev      # cereal 1.3: the value codec of mp/
  clang-14           # tools/fuzz.sh: the fuzz targets are built with clang
  libclang-rt-14-dev # tools/fuzz.sh: libFuzzer and the sanitizer runtimes
  clang-format-14    # tools/format.sh: the house format (.clang-format), checked by CI
  libomp-dev         # LLVM's OpenMP runtime: //tests/runtime:openmp_dlopen_llvm_test
  cmake              # tools/install.sh (the CMake package's version file), tools/consumers.sh
  pkgconf            # pkg-config: tools/consumers.sh builds a consumer with it
  python3            # /usr/bin/python3 (3.11): the Python package (//python) and its tests
  libpython3.11-dev  # Python.h, for the extension forksafe._forksafe
  pybind11-dev       # pybind11 2.10, the extension's binding library
  python3-pytest     # runs python/tests (python/run_pytest.sh)
  python3-numpy      # numpy arrays across forksafe (the Python package)
  python3-torch      # torch 1.13: the Python package's torch tests, openmp_torch_test, bench/peers,
                     # and torchrun (python3 -m torch.distributed.run) for the launcher tests
  openmpi-bin        # Open MPI's mpirun: //tests/mp:launchers_test (mp/launch.h)
  mpich              # MPICH's mpiexec (Hydra): //tests/mp:launchers_test
  gdb                # a hung test child's thread stacks (tests/support/child_process.h)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "forksafe: all build dependencies are installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "forksafe: missing packages: ${missing[*]}" >&2
    echo "forksafe: run this script as root (or install sudo) so that it can install them" >&2
    exit 1
  fi
fi

echo "forksafe: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
