// Queue round trips of accelerator tensors (device/ipc.h through mp/sharing.h), next to the same
// round trip of a CPU shared tensor measured in the same run:
//
//   bazel run //bench:device_tensor_benchmark
//
// An echo child (started with "spawn": a forked child could not touch the device) gets each
// tensor and puts it back; one iteration is put + get of the echo. The tensor is already on the
// device and already exported once (its holder count exists), as in a training loop that passes
// the same buffers around. CUDA rows report "skipped: no CUDA device" where there is no GPU.
#include <cstdio>
#include <map>
#include <string>

#include "benchmark/benchmark.h"
#include "device/registry.h"
#include "device/tensor.h"
#include "mp/process.h"
#include "mp/queue.h"
#include "mp/sharing.h"

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

void RoundTrips(benchmark::State& state, const std::string& device) {
  const forksafe::device::Device dev = forksafe::device::ParseDevice(device);
  if (forksafe::device::DeviceCount(dev.type) <= dev.index) {
    state.SkipWithError(("skipped: no " + device + " device on this machine").c_str());
    return;
  }
  const int64_t n = state.range(0) / 4;
  Queue to, from;
  Process echo(ProcessOptions{"", false, "spawn"}, &DeviceTensorEcho, to, from);
  echo.start();
  Tensor t = dev.is_cpu() ? forksafe::mp::SharedEmpty({n})
                          : Tensor::Zeros({n}, DType::kFloat32, dev);
  to.put(t);  // warm: the echo child maps the segment once
  benchmark::DoNotOptimize(from.get<Tensor>());
  for (auto _ : state) {
    to.put(t);
    benchmark::DoNotOptimize(from.get<Tensor>());
  }
  to.put(Tensor::Empty({0}, DType::kFloat32, forksafe::device::kCPU));
  echo.join(10.0);
  state.SetLabel(device + " " + std::to_string(state.range(0) / 1024) + " KiB");
}

void BM_CpuSharedTensorRoundTrip(benchmark::State& state) { RoundTrips(state, "cpu"); }
void BM_SimTensorRoundTrip(benchmark::State& state) { RoundTrips(state, "sim:0"); }
void BM_CudaTensorRoundTrip(benchmark::State& state) { RoundTrips(state, "cuda:0"); }

BENCHMARK(BM_CpuSharedTensorRoundTrip)
    ->Arg(4 << 10)->Arg(1 << 20)->Arg(16 << 20)->UseRealTime()->MinTime(0.5)->Repetitions(3);
BENCHMARK(BM_SimTensorRoundTrip)
    ->Arg(4 << 10)->Arg(1 << 20)->Arg(16 << 20)->UseRealTime()->MinTime(0.5)->Repetitions(3);
BENCHMARK(BM_CudaTensorRoundTrip)
    ->Arg(4 << 10)->Arg(1 << 20)->Arg(16 << 20)->UseRealTime()->MinTime(0.5)->Repetitions(3);

}  // namespace

int main(int argc, char** argv) {
  forksafe::mp::InitMain(argc, argv);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
