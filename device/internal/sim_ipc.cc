// device/internal/sim_ipc.cc: the simulated accelerator's interprocess interface (IpcBackend of
// device/sim_backend.h): exporting and importing segments and legacy memory, holds after free,
// interprocess events over shared pages, the machine-wide memory count and EmptyCache.
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/sim_context.h"
#include "forksafe/device/sim_backend.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/process_liveness.h"

namespace forksafe::device {

using internal::SimContext;
using internal::SimDeviceMemory;
using internal::SimSegment;
using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

IpcMemoryHandle SimBackend::ExportMemory(int index, const void* ptr, size_t bytes) {
  CheckIndex(index, "ExportMemory");
  Initialize();
  ctx_->Translate(index, ptr, bytes, "ExportMemory");  // inside a live block or an import
  const uint64_t off = SimContext::Offset(index, ptr, "ExportMemory");
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  SimSegment* seg = ctx_->SegmentAt(dev, off);
  if (seg->kind == SimSegment::kForeign) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ExportMemory: sim:", index, " offset ", off,
                             " is not from forksafe's allocator (AllocateForeign: a framework's "
                             "own memory); share it with ExportLegacyMemory, whose exporter must "
                             "keep it alive"));
  }
  IpcMemoryHandle h;
  h.device = Device(DeviceType::kSimAccel, index);
  h.kind = IpcKind::kSegment;
  h.fd = fcntl(seg->fd, F_DUPFD_CLOEXEC, 0);
  if (h.fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      throw Error(ErrorCode::kResourceExhausted, "ExportMemory: out of file descriptors");
    }
    runtime::ThrowSystemError("ExportMemory: dup", err);
  }
  h.segment_id = seg->id;
  h.segment_size = seg->size;
  h.offset = off - seg->va;
  h.size = bytes;
  h.exporter = getpid();
  return h;
}

IpcMemoryHandle SimBackend::ExportLegacyMemory(int index, const void* ptr, size_t bytes) {
  CheckIndex(index, "ExportLegacyMemory");
  Initialize();
  ctx_->Translate(index, ptr, bytes, "ExportLegacyMemory");
  const uint64_t off = SimContext::Offset(index, ptr, "ExportLegacyMemory");
  MutexLock lk(&ctx_->mem_mu);
  SimSegment* seg = ctx_->SegmentAt(ctx_->devices[index], off);
  if (seg->kind != SimSegment::kForeign) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ExportLegacyMemory: sim:", index, " offset ", off,
                             " is memory of forksafe's allocator (or an import); share it with "
                             "ExportMemory, which needs no keep-alive rule"));
  }
  IpcMemoryHandle h;
  h.device = Device(DeviceType::kSimAccel, index);
  h.kind = IpcKind::kLegacy;
  h.segment_id = seg->id;
  h.segment_size = seg->size;
  h.offset = off - seg->va;
  h.size = bytes;
  h.exporter = getpid();
  const int32_t fdnum = seg->fd;  // the legacy handle: where the exporter holds the memory
  std::memcpy(h.opaque.data(), &fdnum, sizeof fdnum);
  return h;
}

