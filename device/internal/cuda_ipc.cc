// device/internal/cuda_ipc.cc: the CUDA backend's memory across processes (IpcBackend of
// device/cuda_backend.h): exporting segments (with kept shareable descriptors) and legacy
// cudaMalloc memory, importing and releasing them, holds after free, MemoryInfo and EmptyCache.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/device/cuda_backend.h"
#include "forksafe/device/internal/cuda_driver.h"
#include "forksafe/device/internal/cuda_state.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/process_liveness.h"

namespace forksafe::device {

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

using internal::Block;
using internal::CudaDriver;
using internal::DeviceState;
using internal::DevPtr;
using internal::HostPtr;
using internal::P;
using internal::Segment;
using internal::ThrowCu;
using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

namespace {

uint64_t HashBytes(const void* p, size_t n) {  // FNV-1a: identity of a legacy handle
  uint64_t h = 1469598103934665603ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h == 0 ? 1 : h;
}

// A close-on-exec duplicate of `fd` for ExportMemory's caller to send; `whose` names the
// descriptor in the error (kResourceExhausted: out of descriptors).
int DupForExport(int fd, int index, const char* whose) {
  const int out = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (out < 0) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat("ExportMemory on cuda:", index, ": dup of ", whose, " failed (",
                             strerror(errno),
                             "); close unused descriptors or raise the limit (ulimit -n)"));
  }
  return out;
}

// Keeps `fd` as the segment's export descriptor; past kKeptExportFdsMax the least recently
// exported segment gives its up.
void KeepExportFd(DeviceState& st, Segment* seg, int fd) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
  if (st.kept_export_fds >= internal::kKeptExportFdsMax) {
    Segment* oldest = nullptr;
    for (const auto& [base, other] : st.segments) {
      if (other->export_fd >= 0 &&
          (oldest == nullptr || other->export_tick < oldest->export_tick)) {
        oldest = other;
      }
    }
    if (oldest != nullptr) {
      close(oldest->export_fd);
      oldest->export_fd = -1;
      --st.kept_export_fds;
    }
  }
  seg->export_fd = fd;
  seg->export_tick = ++st.export_clock;
  ++st.kept_export_fds;
}

}  // namespace

IpcMemoryHandle CudaBackend::ExportMemory(int index, const void* ptr, size_t bytes) {
  Enter(index, "ExportMemory");
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  const CUdeviceptr p = DevPtr(ptr);
  IpcMemoryHandle h;
  h.device = Device(DeviceType::kCUDA, index);
  h.kind = IpcKind::kSegment;
  h.size = bytes;
  h.exporter = getpid();
  CUmemGenericAllocationHandle alloc = 0;
  {
    MutexLock lk(&st.mu);
    Segment* seg = OwnSegmentOf(st, p, bytes);
    if (seg != nullptr) {
      auto it = st.allocated.upper_bound(p);
      const Block* b = it == st.allocated.begin() ? nullptr : std::prev(it)->second;
      const bool inside_block = b != nullptr && p >= b->addr() && p + bytes <= b->addr() + b->size;
      if (!inside_block && seg->own_imports == 0) {
        throw Error(ErrorCode::kInvalidArgument,
                    absl::StrCat("ExportMemory on cuda:", index, ": [", P(ptr), ", +", bytes,
                                 ") is not inside one allocated block (freed already?)"));
      }
      h.segment_id = seg->id;
      h.segment_size = seg->size;
      h.offset = p - seg->base;
      if (seg->export_fd >= 0) {
        seg->export_tick = ++st.export_clock;
        h.fd = DupForExport(seg->export_fd, index, "the segment's descriptor");
        return h;
      }
      alloc = seg->handle;
    } else if (internal::Imported* imp = RangeOf(st.imports, p, bytes)) {
      // Passing on memory another process exported: send a copy of the descriptor it came with.
      h.segment_id = imp->id;
      h.segment_size = imp->size;
      h.offset = p - imp->base;
      if (imp->fd < 0) {
        throw Error(ErrorCode::kResourceExhausted,
                    absl::StrCat("ExportMemory on cuda:", index, ": [", P(ptr), ", +", bytes,
                                 ") is memory imported from another process, and passing it on "
                                 "needs its descriptor, which could not be kept when it was "
                                 "imported; raise the descriptor limit (ulimit -n)"));
      }
      h.fd = DupForExport(imp->fd, index, "the imported segment's descriptor");
      return h;
    } else {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ExportMemory on cuda:", index, ": [", P(ptr), ", +", bytes,
                               ") is not memory of Allocate or ImportMemory on this device; "
                               "memory of another allocator needs ExportLegacyMemory"));
    }
    int fd = -1;
    const CUresult r =
        d->cuMemExportToShareableHandle(&fd, alloc, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
      if (r == CUDA_ERROR_OUT_OF_MEMORY || r == CUDA_ERROR_TOO_MANY_PEERS) {
        throw Error(
            ErrorCode::kResourceExhausted,
            absl::StrCat("ExportMemory: cuMemExportToShareableHandle failed: ",
                         internal::CuResultText(*d, r), "; close unused descriptors (ulimit -n)"));
      }
      ThrowCu(*d, r, "ExportMemory: cuMemExportToShareableHandle");
    }
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    try {
      h.fd = DupForExport(fd, index, "the new descriptor");
    } catch (...) {
      close(fd);
      throw;
    }
    KeepExportFd(st, seg, fd);
  }
  return h;
}

