// Benchmarks of the CUDA backend's IPC (device/cuda_backend.h, device/ipc.h):
//   - BM_ImportMapRelease/<bytes>: ImportMemory + ReleaseImported + EmptyCache of a segment
//     another process exported (cuMemImportFromShareableHandle, reserve, map, set access; then
//     synchronize, unmap and release: each iteration maps anew).
//   - BM_ImportIdleSegment/<bytes>: ImportMemory + ReleaseImported of the same segment with the
//     released import kept mapped (idle) between iterations, the backend's default.
//   - BM_ExportMemory/<bytes>: ExportMemory of an own block (the segment's descriptor is kept
//     after the first export; each call returns a duplicate), next to
//     BM_DriverExportToShareableHandle/<bytes>: the driver's export of the same allocation.
//   - BM_RecordIpcEvent: RecordIpcEvent on an idle stream (pooled event, cuEventRecord).
//   - BM_WaitIpcEventAndSync: WaitIpcEvent on an event another process recorded (opened once per
//     slot, then cached) followed by Synchronize.
// The exporter is a child forked before this process initializes CUDA; it exports its segments
// and events over a unix socket and waits until the benchmarks are done.
// On a machine without a GPU it prints why it skipped and exits 0.
#include <dlfcn.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "forksafe/device/cuda_backend.h"
#include "forksafe/device/registry.h"
#include "forksafe/runtime/error.h"
#include "tests/support/fd_passing.h"

namespace {

using forksafe::device::CudaBackend;
using forksafe::device::DeviceType;
using forksafe::device::IpcEventHandle;
using forksafe::device::IpcMemoryHandle;

constexpr size_t kSizes[] = {size_t{2} << 20, size_t{64} << 20, size_t{1} << 30};
constexpr int kEvents = CudaBackend::kIpcEventPoolCapacity;

CudaBackend& Cuda() {
  return static_cast<CudaBackend&>(forksafe::device::GetBackend(DeviceType::kCUDA));
}

struct Exported {
  std::vector<IpcMemoryHandle> segments;  // fds received here (ours to close)
  std::vector<IpcEventHandle> events;
};
Exported g_exported;

// The exporting process: segments and events, then it waits for EOF on `sock`.
[[noreturn]] void Exporter(int sock) {
  alarm(600);
  try {
    CudaBackend& b = Cuda();
    for (size_t n : kSizes) {
      void* p = b.Allocate(0, n);
      b.Memset(0, p, 1, n);
      IpcMemoryHandle h = b.ExportMemory(0, p, n);
      if (!forksafe::testing::SendWithFd(sock, h.fd, &h, sizeof h)) _exit(2);
      close(h.fd);
    }
    for (int i = 0; i < kEvents; ++i) {
      const IpcEventHandle e = b.RecordIpcEvent(0);
      if (write(sock, &e, sizeof e) != static_cast<ssize_t>(sizeof e)) _exit(3);
    }
    b.Synchronize(0);
  } catch (const std::exception& e) {
    fprintf(stderr, "exporter: %s\n", e.what());
    _exit(1);
  }
  char c;
  while (read(sock, &c, 1) > 0) {
  }
  _exit(0);
}

// ImportMemory + ReleaseImported of segment state.range(0); with `map_anew`, EmptyCache after
// each release unmaps the idle import so that every iteration maps the segment again.
void ImportAndRelease(benchmark::State& state, bool map_anew) {
  CudaBackend& b = Cuda();
  const IpcMemoryHandle& h = g_exported.segments[static_cast<size_t>(state.range(0))];
  for (auto _ : state) {
    void* p = b.ImportMemory(h);
    benchmark::DoNotOptimize(p);
    b.ReleaseImported(0, p);
    if (map_anew) b.EmptyCache(0);
  }
  b.EmptyCache(0);
  state.SetLabel(std::to_string(h.segment_size >> 20) + " MiB segment");
}

void BM_ImportMapRelease(benchmark::State& state) { ImportAndRelease(state, true); }
BENCHMARK(BM_ImportMapRelease)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);

// The idle import kept: the segment stays mapped between iterations, as when a training loop
// sends the same buffers again.
void BM_ImportIdleSegment(benchmark::State& state) { ImportAndRelease(state, false); }
BENCHMARK(BM_ImportIdleSegment)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);

