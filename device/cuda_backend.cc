// device/cuda_backend.cc: the CUDA backend as a Backend (device/cuda_backend.h): device
// queries, initialization, the descriptors and mappings it keeps, allocation, copies, memsets,
// synchronization and the exit drain; and the backend without devices of a build without the
// CUDA headers. Its other parts: device/internal/cuda_context.cc (per-device setup, streams),
// cuda_allocator.cc (the caching allocator), cuda_ipc.cc and cuda_ipc_events.cc (IpcBackend).
#include "forksafe/device/cuda_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/cuda_driver.h"
#include "forksafe/device/internal/cuda_state.h"
#include "forksafe/device/registry.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/kept_resources.h"

namespace forksafe::device {

// Registers itself with the device registry at load time (this library is alwayslink), in every
// build: without headers, driver or GPU it has no devices (and says why).
FORKSAFE_REGISTER_BACKEND(DeviceType::kCUDA, CudaBackend);

using runtime::Error;
using runtime::ErrorCode;

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

using internal::Block;
using internal::CudaContext;
using internal::CudaDriver;
using internal::Dev;
using internal::DeviceState;
using internal::DevPtr;
using internal::OpenDescriptors;
using internal::P;
using internal::SyncStream;
using internal::ThrowCu;
using runtime::internal::MutexLock;

namespace {

const char* const kKeptOwner = "device/cuda (driver descriptors)";

// Names the NVIDIA driver gives its descriptors and shared memory.
bool LooksLikeDriver(const std::string& path) {
  return path.rfind("/dev/nvidia", 0) == 0 || path.find("cuda") != std::string::npos ||
         path.find("nvidia") != std::string::npos;
}

// Shared mappings of this process ([start, end) -> path), as the tests' leak check sees them.
std::vector<std::pair<std::pair<uintptr_t, uintptr_t>, std::string>> SharedMappings() {
  std::vector<std::pair<std::pair<uintptr_t, uintptr_t>, std::string>> out;
  FILE* f = fopen("/proc/self/maps", "re");
  if (f == nullptr) return out;
  char line[1024];
  while (fgets(line, sizeof line, f) != nullptr) {
    unsigned long start = 0, end = 0;
    int path_at = 0;
    if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %n", &start, &end, &path_at) < 2) continue;
    std::string path(line + path_at);
    while (!path.empty() && (path.back() == '\n' || path.back() == ' ')) path.pop_back();
    if (path.rfind("/dev/", 0) == 0 || path.rfind("/memfd:", 0) == 0 ||
        path.rfind("/SYSV", 0) == 0) {
      out.push_back({{start, end}, path});
    }
  }
  fclose(f);
  return out;
}

}  // namespace

CudaBackend::CudaBackend() {
  // What the driver opens for itself (/dev/nvidia*, and what cuInit and the contexts opened) is
  // kept for the life of the process; ReleaseCachedResources empties the allocators' caches.
  runtime::internal::RegisterKeptResources(
      kKeptOwner,
      [this](runtime::internal::KeptResources& out) {
        const std::map<int, std::string> nvml = internal::NvmlKeptDescriptors();
        const bool ready = initialized() && ctx_ != nullptr;
        if (nvml.empty() && !ready) return;  // nothing of ours: no /proc scan
        const std::map<int, std::string> now = OpenDescriptors();
        // NVML's, from the device query (made without initializing CUDA).
        for (const auto& [fd, target] : nvml) {
          auto it = now.find(fd);
          if (it != now.end() && it->second == target) out.AddFd(fd, "device/cuda: NVML");
        }
        if (!ready) return;
        std::set<int> mine;
        {
          MutexLock lk(&ctx_->fds_mu);
          mine = ctx_->driver_fds;
        }
        for (const auto& [fd, target] : now) {
          if (mine.count(fd) != 0 || LooksLikeDriver(target)) {
            out.AddFd(fd, "device/cuda: the CUDA driver");
          }
        }
        // The shareable descriptors of exported segments and of imports (for passing them on).
        for (const auto& st : ctx_->devices) {
          MutexLock lk(&st->mu);
          for (const auto& [base, seg] : st->segments) {
            out.AddFd(seg->export_fd, "device/cuda: an exported segment");
          }
          for (const auto& [base, imp] : st->imports) {
            out.AddFd(imp->fd, "device/cuda: an imported segment");
          }
        }
        // Shared mappings the driver makes for itself (e.g. /dev/shm/cuda.shm.* of IPC events).
        for (const auto& [range, path] : SharedMappings()) {
          if (LooksLikeDriver(path)) {
            out.mappings.emplace_back(range, "device/cuda: the CUDA driver");
          }
        }
      },
      [this] {
        if (!initialized() || ctx_ == nullptr) return;
        for (size_t i = 0; i < ctx_->devices.size(); ++i) {
          try {
            if (ctx_->devices[i]->ready) EmptyCache(static_cast<int>(i));
          } catch (...) {
          }
        }
      });
}

CudaBackend::~CudaBackend() = default;  // registered backends live for the whole process

int CudaBackend::DeviceCount() const {
  return static_cast<int>(internal::QueryCudaDevices().devices.size());
}

std::string CudaBackend::UnavailableReason() const {
  const auto& s = internal::QueryCudaDevices();
  return s.devices.empty() ? absl::StrCat("no CUDA devices: ", s.why) : std::string();
}

DeviceProperties CudaBackend::Properties(int index) const {
  CheckIndex(index, "Properties");
  const auto& e = internal::QueryCudaDevices().devices[static_cast<size_t>(index)];
  DeviceProperties p;
  p.name = e.name.empty() ? "NVIDIA GPU" : e.name;
  p.total_memory = e.total_memory;
  p.host_accessible = false;
  p.supports_ipc = true;
  return p;
}

CudaBackend::CacheStats CudaBackend::Stats(int index) const {
  CacheStats s;
  if (!initialized() || ctx_ == nullptr || index < 0 ||
      index >= static_cast<int>(ctx_->devices.size())) {
    return s;
  }
  DeviceState& st = *ctx_->devices[static_cast<size_t>(index)];
  MutexLock lk(&st.mu);
  s.segments = st.segments.size();
  s.reserved_bytes = st.reserved_bytes;
  s.allocated_bytes = st.allocated_bytes;
  s.held_blocks = st.held.size();
  s.imported_segments = st.imports.size() - st.idle_imports.size();
  s.idle_imports = st.idle_imports.size();
  s.ipc_waits = st.waits.size();
  s.export_fds = st.kept_export_fds;
  return s;
}

void CudaBackend::DoInitialize() {
  // Runs under the base class's initialization lock, once per process.
  if (DeviceCount() == 0) throw Error(ErrorCode::kUnavailable, UnavailableReason());
  auto c = std::make_unique<CudaContext>();
  std::string why;
  const auto before = OpenDescriptors();
  c->d = internal::LoadCudaDriver(&why);
  if (c->d == nullptr) {
    throw Error(ErrorCode::kUnavailable, absl::StrCat("no CUDA devices: ", why));
  }
  int n = 0;
  const CUresult r = c->d->cuDeviceGetCount(&n);
  if (r != CUDA_SUCCESS) ThrowCu(*c->d, r, "cuDeviceGetCount");
  {
    MutexLock lk(&c->fds_mu);  // no other thread sees the context yet: uncontended
    for (const auto& [fd, target] : OpenDescriptors()) {
      if (before.count(fd) == 0) c->driver_fds.insert(fd);
    }
  }
  for (int i = 0; i < n; ++i) {
    c->devices.push_back(std::make_unique<DeviceState>());
    c->devices.back()->index = i;
  }
  c->owner = getpid();
  c->exit_fd = memfd_create("forksafe_cudaexit", MFD_CLOEXEC);
  if (c->exit_fd >= 0 && fchmod(c->exit_fd, 0600) == 0 && ftruncate(c->exit_fd, 4096) == 0) {
    void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, c->exit_fd, 0);
    if (p != MAP_FAILED) c->exit_word = static_cast<uint32_t*>(p);
  }
  ctx_ = c.release();  // lives for the process (and is abandoned, untouched, in forked children)
  RegisterExitDrain();
}

