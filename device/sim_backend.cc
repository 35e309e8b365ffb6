// device/sim_backend.cc: the simulated accelerator as a Backend (device/sim_backend.h):
// initialization, allocation, copies, memsets, kernels and foreign memory. Its interprocess side
// is in device/internal/sim_ipc.cc, its context in device/internal/sim_context.cc.
#include "forksafe/device/sim_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/sim_context.h"
#include "forksafe/device/registry.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/internal/memory_bounds.h"
#include "forksafe/runtime/internal/random.h"

namespace forksafe::device {

// Registers itself with the device registry at load time (this library is alwayslink).
FORKSAFE_REGISTER_BACKEND(DeviceType::kSimAccel, SimBackend);

using internal::SimBlock;
using internal::SimContext;
using internal::SimDeviceMemory;
using internal::SimSegment;
using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

SimBackend::SimBackend() = default;

SimBackend::~SimBackend() {
  // Backends live for the whole process; the context (and its device thread) is never torn down.
}

int SimBackend::DeviceCount() const {
  // Once the context exists its device list is fixed, whatever the environment says later.
  if (state() == BackendState::kReady || state() == BackendState::kPoisoned) {
    return ctx_ != nullptr ? ctx_->num_devices : 0;
  }
  return internal::SimDeviceCount();
}

DeviceProperties SimBackend::Properties(int index) const {
  CheckIndex(index, "Properties");
  DeviceProperties p;
  p.name = absl::StrCat("forksafe simulated accelerator ", index);
  p.total_memory = (ctx_ != nullptr && state() != BackendState::kUninitialized)
                       ? ctx_->capacity
                       : internal::SimMemoryBytes();
  p.host_accessible = false;
  p.supports_ipc = true;
  return p;
}

void SimBackend::DoInitialize() {
  auto ctx = std::make_unique<SimContext>();
  ctx->owner = getpid();
  const int n = DeviceCount();
  const size_t size = internal::SimMemoryBytes();
  internal::SimIpcEvents();  // a bad setting is an error now, not at the first event
  ctx->num_devices = n;
  ctx->capacity = size;
  {
    MutexLock lk(&ctx->mem_mu);  // no other thread sees the context yet: uncontended
    ctx->devices.resize(n);
    ctx->event_pools.resize(n);
    for (int i = 0; i < n; ++i) ctx->devices[i].capacity = size;
  }
  SimContext* raw = ctx.get();
  ctx->device_thread = std::thread([raw] { raw->Run(); });
  ctx_ = ctx.release();
  // Like a GPU context torn down at exit, queued work finishes when the process exits normally,
  // so memory exported just before exit() holds what was written to it. (_exit and signals skip
  // this; importers waiting on its events then get kProcessFailed.)
  static SimContext* at_exit_ctx = nullptr;
  at_exit_ctx = raw;
  static const bool registered = [] {
    std::atexit([] {
      SimContext* c = at_exit_ctx;
      if (c != nullptr && c->owner == getpid()) c->WaitAll();
    });
    return true;
  }();
  (void)registered;
  // What the context keeps for the life of the process (its event pages and the mappings of
  // segments still in use or cached), and its caches for runtime::ReleaseCachedResources().
  // Nothing in a forked child: the inherited context's locks may be held by threads that are gone.
  runtime::internal::RegisterKeptResources(
      "sim_backend",
      [raw](runtime::internal::KeptResources& k) {
        if (raw->owner != getpid()) return;
        MutexLock lk(&raw->mem_mu);
        auto page = [&k](const internal::SimEventPage& p) {
          k.AddFd(p.fd, "simulated accelerator's event page");
          const auto start = reinterpret_cast<uintptr_t>(p.words);
          k.mappings.push_back(
              {{start, start + internal::kEventPageBytes}, "simulated accelerator's event page"});
        };
        for (const auto& pool : raw->event_pools) {
          if (pool.page != nullptr) page(*pool.page);
        }
        for (const auto& [id, p] : raw->peer_pages) page(*p);
        for (const auto& dev : raw->devices) {
          for (const auto& [va, seg] : dev.segments) {
            k.AddFd(seg->fd, "simulated accelerator's segment in use");
            const auto start = reinterpret_cast<uintptr_t>(seg->host);
            k.mappings.push_back(
                {{start, start + seg->size}, "simulated accelerator's segment in use"});
          }
        }
      },
      [raw] {
        if (raw->owner != getpid()) return;
        raw->WaitAll();
        MutexLock lk(&raw->mem_mu);
        for (auto& dev : raw->devices) {
          raw->ReclaimParked(dev);
          raw->ReleaseFreeSegments(dev);
        }
      });
}

void* SimBackend::DoAllocate(int index, size_t bytes) {
  const size_t need = runtime::internal::RoundUpOrThrow(bytes, internal::kAlign, "sim");
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  if (need <= dev.capacity) {
    if (void* p = ctx_->Carve(index, dev, need)) return p;
    ctx_->ReclaimParked(dev);
    if (void* p = ctx_->Carve(index, dev, need)) return p;
  }
  const size_t seg_size = need <= internal::kSmallMax ? internal::kGranularity
                                                      : runtime::internal::RoundUpOrThrow(
                                                            need, internal::kGranularity, "sim");
  ctx_->Reserve(index, dev, seg_size, bytes);
  // The segment is reserved with fallocate: check what the host can give first.
  runtime::internal::CheckMemoryAvailable(seg_size, runtime::internal::MemoryUse::kShared,
                                          absl::StrCat("sim:", index, ": Allocate"));
  const int fd = SimContext::CreateMemfd(index, internal::kSegmentName, seg_size);
  SimSegment* seg =
      ctx_->AddSegment(index, dev, SimSegment::kOwn, fd, seg_size, runtime::internal::RandomId());
  dev.reserved += seg_size;
  seg->free_blocks[0] = seg_size;
  return ctx_->Carve(index, dev, need);
}

void SimBackend::DoFree(int index, void* ptr) {
  const uint64_t off = SimContext::Offset(index, ptr, "Free");
  ctx_->WaitAll();  // like cudaFree: pending work completes first (its errors stay for Synchronize)
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  auto it = dev.blocks.find(off);
  if (it == dev.blocks.end() || it->second.parked) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Free: sim:", index, " offset ", off,
                             " is not the start of a live allocation (double free?)"));
  }
  if (it->second.seg->kind == SimSegment::kForeign) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Free: sim:", index, " offset ", off,
                             " was allocated with AllocateForeign; free it with FreeForeign"));
  }
  dev.in_use -= it->second.len;
  if (it->second.released) {
    it->second.parked = true;  // other processes may still read it: out of reuse until released
    return;
  }
  ctx_->ReturnBlock(dev, off);
}

