#!/bin/bash
# Runs the CUDA backend's tests against the fake driver (tests/device/fake_cuda_driver.cc):
# $1 is the test binary, $2 the fake library; it is offered to the backend's dlopen as
# libcuda.so.1 through LD_LIBRARY_PATH. Host memory only: no GPU is used or needed.
set -euo pipefail
test_bin="$1"
fake_lib="$2"
shift 2
dir="${TEST_TMPDIR:-$(mktemp -d)}/fake_cuda"
mkdir -p "$dir"
cp -f "$fake_lib" "$dir/libcuda.so.1"
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FAKE_CUDA_DEVICES="${FAKE_CUDA_DEVICES:-1}"
exec "$test_bin" "$@"
