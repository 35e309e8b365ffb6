#!/bin/bash
# tools/gpu/run.sh (copied to .gpu/run.sh by tools/gpu/bundle.sh): runs the CUDA tests and
# benchmarks of .gpu/ on a GPU machine, then the torch.multiprocessing peer (python3 with torch).
# "nobench" skips the benchmarks; REPEAT=N also repeats the CUDA tests N times. Each log goes to
# $OUT/logs.tgz ($OUT defaults to /tmp/out); the summary is printed.
cd "$(dirname "$0")"
G=$PWD
OUTF=${OUT:-/tmp/out}; OUT=/tmp/gpulogs; rm -rf $OUT; mkdir -p $OUT $OUTF
{
echo "== machine"; uname -r; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1
cat /etc/os-release | head -2
for l in libcuda.so.1 libnvidia-ml.so.1; do
  if ! ldconfig -p | grep -q "$l"; then
    p=$(find / -xdev -name "$l" 2>/dev/null | head -1); [ -z "$p" ] && p=$(find /usr/local/nvidia /usr/lib -name "$l" 2>/dev/null | head -1)
    echo "$l not in ldconfig; found at $p"; [ -n "$p" ] && EXTRA="$EXTRA:$(dirname $p)"
  else ldconfig -p | grep "$l" | head -1; fi
done
} 2>&1 | tee $OUT/env.txt
export LD_LIBRARY_PATH=$G/lib$EXTRA
ldd $G/bin/tests/mp/accel_ipc_test | grep "not found" | tee -a $OUT/env.txt
pass=0; fail=0
run() {  # name timeout cmd...
  local name=$1 t=$2; shift 2
  echo "== $name ($(date +%T))"
  local s=$(date +%s.%N)
  timeout -k 5 $t "$@" > $OUT/$name.log 2>&1; local rc=$?
  local e=$(date +%s.%N)
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]|leak check|Failure|rror" $OUT/$name.log | head -60
  printf '== %s rc=%d in %.1f s\n' $name $rc $(awk "BEGIN{print $e - $s}")
  if [ $rc -eq 0 ]; then pass=$((pass+1)); else fail=$((fail+1)); tail -40 $OUT/$name.log; fi
}
cd $G/bin
T=tests
run cuda_backend_test 240 $T/device/cuda_backend_test
run accel_ipc_test 300 $T/mp/accel_ipc_test
run sharing_test 240 $T/mp/sharing_test
run tensor_test 120 $T/device/tensor_test
run device_test 120 $T/device/device_test
[ -n "$REPEAT" ] && { run cuda_backend_test_repeat 300 $T/device/cuda_backend_test --gtest_repeat=$REPEAT; run accel_ipc_test_repeat 300 $T/mp/accel_ipc_test --gtest_filter=*cuda* --gtest_repeat=$REPEAT; }
[ "$1" != "nobench" ] && {
run cuda_ipc_benchmark 180 bench/cuda_ipc_benchmark --benchmark_min_time=0.2 --benchmark_repetitions=3 --benchmark_report_aggregates_only=false
run device_tensor_benchmark 120 bench/device_tensor_benchmark --benchmark_min_time=0.2
}
echo "$pass binaries passed, $fail failed"
nvidia-smi --query-gpu=memory.used --format=csv
[ "$1" != "nobench" ] && [ -f $G/cuda_round_trip_torch.py ] && { echo "== torch peer"; PYTHONUNBUFFERED=1 timeout -k 5 120 python3 $G/cuda_round_trip_torch.py 0.5 2>&1 | tee $OUT/torch_peer.log | tail -8; }
tar czf $OUTF/logs.tgz -C /tmp gpulogs