void* SimBackend::ImportMemory(const IpcMemoryHandle& h) {
  if (h.device.type != DeviceType::kSimAccel) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ImportMemory: the handle describes ", h.device.ToString(),
                             " memory, not sim memory"));
  }
  const int index = h.device.index;
  CheckIndex(index, "ImportMemory");
  Initialize();
  if (h.size == 0 || h.segment_size == 0 || h.offset > h.segment_size ||
      h.size > h.segment_size - h.offset) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat("ImportMemory: malformed handle: a range of ", h.size, " bytes at offset ",
                     h.offset, " of a segment of ", h.segment_size, " bytes"));
  }
  {
    MutexLock lk(&ctx_->mem_mu);
    SimDeviceMemory& dev = ctx_->devices[index];
    auto known = dev.by_id.find(h.segment_id);
    if (known != dev.by_id.end()) {  // mapped here already (ours, or imported before)
      SimSegment* seg = known->second;
      if (seg->size != h.segment_size) {
        throw Error(ErrorCode::kInvalidArgument,
                    "ImportMemory: malformed handle: segment size does not match the segment");
      }
      ++seg->imports;
      return SimContext::Pointer(index, seg->va + h.offset);
    }
  }
  // A segment new to this process: open and check it before mapping anything.
  int fd = -1;
  const char* prefix = nullptr;
  if (h.kind == IpcKind::kSegment) {
    if (h.fd < 0) {
      throw Error(ErrorCode::kInvalidArgument, "ImportMemory: malformed handle: no descriptor");
    }
    prefix = internal::kSegmentName;
    fd = fcntl(h.fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        throw Error(ErrorCode::kResourceExhausted, "ImportMemory: out of file descriptors");
      }
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ImportMemory: malformed handle: bad descriptor ", h.fd));
    }
  } else if (h.kind == IpcKind::kLegacy) {
    prefix = internal::kForeignName;
    int32_t fdnum = -1;
    std::memcpy(&fdnum, h.opaque.data(), sizeof fdnum);
    const std::string rule =
        " (memory not allocated by forksafe is shared through a legacy handle, which is valid "
        "only while its producer keeps the tensor alive)";
    if (h.exporter <= 0 || runtime::internal::ProcessExited(h.exporter)) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("ImportMemory: the process that exported this legacy handle (pid ",
                               h.exporter, ") has exited", rule));
    }
    fd = open(absl::StrCat("/proc/", h.exporter, "/fd/", fdnum).c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("ImportMemory: the memory behind this legacy handle was freed by "
                               "its producer (pid ",
                               h.exporter, ")", rule));
    }
  } else {
    throw Error(ErrorCode::kInvalidArgument, "ImportMemory: malformed handle: unknown kind");
  }
  size_t named = 0;
  struct stat st;
  if (!internal::ParseSimMemfd(internal::FdTarget(absl::StrCat("/proc/self/fd/", fd)), prefix,
                               index, &named) ||
      fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != h.segment_size ||
      named != h.segment_size) {
    close(fd);
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ImportMemory: malformed handle: the descriptor is not a sim:", index,
                             " segment of ", h.segment_size, " bytes"));
  }
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  auto known = dev.by_id.find(h.segment_id);  // another thread may have mapped it meanwhile
  if (known != dev.by_id.end()) {
    close(fd);
    ++known->second->imports;
    return SimContext::Pointer(index, known->second->va + h.offset);
  }
  SimSegment* seg =
      ctx_->AddSegment(index, dev, SimSegment::kImported, fd, h.segment_size, h.segment_id);
  seg->imports = 1;
  return SimContext::Pointer(index, seg->va + h.offset);
}

void SimBackend::ReleaseImported(int index, void* ptr) {
  CheckIndex(index, "ReleaseImported");
  Initialize();
  const uint64_t off = SimContext::Offset(index, ptr, "ReleaseImported");
  ctx_->WaitAll();  // queued work may still use the mapping
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  SimSegment* seg = ctx_->SegmentAt(dev, off);
  if (seg == nullptr || seg->imports == 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ReleaseImported: sim:", index, " offset ", off,
                             " is not imported memory (or was released already)"));
  }
  if (--seg->imports == 0 && seg->kind == SimSegment::kImported) ctx_->DropSegment(dev, seg);
}

void SimBackend::HoldAfterFree(int index, const void* ptr, std::function<bool()> released) {
  CheckIndex(index, "HoldAfterFree");
  Initialize();
  if (!released) throw Error(ErrorCode::kInvalidArgument, "HoldAfterFree: empty predicate");
  const uint64_t off = SimContext::Offset(index, ptr, "HoldAfterFree");
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  auto it = dev.blocks.find(off);
  if (it == dev.blocks.end() || it->second.parked || it->second.seg->kind != SimSegment::kOwn) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("HoldAfterFree: sim:", index, " offset ", off,
                             " is not the start of a live block of forksafe's allocator"));
  }
  if (it->second.released) {
    it->second.released = [a = std::move(it->second.released), b = std::move(released)] {
      return a() && b();
    };
  } else {
    it->second.released = std::move(released);
  }
}

IpcEventHandle SimBackend::RecordIpcEvent(int index) {
  CheckIndex(index, "RecordIpcEvent");
  Initialize();
  IpcEventHandle e;
  e.exporter = getpid();
  MutexLock lk(&ctx_->mem_mu);
  internal::SimEventPool& pool = ctx_->EventPool(index);
  if (pool.capacity == 0) {  // no event to be had: synchronize instead
    lk.Unlock();
    ctx_->WaitAll();
    e.complete = true;
    return e;
  }
  const uint32_t slot = pool.next++ % static_cast<uint32_t>(pool.capacity);
  const uint32_t seq = ++pool.sequence[slot];
  uint32_t* word = &pool.page->words[slot];
  std::shared_ptr<internal::SimEventPage> page = pool.page;
  e.complete = false;
  e.fd = page->fd;
  e.pool_id = page->id;
  e.slot = slot;
  e.sequence = seq;
  lk.Unlock();
  // Recordings of one slot are enqueued in sequence order (under mem_mu above, then here in the
  // same order per thread; across threads a later sequence may be stored first, which only makes
  // a waiter wait for more work, never less).
  auto complete = [page, word, seq] {
    uint32_t cur = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    while (
        static_cast<int32_t>(seq - cur) > 0 &&
        !__atomic_compare_exchange_n(word, &cur, seq, false, __ATOMIC_RELEASE, __ATOMIC_ACQUIRE)) {
    }
    internal::Futex(word, FUTEX_WAKE, INT_MAX, nullptr);
  };
  {
    // An idle stream has nothing for the event to follow: complete it here and spare the device
    // thread a wake-up (the common case of sending a tensor whose writes are long done).
    MutexLock q(&ctx_->q_mu);
    if (ctx_->completed == ctx_->submitted) {
      complete();
      return e;
    }
  }
  ctx_->Enqueue(std::move(complete));
  return e;
}