void CudaBackend::Enter(int index, const char* what) {
  CheckIndex(index, what);
  try {
    Initialize();
  } catch (const Error& e) {
    throw Error(e.code(), absl::StrCat(what, ": ", e.message()));
  }
}

void CudaBackend::RegisterExitDrain() {
  // Like the simulated accelerator: a normal exit finishes the work queued on every stream, then
  // says so in the exit page, so that a receiver of a tensor sent just before exit() knows the
  // data is complete even though the sender's IPC events died with it. (_exit and signals skip
  // this; receivers then report that the data may be incomplete. mp/ children call
  // FinishQueuedWork before their _exit.)
  static CudaContext* at_exit_ctx = nullptr;
  at_exit_ctx = ctx_;
  static const bool registered = [] {
    std::atexit([] { DrainAndMark(at_exit_ctx); });
    return true;
  }();
  (void)registered;
}

void CudaBackend::FinishQueuedWork() {
  if (state() == BackendState::kReady) DrainAndMark(ctx_);
}

void* CudaBackend::DoAllocate(int index, size_t bytes) {
  DeviceState& st = Dev(*ctx_, index);
  MutexLock lk(&st.mu);
  return AllocateLocked(ctx_->d, st, bytes);
}

void CudaBackend::DoFree(int index, void* ptr) {
  DeviceState& st = Dev(*ctx_, index);
  MutexLock lk(&st.mu);
  auto it = st.allocated.find(DevPtr(ptr));
  if (it == st.allocated.end()) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Free on cuda:", index, ": ", P(ptr),
                             " was not returned by Allocate on this device (or was freed "
                             "already); imports are released with ReleaseImported"));
  }
  Block* b = it->second;
  st.allocated.erase(it);
  st.allocated_bytes -= b->size;
  st.freed_sizes[b->addr()] = b->size;
  if (b->hold_on_free) {
    b->allocated = false;
    b->held = true;
    b->released = std::move(b->hold_on_free);
    b->hold_on_free = nullptr;
    st.held.push_back(b);
    return;
  }
  InsertFree(st, b);
}