void SimBackend::DoCopy(void* dst, Device dst_device, const void* src, Device src_device,
                        size_t bytes) {
  char* d = dst_device.type == DeviceType::kSimAccel
                ? ctx_->Translate(dst_device.index, dst, bytes, "Copy (destination)")
                : static_cast<char*>(dst);
  const char* s = src_device.type == DeviceType::kSimAccel
                      ? ctx_->Translate(src_device.index, src, bytes, "Copy (source)")
                      : static_cast<const char*>(src);
  // Synchronous, like cudaMemcpy: ordered after earlier work, returns when done.
  const uint64_t ticket = ctx_->Enqueue([d, s, bytes] { std::memmove(d, s, bytes); });
  ctx_->WaitFor(ticket);
  // An earlier failure (an interprocess wait whose producer died, a faulting kernel) means this
  // copy may have seen data the stream never finished writing: say so here, like a sticky error.
  ctx_->RaiseAsyncError();
}

void SimBackend::DoMemset(int index, void* ptr, int value, size_t bytes) {
  char* d = ctx_->Translate(index, ptr, bytes, "Memset");
  ctx_->Enqueue([d, value, bytes] { std::memset(d, value, bytes); });
}

void SimBackend::LaunchKernel(int index, void* ptr, size_t bytes,
                              std::function<void(void*, size_t)> kernel) {
  if (!kernel) {
    throw Error(ErrorCode::kInvalidArgument, "LaunchKernel: empty kernel");
  }
  CheckIndex(index, "LaunchKernel");
  Initialize();  // lazy init and the fork-poison check, like every operation
  char* view = ctx_->Translate(index, ptr, bytes, "LaunchKernel");
  ctx_->Enqueue([view, bytes, k = std::move(kernel)] { k(view, bytes); });
}

