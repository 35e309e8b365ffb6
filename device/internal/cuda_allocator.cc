// device/internal/cuda_allocator.cc: the CUDA backend's caching allocator over exportable
// segments (cuMemCreate + cuMemAddressReserve/cuMemMap/cuMemSetAccess), and the cache of idle
// imports (device/internal/cuda_state.h).
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/cuda_driver.h"
#include "forksafe/device/internal/cuda_state.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/memory_bounds.h"
#include "forksafe/runtime/internal/random.h"

namespace forksafe::device::internal {

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

using runtime::Error;
using runtime::ErrorCode;

std::set<Block*, BySize>& PoolOf(DeviceState& st, const Segment* seg) {
  return seg->small ? st.free_small : st.free_large;
}

// Makes `b` free (not held) and merges it with free neighbours; inserts the result in its pool.
void InsertFree(DeviceState& st, Block* b) {
  auto& pool = PoolOf(st, b->seg);
  b->allocated = false;
  b->held = false;
  b->released = nullptr;
  b->hold_on_free = nullptr;
  if (Block* p = b->prev; p != nullptr && !p->allocated && !p->held) {
    pool.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    delete b;
    b = p;
  }
  if (Block* n = b->next; n != nullptr && !n->allocated && !n->held) {
    pool.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  pool.insert(b);
}

namespace {

// Returns the held blocks whose released() now says so to the free pools.
void PollHeld(DeviceState& st) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
  std::vector<Block*> still;
  std::vector<Block*> done;
  for (Block* b : st.held) {
    bool ok = false;
    try {
      ok = b->released ? b->released() : true;
    } catch (...) {
      ok = false;  // the contract says it does not throw; keep the block if it does
    }
    (ok ? done : still).push_back(b);
  }
  st.held.swap(still);
  for (Block* b : done) InsertFree(st, b);
}

void DestroySegment(const CudaDriver* d, DeviceState& st, Segment* seg)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
  auto& pool = PoolOf(st, seg);
  pool.erase(seg->first);
  const CUdeviceptr lo = seg->base, hi = seg->base + seg->size;
  for (auto it = st.freed_sizes.begin(); it != st.freed_sizes.end();) {
    it = (it->first >= lo && it->first < hi) ? st.freed_sizes.erase(it) : std::next(it);
  }
  // Errors here leave the memory with the driver until exit; nothing better can be done.
  d->cuMemUnmap(seg->base, seg->size);
  d->cuMemAddressFree(seg->base, seg->size);
  d->cuMemRelease(seg->handle);
  if (seg->export_fd >= 0) {
    close(seg->export_fd);
    --st.kept_export_fds;
  }
  st.reserved_bytes -= seg->size;
  st.segments.erase(seg->base);
  st.segments_by_id.erase(seg->id);
  delete seg->first;
  delete seg;
}

}  // namespace

// Releases every fully free own segment that no import of this process uses. The caller has
// synchronized the stream (work queued on freed blocks has finished).
void ReleaseFreeSegments(const CudaDriver* d, DeviceState& st) {
  PollHeld(st);
  std::vector<Segment*> victims;
  for (const auto& [base, seg] : st.segments) {
    Block* b = seg->first;
    if (b->next == nullptr && !b->allocated && !b->held && seg->own_imports == 0) {
      victims.push_back(seg);
    }
  }
  for (Segment* seg : victims) DestroySegment(d, st, seg);
}

// Unmaps and releases an import (refs == 0, no longer idle). The caller holds st.mu and has
// synchronized the stream (work queued on the memory has finished).
void DestroyImport(const CudaDriver* d, DeviceState& st, Imported* imp) {
  d->cuMemUnmap(imp->base, imp->size);
  d->cuMemAddressFree(imp->base, imp->size);
  d->cuMemRelease(imp->handle);
  if (imp->fd >= 0) close(imp->fd);
  st.imports.erase(imp->base);
  if (auto it = st.imports_by_id.find(imp->id); it != st.imports_by_id.end() && it->second == imp) {
    st.imports_by_id.erase(it);
  }
  delete imp;
}

// Takes `imp` off the idle list (it is used again, or about to be destroyed). Caller holds st.mu.
void TakeOffIdle(DeviceState& st, Imported* imp) {
  auto it = std::find(st.idle_imports.begin(), st.idle_imports.end(), imp);
  if (it == st.idle_imports.end()) return;
  st.idle_imports.erase(it);
  st.idle_import_bytes -= imp->size;
}

// Idle imports over the bounds (all of them when `all`), oldest first, taken off the idle list
// and out of imports_by_id, so that no ImportMemory can use one again while the caller, having
// unlocked st.mu, synchronizes the stream before destroying them (a message naming the segment
// meanwhile maps it anew). Caller holds st.mu.
std::vector<Imported*> TakeIdleVictims(DeviceState& st, bool all) {
  std::vector<Imported*> out;
  while (!st.idle_imports.empty() && (all || st.idle_imports.size() > kIdleImportsMax ||
                                      st.idle_import_bytes > kIdleImportBytesMax)) {
    Imported* imp = st.idle_imports.front();
    st.idle_imports.erase(st.idle_imports.begin());
    st.idle_import_bytes -= imp->size;
    if (auto it = st.imports_by_id.find(imp->id);
        it != st.imports_by_id.end() && it->second == imp) {
      st.imports_by_id.erase(it);
    }
    out.push_back(imp);
  }
  return out;
}

// Puts victims of TakeIdleVictims back (the synchronize before their destruction failed): idle
// again, usable again unless the segment was mapped anew meanwhile. Caller holds st.mu.
void ReturnIdleVictims(DeviceState& st, const std::vector<Imported*>& victims) {
  for (Imported* imp : victims) {
    st.imports_by_id.emplace(imp->id, imp);  // no-op if mapped anew meanwhile
    st.idle_imports.push_back(imp);
    st.idle_import_bytes += imp->size;
  }
}