IpcMemoryHandle CudaBackend::ExportLegacyMemory(int index, const void* ptr, size_t bytes) {
  Enter(index, "ExportLegacyMemory");
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  const CUdeviceptr p = DevPtr(ptr);
  {
    MutexLock lk(&st.mu);
    if (OwnSegmentOf(st, p, 1) != nullptr || RangeOf(st.imports, p, 1) != nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ExportLegacyMemory on cuda:", index, ": ", P(ptr),
                               " is memory of forksafe's allocator; export it with ExportMemory"));
    }
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult r = d->cuMemGetAddressRange(&base, &size, p);
  if (r != CUDA_SUCCESS || bytes > size || p + bytes > base + size) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ExportLegacyMemory on cuda:", index, ": [", P(ptr), ", +", bytes,
                             ") is not inside one device allocation",
                             r != CUDA_SUCCESS ? absl::StrCat(" (cuMemGetAddressRange: ",
                                                              internal::CuResultText(*d, r), ")")
                                               : std::string()));
  }
  CUipcMemHandle ipc{};
  r = d->cuIpcGetMemHandle(&ipc, base);
  if (r != CUDA_SUCCESS) {
    ThrowCu(*d, r, absl::StrCat("ExportLegacyMemory: cuIpcGetMemHandle(", P(HostPtr(base)), ")"),
            "legacy handles exist only for cuMemAlloc/cudaMalloc memory");
  }
  IpcMemoryHandle h;
  h.device = Device(DeviceType::kCUDA, index);
  h.kind = IpcKind::kLegacy;
  h.fd = -1;
  static_assert(sizeof(ipc.reserved) == 64, "CUipcMemHandle is 64 bytes");
  std::memcpy(h.opaque.data(), ipc.reserved, 64);
  h.segment_id = HashBytes(ipc.reserved, 64);
  h.segment_size = size;
  h.offset = p - base;
  h.size = bytes;
  h.exporter = getpid();
  MutexLock lk(&st.mu);
  st.own_legacy[h.segment_id] = {base, size};
  return h;
}