void SimBackend::WaitIpcEvent(int index, const IpcEventHandle& e) {
  CheckIndex(index, "WaitIpcEvent");
  Initialize();
  if (e.complete) return;
  if (e.slot >= static_cast<uint32_t>(internal::kMaxEvents)) {
    throw Error(ErrorCode::kInvalidArgument, "WaitIpcEvent: malformed event: slot out of range");
  }
  std::shared_ptr<internal::SimEventPage> page;
  {
    MutexLock lk(&ctx_->mem_mu);
    for (auto& pool : ctx_->event_pools) {
      if (pool.page != nullptr && pool.page->id == e.pool_id) return;  // our own stream: ordered
    }
    auto it = ctx_->peer_pages.find(e.pool_id);
    if (it != ctx_->peer_pages.end()) page = it->second;
  }
  if (page == nullptr) {
    if (e.fd < 0) {
      throw Error(ErrorCode::kInvalidArgument, "WaitIpcEvent: malformed event: no descriptor");
    }
    const std::string target = internal::FdTarget(absl::StrCat("/proc/self/fd/", e.fd));
    if (target.rfind(absl::StrCat("/memfd:", internal::kEventName), 0) != 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "WaitIpcEvent: malformed event: the descriptor is not a sim event page");
    }
    auto fresh = std::make_shared<internal::SimEventPage>();
    fresh->fd = fcntl(e.fd, F_DUPFD_CLOEXEC, 0);
    if (fresh->fd < 0) runtime::ThrowSystemError("WaitIpcEvent: dup", errno);
    void* p =
        mmap(nullptr, internal::kEventPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fresh->fd, 0);
    if (p == MAP_FAILED) runtime::ThrowSystemError("WaitIpcEvent: mapping the event page", errno);
    fresh->words = static_cast<uint32_t*>(p);
    fresh->id = e.pool_id;
    MutexLock lk(&ctx_->mem_mu);
    if (ctx_->peer_pages.size() >= 256) ctx_->peer_pages.erase(ctx_->peer_pages.begin());
    page = ctx_->peer_pages.emplace(e.pool_id, fresh).first->second;
  }
  uint32_t* word = &page->words[e.slot];
  const uint32_t seq = static_cast<uint32_t>(e.sequence);
  const pid_t exporter = e.exporter;
  // Already complete (the producer's stream was idle, or has caught up): nothing to wait for.
  if (static_cast<int32_t>(__atomic_load_n(word, __ATOMIC_ACQUIRE) - seq) >= 0) return;
  ctx_->Enqueue([page, word, seq, exporter] {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const uint32_t cur = __atomic_load_n(word, __ATOMIC_ACQUIRE);
      if (static_cast<int32_t>(cur - seq) >= 0) return;
      if (runtime::internal::ProcessExited(exporter)) {
        if (static_cast<int32_t>(__atomic_load_n(word, __ATOMIC_ACQUIRE) - seq) >= 0) return;
        throw Error(ErrorCode::kProcessFailed,
                    absl::StrCat("the process that produced this memory (pid ", exporter,
                                 ") exited before its work on it completed; the data may be "
                                 "incomplete"));
      }
      if (std::chrono::steady_clock::now() - start > internal::kEventWaitLimit) {
        throw Error(ErrorCode::kDeadlineExceeded,
                    absl::StrCat("waited 120 s for work of pid ", exporter,
                                 " on shared memory to complete"));
      }
      const timespec tick{0, 20 * 1000 * 1000};
      internal::Futex(word, FUTEX_WAIT, cur, &tick);
    }
  });
}

IpcMemoryInfo SimBackend::MemoryInfo(int index) {
  CheckIndex(index, "MemoryInfo");
  Initialize();
  IpcMemoryInfo info;
  info.total = ctx_->capacity;
  const size_t used = internal::MachineWideBytes(index);
  info.free = used < info.total ? info.total - used : 0;
  return info;
}

void SimBackend::EmptyCache(int index) {
  CheckIndex(index, "EmptyCache");
  Initialize();
  ctx_->WaitAll();
  MutexLock lk(&ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  ctx_->ReclaimParked(dev);
  ctx_->ReleaseFreeSegments(dev);
}

int SimBackend::IpcEventPoolCapacity(int index) const {
  CheckIndex(index, "IpcEventPoolCapacity");
  return internal::SimIpcEvents();
}

}  // namespace forksafe::device