void CudaBackend::DoCopy(void* dst, Device dst_device, const void* src, Device src_device,
                         size_t bytes) {
  const CudaDriver* d = ctx_->d;
  const bool dst_gpu = dst_device.type == DeviceType::kCUDA;
  const bool src_gpu = src_device.type == DeviceType::kCUDA;
  if (!dst_gpu && !src_gpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const int index = dst_gpu ? dst_device.index : src_device.index;
  if (dst_gpu && src_gpu && dst_device.index != src_device.index) {
    // Across devices: both streams' earlier work first, then a peer copy on the destination's.
    DeviceState& s = Dev(*ctx_, src_device.index);
    SyncStream(*ctx_, s, "Copy");
    DeviceState& t = Dev(*ctx_, dst_device.index);
    CUstream stream;
    {
      MutexLock lk(&t.mu);
      stream = t.stream;
    }
    FS_CU(d->cuMemcpyPeerAsync(DevPtr(dst), t.ctx, DevPtr(src), s.ctx, bytes, stream),
          absl::StrCat("Copy of ", bytes, " bytes from ", src_device.ToString(), " to ",
                       dst_device.ToString(), " (cuMemcpyPeerAsync)"));
    SyncStream(*ctx_, t, "Copy");
    return;
  }
  DeviceState& st = Dev(*ctx_, index);
  CUstream stream;
  {
    MutexLock lk(&st.mu);
    stream = st.stream;
  }
  CUresult r;
  const char* fn;
  if (dst_gpu && src_gpu) {
    r = d->cuMemcpyDtoDAsync(DevPtr(dst), DevPtr(src), bytes, stream);
    fn = "cuMemcpyDtoDAsync";
  } else if (dst_gpu) {
    r = d->cuMemcpyHtoDAsync(DevPtr(dst), src, bytes, stream);
    fn = "cuMemcpyHtoDAsync";
  } else {
    r = d->cuMemcpyDtoHAsync(dst, DevPtr(src), bytes, stream);
    fn = "cuMemcpyDtoHAsync";
  }
  if (r != CUDA_SUCCESS) {
    ThrowCu(*d, r,
            absl::StrCat("Copy of ", bytes, " bytes from ", src_device.ToString(), " to ",
                         dst_device.ToString(), " (", fn, ")"),
            "check that the device pointer lies inside memory of that device");
  }
  SyncStream(*ctx_, st, "Copy");
}

void CudaBackend::DoMemset(int index, void* ptr, int value, size_t bytes) {
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  CUstream stream;
  {
    MutexLock lk(&st.mu);
    stream = st.stream;
  }
  const CUresult r =
      d->cuMemsetD8Async(DevPtr(ptr), static_cast<unsigned char>(value), bytes, stream);
  if (r != CUDA_SUCCESS) {
    ThrowCu(*d, r, absl::StrCat("Memset of ", bytes, " bytes at ", P(ptr), " on cuda:", index),
            "check that the range lies inside memory of that device");
  }
}

void CudaBackend::DoSynchronize(int index) {
  DeviceState& st = Dev(*ctx_, index);
  SyncStream(*ctx_, st, "Synchronize");
}

#else  // !FORKSAFE_HAVE_CUDA_HEADERS: a backend without devices.

CudaBackend::CudaBackend() = default;
CudaBackend::~CudaBackend() = default;

int CudaBackend::DeviceCount() const { return 0; }

std::string CudaBackend::UnavailableReason() const {
  return absl::StrCat("no CUDA devices: ", internal::QueryCudaDevices().why);
}

DeviceProperties CudaBackend::Properties(int index) const {
  CheckIndex(index, "Properties");
  return {};
}

CudaBackend::CacheStats CudaBackend::Stats(int) const { return {}; }

void CudaBackend::DoInitialize() { throw Error(ErrorCode::kUnavailable, UnavailableReason()); }
void CudaBackend::FinishQueuedWork() {}

void CudaBackend::Enter(int index, const char* what) {
  CheckIndex(index, what);
  Initialize();
}

namespace {
[[noreturn]] void Unreachable(const CudaBackend& b) {
  throw Error(ErrorCode::kUnavailable, b.UnavailableReason());
}
}  // namespace

void* CudaBackend::DoAllocate(int, size_t) { Unreachable(*this); }
void CudaBackend::DoFree(int, void*) { Unreachable(*this); }
void CudaBackend::DoCopy(void*, Device, const void*, Device, size_t) { Unreachable(*this); }
void CudaBackend::DoMemset(int, void*, int, size_t) { Unreachable(*this); }
void CudaBackend::DoSynchronize(int) { Unreachable(*this); }
IpcMemoryHandle CudaBackend::ExportMemory(int index, const void*, size_t) {
  Enter(index, "ExportMemory");
  Unreachable(*this);
}
IpcMemoryHandle CudaBackend::ExportLegacyMemory(int index, const void*, size_t) {
  Enter(index, "ExportLegacyMemory");
  Unreachable(*this);
}
void* CudaBackend::ImportMemory(const IpcMemoryHandle& handle) {
  Enter(handle.device.index, "ImportMemory");
  Unreachable(*this);
}
void CudaBackend::ReleaseImported(int index, void*) {
  Enter(index, "ReleaseImported");
  Unreachable(*this);
}
void CudaBackend::HoldAfterFree(int index, const void*, std::function<bool()>) {
  Enter(index, "HoldAfterFree");
  Unreachable(*this);
}
IpcEventHandle CudaBackend::RecordIpcEvent(int index) {
  Enter(index, "RecordIpcEvent");
  Unreachable(*this);
}
void CudaBackend::WaitIpcEvent(int index, const IpcEventHandle&) {
  Enter(index, "WaitIpcEvent");
  Unreachable(*this);
}
IpcMemoryInfo CudaBackend::MemoryInfo(int index) {
  Enter(index, "MemoryInfo");
  Unreachable(*this);
}
void CudaBackend::EmptyCache(int index) {
  Enter(index, "EmptyCache");
  Unreachable(*this);
}

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

}  // namespace forksafe::device
