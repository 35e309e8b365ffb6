#!/bin/bash
# tools/gpu/bundle.sh: packs the CUDA tests and benchmarks, built here, into .gpu/ (ignored by
# git) for a GPU machine that has a driver but no Bazel or Debian packages (the device machines
# of this workplace run Ubuntu 24.04: binaries built on Debian 12 run there).
#
#   bash tools/gpu/bundle.sh          # builds, then fills .gpu/ (about 21 MiB)
#   # on the GPU machine, from the repository root:
#   bash .gpu/run.sh [nobench]        # tests, then benchmarks and the torch peer; logs in $OUT
#
# Needs the CUDA Toolkit's headers here (/usr/local/cuda or $FORKSAFE_CUDA_HOME): without them
# the backend has no driver code and the GPU tests would only check that they skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! grep -qx '/.gpu/' .git/info/exclude 2>/dev/null; then
  mkdir -p .git/info && echo '/.gpu/' >> .git/info/exclude
fi
tests="tests/device/cuda_backend_test tests/mp/accel_ipc_test tests/mp/sharing_test
       tests/device/tensor_test tests/device/device_test"
benches="bench/cuda_ipc_benchmark bench/device_tensor_benchmark"
targets=""
for t in $tests $benches; do targets="$targets //${t%/*}:${t##*/}"; done
bazel build $targets
rm -rf .gpu
mkdir -p .gpu/bin .gpu/lib
for t in $tests $benches; do
  mkdir -p ".gpu/bin/$(dirname "$t")"
  cp -L "bazel-bin/$t" ".gpu/bin/$t"
done
cp -rL bazel-bin/_solib_k8 .gpu/bin/_solib_k8   # our shared libraries (rpath $ORIGIN/../..)
for l in libtbb.so.12 libtbbmalloc.so.2 libbenchmark.so.1debian; do
  cp -L "/lib/x86_64-linux-gnu/$l" .gpu/lib/
done
cp tools/gpu/run.sh .gpu/run.sh
cp bench/peers/cuda_round_trip_torch.py .gpu/
du -sh .gpu
