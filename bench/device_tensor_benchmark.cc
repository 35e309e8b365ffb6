// Queue round trips of accelerator tensors (device/ipc.h through mp/sharing.h), next to the same
// round trip of a CPU shared tensor measured in the same run:
//
//   bazel run //bench:device_tensor_benchmark
//
// An echo child (started with "spawn": a forked child could not touch the device) gets each
// tensor and puts it back; one iteration is put + get of the echo. The tensor is already on the
// device and already exported once (its holder count exists), as in a training loop that passes
// the same buffers around. CUDA rows report "skipped: no CUDA device" where there is no GPU.
// BM_CudaTensorSendAck answers with a number instead of the tensor: the loop that
// bench/peers/cuda_round_trip_torch.py runs with torch.multiprocessing, for a ratio.
#include <cstdio>
#include <map>
#include <string>

#include "benchmark/benchmark.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/tensor.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/runtime/error.h"

namespace {

using forksafe::device::DType;
using forksafe::device::Tensor;
using forksafe::mp::Process;
using forksafe::mp::ProcessOptions;
using forksafe::mp::Queue;

void DeviceTensorEcho(Queue in, Queue out) {
  for (;;) {
    Tensor t = in.get<Tensor>();
    if (t.numel() == 0) return;
    out.put(t);
  }
}
FORKSAFE_ENTRY_POINT(DeviceTensorEcho);

// Gets each tensor and answers with its element count, not the tensor: the shape of the loop
// torch.multiprocessing can run (it refuses to send a received CUDA tensor on).
void DeviceTensorAck(Queue in, Queue out) {
  for (;;) {
    Tensor t = in.get<Tensor>();
    if (t.numel() == 0) return;
    out.put(t.numel());
  }
}
FORKSAFE_ENTRY_POINT(DeviceTensorAck);

constexpr double kGetSeconds = 60.0;  // a dead child fails the benchmark instead of hanging it

// One iteration: put the tensor, get the echo (the tensor itself, or an ack when `ack`).
void RoundTrips(benchmark::State& state, const std::string& device, bool ack) {
  const forksafe::device::Device dev = forksafe::device::ParseDevice(device);
  if (forksafe::device::DeviceCount(dev.type) <= dev.index) {
    state.SkipWithError(("skipped: no " + device + " device on this machine").c_str());
    return;
  }
  const int64_t n = state.range(0) / 4;
  Queue to, from;
  Process child(ProcessOptions{"", false, "spawn"}, ack ? &DeviceTensorAck : &DeviceTensorEcho, to,
                from);
  child.start();
  Tensor t =
      dev.is_cpu() ? forksafe::mp::SharedEmpty({n}) : Tensor::Zeros({n}, DType::kFloat32, dev);
  auto back = [&] {
    if (ack) {
      benchmark::DoNotOptimize(from.get<int64_t>(true, kGetSeconds));
    } else {
      benchmark::DoNotOptimize(from.get<Tensor>(true, kGetSeconds));
    }
  };
  try {
    to.put(t);  // warm: the child maps the segment once
    back();
    for (auto _ : state) {
      to.put(t);
      back();
    }
    to.put(Tensor::Empty({0}, DType::kFloat32, forksafe::device::kCPU));
    child.join(10.0);
  } catch (const forksafe::runtime::Error& e) {
    state.SkipWithError(e.what());
    child.kill();
    child.join(10.0);
    return;
  }
  state.SetLabel(device + " " + std::to_string(state.range(0) / 1024) + " KiB" +
                 (ack ? " (ack)" : ""));
}

void BM_CpuSharedTensorRoundTrip(benchmark::State& state) { RoundTrips(state, "cpu", false); }
void BM_SimTensorRoundTrip(benchmark::State& state) { RoundTrips(state, "sim:0", false); }
void BM_CudaTensorRoundTrip(benchmark::State& state) { RoundTrips(state, "cuda:0", false); }
void BM_CudaTensorSendAck(benchmark::State& state) { RoundTrips(state, "cuda:0", true); }

BENCHMARK(BM_CpuSharedTensorRoundTrip)
    ->Arg(4 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(3);
BENCHMARK(BM_SimTensorRoundTrip)
    ->Arg(4 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(3);
BENCHMARK(BM_CudaTensorRoundTrip)
    ->Arg(4 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(3);
BENCHMARK(BM_CudaTensorSendAck)
    ->Arg(4 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(3);

}  // namespace

int main(int argc, char** argv) {
  forksafe::mp::InitMain(argc, argv);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