void SimBackend::DoSynchronize(int index) { ctx_->Drain(); }

size_t SimBackend::BytesInUse(int index) const {
  CheckIndex(index, "BytesInUse");
  if (state() != BackendState::kReady) return 0;
  MutexLock lk(&ctx_->mem_mu);
  return ctx_->devices[index].in_use;
}

size_t SimBackend::BytesReserved(int index) const {
  CheckIndex(index, "BytesReserved");
  if (state() != BackendState::kReady) return 0;
  MutexLock lk(&ctx_->mem_mu);
  return ctx_->devices[index].reserved;
}

void SimBackend::FinishQueuedWork() {
  if (state() == BackendState::kReady && ctx_ != nullptr && ctx_->owner == getpid()) {
    ctx_->WaitAll();
  }
}

pid_t SimBackend::context_owner() const { return ctx_ != nullptr ? ctx_->owner : 0; }

// The device thread, idle, is parked for the fork when that makes the fork quiet (no other
// thread left to run: runtime/at_fork.h, NoteThreadsParkedForFork); a parked device thread runs
// nothing queued meanwhile, until the parent callback (or a roll-back) lets it go.
void SimBackend::DoForkPrepare() {
  if (ctx_->owner == getpid()) ctx_->ParkForFork();
}

void SimBackend::DoForkParent() {
  if (ctx_->owner == getpid()) ctx_->UnparkAfterFork();
}

void* SimBackend::AllocateForeign(int index, size_t bytes) {
  CheckIndex(index, "AllocateForeign");
  Initialize();
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "AllocateForeign: size must be > 0");
  }
  const size_t size = runtime::internal::RoundUpOrThrow(bytes, internal::kAlign, "sim");
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  ctx_->Reserve(index, dev, size, bytes);
  runtime::internal::CheckMemoryAvailable(size, runtime::internal::MemoryUse::kShared,
                                          absl::StrCat("sim:", index, ": AllocateForeign"));
  const int fd = SimContext::CreateMemfd(index, internal::kForeignName, size);
  SimSegment* seg =
      ctx_->AddSegment(index, dev, SimSegment::kForeign, fd, size, runtime::internal::RandomId());
  dev.reserved += size;
  seg->live = 1;
  dev.blocks[seg->va] = SimBlock{size, seg, false, nullptr};
  dev.in_use += size;
  return SimContext::Pointer(index, seg->va);
}

void SimBackend::FreeForeign(int index, void* ptr) {
  CheckIndex(index, "FreeForeign");
  Initialize();
  const uint64_t off = SimContext::Offset(index, ptr, "FreeForeign");
  ctx_->WaitAll();
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  auto it = dev.blocks.find(off);
  if (it == dev.blocks.end() || it->second.seg->kind != SimSegment::kForeign) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("FreeForeign: sim:", index, " offset ", off,
                             " is not memory from AllocateForeign (or was freed already)"));
  }
  SimSegment* seg = it->second.seg;
  dev.in_use -= it->second.len;
  dev.blocks.erase(it);
  ctx_->DropSegment(dev, seg);  // importers keep their own mappings; new imports fail
}

}  // namespace forksafe::device