void* CudaBackend::ImportMemory(const IpcMemoryHandle& handle) {
  if (handle.device.type != DeviceType::kCUDA) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ImportMemory: the handle describes memory of ",
                             handle.device.ToString(), ", not of a CUDA device"));
  }
  const int index = handle.device.index;
  Enter(index, "ImportMemory");
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  if (handle.size > handle.segment_size || handle.offset > handle.segment_size - handle.size) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat("ImportMemory: the range [", handle.offset, ", +", handle.size,
                     ") does not lie inside the segment of ", handle.segment_size, " bytes"));
  }
  if (handle.kind == IpcKind::kLegacy) {
    std::string key(reinterpret_cast<const char*>(handle.opaque.data()), handle.opaque.size());
    MutexLock lk(&st.mu);
    auto it = st.legacy_by_key.find(key);
    if (it != st.legacy_by_key.end()) {
      ++it->second->refs;
      return HostPtr(it->second->base + handle.offset);
    }
    auto* imp = new internal::LegacyImport();
    imp->key = key;
    imp->refs = 1;
    imp->size = handle.segment_size;
    if (handle.exporter == getpid()) {
      auto own = st.own_legacy.find(handle.segment_id);
      if (own == st.own_legacy.end()) {
        delete imp;
        throw Error(ErrorCode::kInvalidArgument,
                    "ImportMemory: a legacy handle from this process that it never exported");
      }
      imp->own = true;
      imp->base = own->second.first;
    } else {
      if (!runtime::internal::ProcessAlive(handle.exporter)) {
        delete imp;
        throw Error(ErrorCode::kFailedPrecondition,
                    absl::StrCat("ImportMemory: process ", handle.exporter,
                                 ", which exported this legacy CUDA handle, has exited, and the "
                                 "memory went with it; the producer must keep the tensor alive "
                                 "until every consumer has mapped it"));
      }
      CUipcMemHandle ipc{};
      std::memcpy(ipc.reserved, handle.opaque.data(), 64);
      const CUresult r = d->cuIpcOpenMemHandle(&imp->base, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      if (r != CUDA_SUCCESS) {
        delete imp;
        if (!runtime::internal::ProcessAlive(handle.exporter)) {
          throw Error(ErrorCode::kFailedPrecondition,
                      absl::StrCat("ImportMemory: process ", handle.exporter,
                                   " exited while its legacy CUDA handle was being opened"));
        }
        ThrowCu(*d, r, "ImportMemory: cuIpcOpenMemHandle",
                "the exporter may have freed the allocation (it must keep it alive)");
      }
    }
    st.legacy[imp->base] = imp;
    st.legacy_by_key[key] = imp;
    return HostPtr(imp->base + handle.offset);
  }
  MutexLock lk(&st.mu);
  if (auto own = st.segments_by_id.find(handle.segment_id); own != st.segments_by_id.end()) {
    Segment* seg = own->second;
    if (seg->size != handle.segment_size) {
      throw Error(ErrorCode::kInvalidArgument, "ImportMemory: segment size does not match");
    }
    ++seg->own_imports;
    return HostPtr(seg->base + handle.offset);
  }
  if (auto it = st.imports_by_id.find(handle.segment_id); it != st.imports_by_id.end()) {
    internal::Imported* imp = it->second;
    if (imp->size != handle.segment_size) {
      throw Error(ErrorCode::kInvalidArgument, "ImportMemory: segment size does not match");
    }
    if (imp->refs++ == 0) TakeOffIdle(st, imp);  // mapped still: no driver call
    return HostPtr(imp->base + handle.offset);
  }
  if (handle.fd < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "ImportMemory: a segment handle without a descriptor (fd is -1)");
  }
  if (handle.segment_size % st.granularity != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ImportMemory: a segment of ", handle.segment_size,
                             " bytes is not a multiple of cuda:", index, "'s granularity (",
                             st.granularity, "): not a CUDA segment of forksafe"));
  }
  CUmemGenericAllocationHandle alloc = 0;
  CUresult r = d->cuMemImportFromShareableHandle(
      &alloc, reinterpret_cast<void*>(static_cast<intptr_t>(handle.fd)),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE ||
        r == CUDA_ERROR_NOT_SUPPORTED) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ImportMemory: descriptor ", handle.fd,
                               " is not a CUDA allocation this process can import "
                               "(cuMemImportFromShareableHandle: ",
                               internal::CuResultText(*d, r), ")"));
    }
    ThrowCu(*d, r, "ImportMemory: cuMemImportFromShareableHandle");
  }
  CUdeviceptr va = 0;
  const size_t size = handle.segment_size;
  r = ReserveAndMap(d, st, alloc, size, &va);
  if (r != CUDA_SUCCESS) {
    d->cuMemRelease(alloc);
    ThrowCu(*d, r,
            absl::StrCat("ImportMemory: mapping a segment of ", size, " bytes on cuda:", index,
                         " (cuMemAddressReserve/cuMemMap/cuMemSetAccess)"),
            "the segment may live on another GPU than this index names here (compare "
            "CUDA_VISIBLE_DEVICES of both processes)");
  }
  auto* imp = new internal::Imported();
  imp->base = va;
  imp->size = size;
  imp->handle = alloc;
  imp->id = handle.segment_id;
  imp->refs = 1;
  imp->fd = fcntl(handle.fd, F_DUPFD_CLOEXEC, 0);  // for ExportMemory; -1 only if out of fds
  st.imports[va] = imp;
  st.imports_by_id[imp->id] = imp;
  return HostPtr(va + handle.offset);
}

void CudaBackend::ReleaseImported(int index, void* ptr) {
  Enter(index, "ReleaseImported");
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  const CUdeviceptr p = DevPtr(ptr);
  bool needs_unmap = false;                  // the last reference to a legacy import goes
  std::vector<internal::Imported*> victims;  // idle imports over the bounds
  {
    MutexLock lk(&st.mu);
    internal::Imported* imp = RangeOf(st.imports, p, 1);
    internal::LegacyImport* leg = imp ? nullptr : RangeOf(st.legacy, p, 1);
    Segment* own = imp || leg ? nullptr : OwnSegmentOf(st, p, 1);
    if (own != nullptr && own->own_imports > 0) {
      --own->own_imports;
      return;
    }
    if (imp == nullptr && leg == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ReleaseImported on cuda:", index, ": ", P(ptr),
                               " is not memory returned by ImportMemory (or was released "
                               "as often as it was imported)"));
    }
    if (leg != nullptr && leg->own) {
      if (--leg->refs == 0) {
        st.legacy_by_key.erase(leg->key);
        st.legacy.erase(leg->base);
        delete leg;
      }
      return;
    }
    if (imp != nullptr) {
      if (imp->refs == 0) {
        throw Error(ErrorCode::kInvalidArgument,
                    absl::StrCat("ReleaseImported on cuda:", index, ": ", P(ptr),
                                 " was released as often as it was imported"));
      }
      if (--imp->refs > 0) return;
      // The last use here: keep it mapped for the next message naming this segment.
      st.idle_imports.push_back(imp);
      st.idle_import_bytes += imp->size;
      victims = TakeIdleVictims(st, false);
      if (victims.empty()) return;
    } else {
      needs_unmap = leg->refs == 1;
      if (!needs_unmap) {
        --leg->refs;
        return;
      }
    }
  }
  SyncBeforeUnmap(*ctx_, st, "ReleaseImported", victims);
  MutexLock lk(&st.mu);
  for (internal::Imported* imp : victims) DestroyImport(d, st, imp);  // nobody can reach them
  if (!needs_unmap) return;
  if (internal::LegacyImport* leg = RangeOf(st.legacy, p, 1)) {
    if (--leg->refs > 0) return;
    d->cuIpcCloseMemHandle(leg->base);
    st.legacy_by_key.erase(leg->key);
    st.legacy.erase(leg->base);
    delete leg;
  }
}