// ExportMemory of a block of this process (+ close of the descriptor it returns). The first
// export of a segment asks the driver; later ones duplicate the descriptor kept then.
void BM_ExportMemory(benchmark::State& state) {
  CudaBackend& b = Cuda();
  const size_t n = kSizes[static_cast<size_t>(state.range(0))];
  void* p = b.Allocate(0, n);
  for (auto _ : state) {
    IpcMemoryHandle h = b.ExportMemory(0, p, n);
    close(h.fd);
  }
  b.Free(0, p);
  state.SetLabel(std::to_string(n >> 20) + " MiB block");
}
BENCHMARK(BM_ExportMemory)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);

// What each export would cost without that cache: the driver's own export of the same
// allocation (cuMemRetainAllocationHandle + cuMemExportToShareableHandle + close + cuMemRelease).
void BM_DriverExportToShareableHandle(benchmark::State& state) {
  CudaBackend& b = Cuda();
  const size_t n = kSizes[static_cast<size_t>(state.range(0))];
  void* p = b.Allocate(0, n);
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  using Retain = int (*)(unsigned long long*, void*);
  using Export = int (*)(void*, unsigned long long, int, unsigned long long);
  using Release = int (*)(unsigned long long);
  auto retain = lib ? reinterpret_cast<Retain>(dlsym(lib, "cuMemRetainAllocationHandle")) : nullptr;
  auto export_fd =
      lib ? reinterpret_cast<Export>(dlsym(lib, "cuMemExportToShareableHandle")) : nullptr;
  auto release = lib ? reinterpret_cast<Release>(dlsym(lib, "cuMemRelease")) : nullptr;
  if (!retain || !export_fd || !release) {
    state.SkipWithError(
        "libcuda.so.1 lacks cuMemRetainAllocationHandle/cuMemExportToShareableHandle");
    b.Free(0, p);
    return;
  }
  constexpr int kPosixFd = 1;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  for (auto _ : state) {
    unsigned long long h = 0;
    int fd = -1;
    if (retain(&h, p) != 0 || export_fd(&fd, h, kPosixFd, 0) != 0) {
      state.SkipWithError("the driver's export failed");
      break;
    }
    close(fd);
    release(h);
  }
  b.Free(0, p);
  state.SetLabel(std::to_string(n >> 20) + " MiB block");
}
BENCHMARK(BM_DriverExportToShareableHandle)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);

void BM_RecordIpcEvent(benchmark::State& state) {
  CudaBackend& b = Cuda();
  for (auto _ : state) benchmark::DoNotOptimize(b.RecordIpcEvent(0));
  b.Synchronize(0);
}
BENCHMARK(BM_RecordIpcEvent)->Unit(benchmark::kMicrosecond);

void BM_WaitIpcEventAndSync(benchmark::State& state) {
  CudaBackend& b = Cuda();
  size_t i = 0;
  for (auto _ : state) {
    b.WaitIpcEvent(0, g_exported.events[i++ % g_exported.events.size()]);
    b.Synchronize(0);
  }
}
BENCHMARK(BM_WaitIpcEventAndSync)->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  CudaBackend& b = Cuda();
  if (b.DeviceCount() == 0) {  // a query: CUDA is not initialized here
    printf("cuda_ipc_benchmark: skipped: %s\n", b.UnavailableReason().c_str());
    return 0;
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    perror("socketpair");
    return 1;
  }
  const pid_t pid = fork();  // before this process initializes CUDA
  if (pid == 0) {
    close(sv[0]);
    Exporter(sv[1]);
  }
  close(sv[1]);
  int rc = 0;
  for (size_t i = 0; i < sizeof kSizes / sizeof kSizes[0] && rc == 0; ++i) {
    IpcMemoryHandle h;
    const int fd = forksafe::testing::ReceiveWithFd(sv[0], &h, sizeof h);
    if (fd < 0) {
      fprintf(stderr, "cuda_ipc_benchmark: the exporter sent no segment (see its error above)\n");
      rc = 1;
      break;
    }
    h.fd = fd;
    g_exported.segments.push_back(h);
  }
  for (int i = 0; i < kEvents && rc == 0; ++i) {
    IpcEventHandle e;
    if (recv(sv[0], &e, sizeof e, MSG_WAITALL) != static_cast<ssize_t>(sizeof e)) rc = 1;
    g_exported.events.push_back(e);
  }
  if (rc == 0) {
    try {
      benchmark::RunSpecifiedBenchmarks();
    } catch (const forksafe::runtime::Error& e) {
      fprintf(stderr, "cuda_ipc_benchmark: %s\n", e.what());
      rc = 1;
    }
  }
  for (auto& h : g_exported.segments) close(h.fd);
  close(sv[0]);                    // the exporter exits on EOF
  for (int i = 0; i < 300; ++i) {  // bounded wait: 30 s
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return rc;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return rc;
}