// Reserves `size` bytes of address space, maps `h` there and gives this device read-write access;
// on failure undoes what it did (the caller releases `h`).
CUresult ReserveAndMap(const CudaDriver* d, const DeviceState& st, CUmemGenericAllocationHandle h,
                       size_t size, CUdeviceptr* va) {
  CUresult r = d->cuMemAddressReserve(va, size, st.granularity, 0, 0);
  if (r != CUDA_SUCCESS) return r;
  r = d->cuMemMap(*va, size, 0, h, 0);
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location = st.prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d->cuMemSetAccess(*va, size, &access, 1);
    if (r != CUDA_SUCCESS) d->cuMemUnmap(*va, size);
  }
  if (r != CUDA_SUCCESS) d->cuMemAddressFree(*va, size);
  return r;
}

namespace {

Segment* CreateSegment(const CudaDriver* d, DeviceState& st, size_t size, bool small,
                       CUresult* failure) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
  CUmemGenericAllocationHandle h = 0;
  CUresult r = d->cuMemCreate(&h, size, &st.prop, 0);
  if (r != CUDA_SUCCESS) {
    *failure = r;
    return nullptr;
  }
  CUdeviceptr va = 0;
  r = ReserveAndMap(d, st, h, size, &va);
  if (r != CUDA_SUCCESS) {
    d->cuMemRelease(h);
    *failure = r;
    return nullptr;
  }
  auto* seg = new Segment();
  seg->base = va;
  seg->size = size;
  seg->handle = h;
  seg->small = small;
  seg->id = runtime::internal::RandomId();
  seg->first = new Block();
  seg->first->seg = seg;
  seg->first->size = size;
  st.segments[va] = seg;
  st.segments_by_id[seg->id] = seg;
  st.reserved_bytes += size;
  PoolOf(st, seg).insert(seg->first);
  return seg;
}

Block* FindFree(DeviceState& st, bool small, size_t size) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
  auto& pool = small ? st.free_small : st.free_large;
  Block key;
  Segment fake;
  key.seg = &fake;
  key.size = size;
  auto it = pool.lower_bound(&key);
  if (it == pool.end()) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

// Cuts `b` (taken out of its pool) to `size`; the rest goes back to the pool.
void Split(DeviceState& st, Block* b, size_t size) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
  const size_t rest = b->size - size;
  const bool small = b->seg->small;
  if (rest < kRound || (!small && rest <= kSmallMax)) return;
  auto* r = new Block();
  r->seg = b->seg;
  r->offset = b->offset + size;
  r->size = rest;
  r->prev = b;
  r->next = b->next;
  if (b->next) b->next->prev = r;
  b->next = r;
  b->size = size;
  PoolOf(st, b->seg).insert(r);
}

}  // namespace

void* AllocateLocked(const CudaDriver* d, DeviceState& st, size_t bytes) {
  const size_t size = runtime::internal::RoundUpOrThrow(bytes, kRound, "cuda");
  const bool small = size <= kSmallMax;
  Block* b = FindFree(st, small, size);
  if (b == nullptr && !st.held.empty()) {
    PollHeld(st);
    b = FindFree(st, small, size);
  }
  if (b == nullptr) {
    const size_t seg_size =
        small ? runtime::internal::RoundUpOrThrow(kSmallSegment, st.granularity, "cuda")
              : runtime::internal::RoundUpOrThrow(size, st.granularity, "cuda");
    CUresult failure = CUDA_SUCCESS;
    Segment* seg = CreateSegment(d, st, seg_size, small, &failure);
    if (seg == nullptr && failure == CUDA_ERROR_OUT_OF_MEMORY) {
      // Give the cache back and try once more (work on freed blocks must finish first).
      d->cuStreamSynchronize(st.stream);
      ReleaseFreeSegments(d, st);
      // Idle imports too: they may hold memory whose exporters freed it.
      for (Imported* imp : TakeIdleVictims(st, true)) DestroyImport(d, st, imp);
      seg = CreateSegment(d, st, seg_size, small, &failure);
    }
    if (seg == nullptr) {
      if (failure == CUDA_ERROR_OUT_OF_MEMORY) {
        throw Error(ErrorCode::kResourceExhausted,
                    absl::StrCat("Allocate of ", bytes, " bytes on cuda:", st.index,
                                 ": out of memory (cuMemCreate of ", seg_size,
                                 " bytes: ", CuResultText(*d, failure), "; ", st.allocated_bytes,
                                 " bytes allocated and ", st.reserved_bytes,
                                 " reserved by this process); free tensors or use less memory"));
      }
      ThrowCu(*d, failure,
              absl::StrCat("cuMemCreate/cuMemMap of ", seg_size, " bytes on cuda:", st.index));
    }
    b = FindFree(st, small, size);
  }
  Split(st, b, size);
  b->allocated = true;
  st.allocated[b->addr()] = b;
  st.allocated_bytes += b->size;
  st.freed_sizes.erase(b->addr());
  return reinterpret_cast<void*>(static_cast<uintptr_t>(b->addr()));
}

// The own segment containing [p, p + n), or null.
Segment* OwnSegmentOf(DeviceState& st, CUdeviceptr p, size_t n) {
  auto it = st.segments.upper_bound(p);
  if (it == st.segments.begin()) return nullptr;
  --it;
  Segment* seg = it->second;
  return p >= seg->base && p + n <= seg->base + seg->size && n <= seg->size ? seg : nullptr;
}

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

}  // namespace forksafe::device::internal