void CudaBackend::HoldAfterFree(int index, const void* ptr, std::function<bool()> released) {
  Enter(index, "HoldAfterFree");
  DeviceState& st = Dev(*ctx_, index);
  const CUdeviceptr p = DevPtr(ptr);
  if (!released) released = [] { return true; };
  MutexLock lk(&st.mu);
  if (auto it = st.allocated.find(p); it != st.allocated.end()) {
    Block* b = it->second;  // not freed yet: the hold starts at Free
    if (b->hold_on_free) {
      b->hold_on_free = [a = std::move(b->hold_on_free), r = std::move(released)] {
        return a() && r();
      };
    } else {
      b->hold_on_free = std::move(released);
    }
    return;
  }
  for (Block* b : st.held) {  // held already: both conditions must hold
    if (b->addr() == p) {
      b->released = [a = std::move(b->released), r = std::move(released)] { return a() && r(); };
      return;
    }
  }
  auto fs = st.freed_sizes.find(p);
  Segment* seg = fs == st.freed_sizes.end() ? nullptr : OwnSegmentOf(st, p, fs->second);
  if (seg == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("HoldAfterFree on cuda:", index, ": ", P(ptr),
                             " is not the start of a block allocated (or just freed) on this "
                             "device"));
  }
  const size_t size = fs->second;
  st.freed_sizes.erase(fs);
  // Find the free block that now contains the freed range, and carve the range out of it.
  const size_t off = p - seg->base;
  Block* b = seg->first;
  while (b != nullptr && !(off >= b->offset && off < b->offset + b->size)) b = b->next;
  if (b == nullptr || b->allocated || b->held || off + size > b->offset + b->size) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("HoldAfterFree on cuda:", index, ": the block at ", P(ptr),
                             " was reused by a later Allocate; call HoldAfterFree before the "
                             "next allocation (or before Free)"));
  }
  auto& pool = PoolOf(st, seg);
  pool.erase(b);
  if (off > b->offset) {  // the part before stays free
    auto* head = new Block();
    head->seg = seg;
    head->offset = b->offset;
    head->size = off - b->offset;
    head->prev = b->prev;
    head->next = b;
    if (b->prev)
      b->prev->next = head;
    else
      seg->first = head;
    b->prev = head;
    b->offset = off;
    b->size -= head->size;
    pool.insert(head);
  }
  if (b->size > size) {  // and so does the part after
    auto* tail = new Block();
    tail->seg = seg;
    tail->offset = b->offset + size;
    tail->size = b->size - size;
    tail->prev = b;
    tail->next = b->next;
    if (b->next) b->next->prev = tail;
    b->next = tail;
    b->size = size;
    pool.insert(tail);
  }
  b->held = true;
  b->released = std::move(released);
  st.held.push_back(b);
}

IpcMemoryInfo CudaBackend::MemoryInfo(int index) {
  Enter(index, "MemoryInfo");
  const CudaDriver* d = ctx_->d;
  Dev(*ctx_, index);
  IpcMemoryInfo info;
  FS_CU(d->cuMemGetInfo(&info.free, &info.total), absl::StrCat("MemoryInfo on cuda:", index));
  return info;
}

void CudaBackend::EmptyCache(int index) {
  Enter(index, "EmptyCache");
  DeviceState& st = Dev(*ctx_, index);
  std::vector<internal::Imported*> victims;
  {
    MutexLock lk(&st.mu);
    victims = TakeIdleVictims(st, true);
  }
  SyncBeforeUnmap(*ctx_, st, "EmptyCache", victims);  // freed blocks' work too
  MutexLock lk(&st.mu);
  ReleaseFreeSegments(ctx_->d, st);
  for (internal::Imported* imp : victims) DestroyImport(ctx_->d, st, imp);
}

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

}  // namespace forksafe::device
