#include "forksafe/device/cuda_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/cuda_driver.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/internal/memory_bounds.h"

namespace forksafe::device {

using runtime::Error;
using runtime::ErrorCode;

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

namespace {

const char* const kKeptOwner = "device/cuda (driver descriptors)";

// True unless `pid` is known to have exited (a zombie still counts: its parent has not reaped it).
bool ProcessAlive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }

using internal::OpenDescriptors;

// Whether `fd` is an exporter's exit page (see CudaContext) saying that it exited normally with
// all its work done. Anything else (no page, another file, a crash) says no.
bool ExitedAfterFinishingItsWork(int fd) {
  if (fd < 0) return false;
  char target[128];
  const ssize_t n =
      readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), target, sizeof target - 1);
  if (n <= 0 || std::string(target, static_cast<size_t>(n)).rfind("/memfd:forksafe_cudaexit", 0) != 0) {
    return false;
  }
  uint32_t word = 0;
  return pread(fd, &word, sizeof word, 0) == static_cast<ssize_t>(sizeof word) && word == 1;
}

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

namespace internal {
namespace {

constexpr size_t kRound = 512;                 // every block is a multiple of this
constexpr size_t kSmallMax = size_t{1} << 20;  // requests up to 1 MiB share segments...
constexpr size_t kSmallSegment = size_t{2} << 20;  // ...of 2 MiB (at least the granularity)
// Imports no tensor uses any more stay mapped (idle) for the next message that names the same
// segment, up to this many segments and bytes per device, least recently used out first.
constexpr size_t kIdleImportsMax = 32;
constexpr size_t kIdleImportBytesMax = size_t{1} << 30;
// Exported segments that keep their shareable descriptor, per device; beyond that the least
// recently exported one closes it (and asks the driver again at its next export).
constexpr size_t kKeptExportFdsMax = 256;

// Checked: a size near SIZE_MAX is kResourceExhausted, never a wrap to a tiny block.
size_t RoundUp(size_t n, size_t to) { return runtime::internal::RoundUpOrThrow(n, to, "cuda"); }

uint64_t RandomId() {
  uint64_t v = 0;
  while (v == 0) {
    if (getrandom(&v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) {
      static std::atomic<uint64_t> counter{1};
      v = (static_cast<uint64_t>(getpid()) << 40) ^
          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
          counter.fetch_add(0x9E3779B97F4A7C15ull);
    }
  }
  return v;
}

uint64_t HashBytes(const void* p, size_t n) {  // FNV-1a: identity of a legacy handle
  uint64_t h = 1469598103934665603ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h == 0 ? 1 : h;
}

struct Segment;

struct Block {
  Segment* seg = nullptr;
  size_t offset = 0;
  size_t size = 0;
  bool allocated = false;
  bool held = false;                  // freed, kept out of reuse until `released` says so
  std::function<bool()> released;     // for held blocks
  std::function<bool()> hold_on_free; // HoldAfterFree called while still allocated
  Block* prev = nullptr;
  Block* next = nullptr;
  CUdeviceptr addr() const;
};

struct Segment {
  CUdeviceptr base = 0;
  size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  uint64_t id = 0;
  bool small = false;
  int own_imports = 0;  // ImportMemory of this segment by this very process
  // The shareable descriptor of the first ExportMemory, kept until the segment is destroyed
  // (or until kKeptExportFdsMax others were exported more recently): later exports send a
  // duplicate (cuMemExportToShareableHandle took 28-46 us on an H100 under driver 580, a dup
  // under 1 us). -1 until exported.
  int export_fd = -1;
  uint64_t export_tick = 0;  // when it was last exported (DeviceState::export_clock)
  Block* first = nullptr;
};

CUdeviceptr Block::addr() const { return seg->base + offset; }

struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    if (a->size != b->size) return a->size < b->size;
    return a->addr() < b->addr();
  }
};

struct Imported {  // a segment of another process, mapped here
  CUdeviceptr base = 0;
  size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  uint64_t id = 0;
  int refs = 0;
  // A duplicate of the descriptor it was imported from, kept so that it can be passed on: the
  // driver refuses cuMemExportToShareableHandle of an imported handle (CUDA_ERROR_INVALID_VALUE,
  // seen on driver 580), and the exporter may have exited. -1 if the dup failed (no descriptors).
  int fd = -1;
};

struct LegacyImport {  // a cuIpcOpenMemHandle mapping
  CUdeviceptr base = 0;
  size_t size = 0;
  std::string key;  // the 64 handle bytes
  int refs = 0;
  bool own = false;  // our own export: base is the original allocation, nothing to close
};

struct OpenedEvent {
  CUevent event = nullptr;
  pid_t exporter = 0;
};

struct PendingWait {
  CUevent event = nullptr;
  pid_t exporter = 0;
  uint64_t ticket = 0;
};

struct DeviceState {
  int index = 0;
  std::mutex mu;  // everything below
  bool ready = false;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  size_t granularity = 0;
  CUmemAllocationProp prop{};

  std::map<CUdeviceptr, Segment*> segments;  // own, by base
  std::unordered_map<uint64_t, Segment*> segments_by_id;
  std::map<CUdeviceptr, Block*> allocated;  // by address
  std::set<Block*, BySize> free_small, free_large;
  std::vector<Block*> held;
  std::unordered_map<CUdeviceptr, size_t> freed_sizes;  // recently freed block starts (HoldAfterFree)
  size_t allocated_bytes = 0;
  size_t reserved_bytes = 0;

  std::map<CUdeviceptr, Imported*> imports;  // by base
  std::unordered_map<uint64_t, Imported*> imports_by_id;
  std::vector<Imported*> idle_imports;  // refs == 0, still mapped; oldest first
  size_t idle_import_bytes = 0;
  size_t kept_export_fds = 0;  // own segments with export_fd >= 0
  uint64_t export_clock = 0;
  std::map<CUdeviceptr, LegacyImport*> legacy;  // by base
  std::map<std::string, LegacyImport*> legacy_by_key;
  std::unordered_map<uint64_t, std::pair<CUdeviceptr, size_t>> own_legacy;  // id -> range

  uint64_t pool_id = 0;
  std::vector<CUevent> pool;
  std::vector<CUipcEventHandle> pool_handles;
  uint64_t next_slot = 0;
  uint64_t sequence = 0;
  std::map<std::pair<pid_t, std::pair<uint64_t, uint32_t>>, OpenedEvent> opened;
  std::vector<PendingWait> waits;  // IPC waits queued since the last completed synchronize
  uint64_t next_ticket = 0;
  std::string failure;  // set when an awaited exporter died before its event could be opened
};

}  // namespace

struct CudaContext {
  const CudaDriver* d = nullptr;
  pid_t owner = 0;
  // A page other processes can read after this one is gone: 1 once it exited normally with all
  // its streams synchronized (its IPC events cannot be opened then, but all its work was done).
  int exit_fd = -1;
  uint32_t* exit_word = nullptr;
  std::vector<std::unique_ptr<DeviceState>> devices;
  std::mutex fds_mu;
  std::set<int> driver_fds;  // descriptors the driver opened during initialization
};

}  // namespace internal

namespace {

using internal::Block;
using internal::CudaContext;
using internal::CudaDriver;
using internal::DeviceState;
using internal::Segment;
using internal::kRound;
using internal::kSmallMax;
using internal::kSmallSegment;
using internal::RoundUp;

std::string P(const void* p) { return absl::StrCat("0x", absl::Hex(reinterpret_cast<uintptr_t>(p))); }

[[noreturn]] void ThrowCu(const CudaDriver& d, CUresult r, const std::string& what,
                          const std::string& advice = "") {
  ErrorCode code = ErrorCode::kInternal;
  std::string hint = advice;
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    code = ErrorCode::kResourceExhausted;
    if (hint.empty()) hint = "free tensors or call EmptyCache, or use a smaller batch";
  } else if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE) {
    code = ErrorCode::kInvalidArgument;
  } else if (r == CUDA_ERROR_NOT_SUPPORTED) {
    code = ErrorCode::kUnavailable;
  }
  if (hint.empty()) hint = "this is a driver failure; check the GPU with nvidia-smi";
  throw Error(code, absl::StrCat(what, " failed: ", internal::CuResultText(d, r), "; ", hint));
}

#define FS_CU(call, what)                                           \
  do {                                                              \
    const CUresult fs_cu_r = (call);                                \
    if (fs_cu_r != CUDA_SUCCESS) ThrowCu(*d, fs_cu_r, (what));      \
  } while (0)

// Per-device setup on first use; the caller holds st.mu.
void EnsureDeviceLocked(CudaContext& c, DeviceState& st) {
  if (st.ready) return;
  const CudaDriver* d = c.d;
  const auto before = OpenDescriptors();
  FS_CU(d->cuDeviceGet(&st.dev, st.index), absl::StrCat("cuDeviceGet(", st.index, ")"));
  FS_CU(d->cuDevicePrimaryCtxRetain(&st.ctx, st.dev),
        absl::StrCat("cuDevicePrimaryCtxRetain(cuda:", st.index, ")"));
  FS_CU(d->cuCtxSetCurrent(st.ctx), "cuCtxSetCurrent");
  int vmm = 0, posix_fd = 0;
  d->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, st.dev);
  d->cuDeviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                          st.dev);
  if (!vmm || !posix_fd) {
    throw Error(ErrorCode::kUnavailable,
                absl::StrCat("cuda:", st.index, " does not support ",
                             !vmm ? "virtual memory management (cuMemCreate)"
                                  : "POSIX file descriptor handles for cuMemCreate",
                             ", which forksafe's CUDA allocator needs; use a newer GPU or driver"));
  }
  st.prop = CUmemAllocationProp{};
  st.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  st.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  st.prop.location.id = st.dev;
  st.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  FS_CU(d->cuMemGetAllocationGranularity(&st.granularity, &st.prop,
                                         CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  if (st.granularity == 0) st.granularity = kSmallSegment;
  FS_CU(d->cuStreamCreate(&st.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  st.pool_id = internal::RandomId();
  st.ready = true;
  const auto after = OpenDescriptors();
  std::lock_guard<std::mutex> lk(c.fds_mu);
  for (const auto& [fd, target] : after) {
    if (before.count(fd) == 0) c.driver_fds.insert(fd);
  }
}

// ---- the allocator (caller holds st.mu) ---------------------------------------------------------

std::set<Block*, internal::BySize>& PoolOf(DeviceState& st, const Segment* seg) {
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

// Returns the held blocks whose released() now says so to the free pools.
void PollHeld(DeviceState& st) {
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

void DestroySegment(const CudaDriver* d, DeviceState& st, Segment* seg) {
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
void DestroyImport(const CudaDriver* d, DeviceState& st, internal::Imported* imp) {
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
void TakeOffIdle(DeviceState& st, internal::Imported* imp) {
  auto it = std::find(st.idle_imports.begin(), st.idle_imports.end(), imp);
  if (it == st.idle_imports.end()) return;
  st.idle_imports.erase(it);
  st.idle_import_bytes -= imp->size;
}

// Idle imports over the bounds (all of them when `all`), oldest first, taken off the idle list
// and out of imports_by_id, so that no ImportMemory can use one again while the caller, having
// unlocked st.mu, synchronizes the stream before destroying them (a message naming the segment
// meanwhile maps it anew). Caller holds st.mu.
std::vector<internal::Imported*> TakeIdleVictims(DeviceState& st, bool all) {
  std::vector<internal::Imported*> out;
  while (!st.idle_imports.empty() &&
         (all || st.idle_imports.size() > internal::kIdleImportsMax ||
          st.idle_import_bytes > internal::kIdleImportBytesMax)) {
    internal::Imported* imp = st.idle_imports.front();
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
void ReturnIdleVictims(DeviceState& st, const std::vector<internal::Imported*>& victims) {
  for (internal::Imported* imp : victims) {
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

Segment* CreateSegment(const CudaDriver* d, DeviceState& st, size_t size, bool small,
                       CUresult* failure) {
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
  seg->id = internal::RandomId();
  seg->first = new Block();
  seg->first->seg = seg;
  seg->first->size = size;
  st.segments[va] = seg;
  st.segments_by_id[seg->id] = seg;
  st.reserved_bytes += size;
  PoolOf(st, seg).insert(seg->first);
  return seg;
}

Block* FindFree(DeviceState& st, bool small, size_t size) {
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
void Split(DeviceState& st, Block* b, size_t size) {
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

void* AllocateLocked(const CudaDriver* d, DeviceState& st, size_t bytes) {
  const size_t size = RoundUp(bytes, kRound);
  const bool small = size <= kSmallMax;
  Block* b = FindFree(st, small, size);
  if (b == nullptr && !st.held.empty()) {
    PollHeld(st);
    b = FindFree(st, small, size);
  }
  if (b == nullptr) {
    const size_t seg_size =
        small ? RoundUp(kSmallSegment, st.granularity) : RoundUp(size, st.granularity);
    CUresult failure = CUDA_SUCCESS;
    Segment* seg = CreateSegment(d, st, seg_size, small, &failure);
    if (seg == nullptr && failure == CUDA_ERROR_OUT_OF_MEMORY) {
      // Give the cache back and try once more (work on freed blocks must finish first).
      d->cuStreamSynchronize(st.stream);
      ReleaseFreeSegments(d, st);
      // Idle imports too: they may hold memory whose exporters freed it.
      for (internal::Imported* imp : TakeIdleVictims(st, true)) DestroyImport(d, st, imp);
      seg = CreateSegment(d, st, seg_size, small, &failure);
    }
    if (seg == nullptr) {
      if (failure == CUDA_ERROR_OUT_OF_MEMORY) {
        throw Error(ErrorCode::kResourceExhausted,
                    absl::StrCat("Allocate of ", bytes, " bytes on cuda:", st.index,
                                 ": out of memory (cuMemCreate of ", seg_size, " bytes: ",
                                 internal::CuResultText(*d, failure), "; ", st.allocated_bytes,
                                 " bytes allocated and ", st.reserved_bytes,
                                 " reserved by this process); free tensors or use less memory"));
      }
      ThrowCu(*d, failure, absl::StrCat("cuMemCreate/cuMemMap of ", seg_size, " bytes on cuda:",
                                        st.index));
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

template <typename T>
T* RangeOf(std::map<CUdeviceptr, T*>& m, CUdeviceptr p, size_t n) {
  auto it = m.upper_bound(p);
  if (it == m.begin()) return nullptr;
  --it;
  T* x = it->second;
  return p >= x->base && p + n <= x->base + x->size && n <= x->size ? x : nullptr;
}

CUdeviceptr DevPtr(const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p)); }
void* HostPtr(CUdeviceptr p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

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
          std::lock_guard<std::mutex> lk(ctx_->fds_mu);
          mine = ctx_->driver_fds;
        }
        for (const auto& [fd, target] : now) {
          if (mine.count(fd) != 0 || LooksLikeDriver(target)) {
            out.AddFd(fd, "device/cuda: the CUDA driver");
          }
        }
        // The shareable descriptors of exported segments and of imports (for passing them on).
        for (const auto& st : ctx_->devices) {
          std::lock_guard<std::mutex> lk(st->mu);
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
  std::lock_guard<std::mutex> lk(st.mu);
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
  for (const auto& [fd, target] : OpenDescriptors()) {
    if (before.count(fd) == 0) c->driver_fds.insert(fd);
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

namespace {

// The device's state, set up and its context current on this thread. Caller must not hold st.mu.
DeviceState& Dev(CudaContext& c, int index) {
  if (index < 0 || index >= static_cast<int>(c.devices.size())) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("cuda:", index, " is not visible to the CUDA driver in this process (",
                             c.devices.size(),
                             " device(s)); NVML and the driver disagree: check "
                             "CUDA_VISIBLE_DEVICES and MIG settings"));
  }
  DeviceState& st = *c.devices[static_cast<size_t>(index)];
  {
    std::lock_guard<std::mutex> lk(st.mu);
    EnsureDeviceLocked(c, st);
  }
  const CUresult r = c.d->cuCtxSetCurrent(st.ctx);
  if (r != CUDA_SUCCESS) ThrowCu(*c.d, r, "cuCtxSetCurrent");
  return st;
}

// Waits for the device's stream. With IPC waits queued, polls, and fails (kProcessFailed) when
// an awaited event is still incomplete and its exporter has exited: that stream would wait
// forever, so the device gets a fresh one.
void SyncStream(CudaContext& c, DeviceState& st, const char* what) {
  const CudaDriver* d = c.d;
  CUstream stream;
  std::vector<internal::PendingWait> waits;
  std::string failure;
  uint64_t last_ticket = 0;
  {
    std::lock_guard<std::mutex> lk(st.mu);
    stream = st.stream;
    waits = st.waits;
    failure.swap(st.failure);
    last_ticket = st.next_ticket;
  }
  if (!failure.empty()) throw Error(ErrorCode::kProcessFailed, absl::StrCat(what, ": ", failure));
  if (waits.empty()) {
    FS_CU(d->cuStreamSynchronize(stream), absl::StrCat(what, ": cuStreamSynchronize(cuda:", st.index, ")"));
    return;
  }
  // Polled: a blocking synchronize could never return if an awaited exporter died. The first
  // 100 us yield instead of sleeping: work just queued behind an IPC wait is usually done by
  // then, and a 20 us sleep costs 60-80 us on a VM.
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    const CUresult r = d->cuStreamQuery(stream);
    if (r == CUDA_SUCCESS) break;
    if (r != CUDA_ERROR_NOT_READY) {
      ThrowCu(*d, r, absl::StrCat(what, ": cuStreamQuery(cuda:", st.index, ")"));
    }
    for (const auto& w : waits) {
      if (ProcessAlive(w.exporter)) continue;
      if (d->cuEventQuery(w.event) == CUDA_SUCCESS) continue;
      {
        std::lock_guard<std::mutex> lk(st.mu);
        // Forgotten meanwhile on this same stream (another thread saw the stream idle, so it
        // passed this wait; the event may even be destroyed by now): not a failure.
        if (st.stream == stream &&
            std::none_of(st.waits.begin(), st.waits.end(),
                         [&](const internal::PendingWait& x) { return x.ticket == w.ticket; })) {
          continue;
        }
        if (st.stream == stream) {
          // The old stream is abandoned (destroying it could block); later work uses a new one.
          CUstream fresh = nullptr;
          if (d->cuStreamCreate(&fresh, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) st.stream = fresh;
          st.waits.clear();
        }
      }
      throw Error(ErrorCode::kProcessFailed,
                  absl::StrCat(what, " on cuda:", st.index, ": process ", w.exporter,
                               " exited before the event this device waits for (WaitIpcEvent) "
                               "completed; the data it was writing may be incomplete. Work queued "
                               "on cuda:", st.index, " since that wait was dropped"));
    }
    if (std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
  std::lock_guard<std::mutex> lk(st.mu);
  if (st.stream == stream) {
    st.waits.erase(std::remove_if(st.waits.begin(), st.waits.end(),
                                  [&](const internal::PendingWait& w) {
                                    return w.ticket < last_ticket;
                                  }),
                   st.waits.end());
  }
}

// Work queued on memory about to be unmapped must finish first: synchronizes the stream before
// the caller destroys `victims` (of TakeIdleVictims); if that throws, they go back to idle.
void SyncBeforeUnmap(CudaContext& c, DeviceState& st, const char* what,
                     const std::vector<internal::Imported*>& victims) {
  try {
    SyncStream(c, st, what);
  } catch (...) {
    std::lock_guard<std::mutex> lk(st.mu);
    ReturnIdleVictims(st, victims);
    throw;
  }
}

}  // namespace

namespace {
// Synchronizes every stream this process used, then marks the exit page (see CudaContext).
void DrainAndMark(CudaContext* c) {
  if (c == nullptr || c->owner != getpid()) return;
  for (auto& st : c->devices) {
    if (!st->ready) continue;
    try {
      SyncStream(*c, *st, "finishing queued work");
    } catch (...) {
      return;  // some work failed: the exit page keeps saying "not known to be complete"
    }
  }
  if (c->exit_word != nullptr) __atomic_store_n(c->exit_word, 1u, __ATOMIC_RELEASE);
}
}  // namespace

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
  std::lock_guard<std::mutex> lk(st.mu);
  return AllocateLocked(ctx_->d, st, bytes);
}

void CudaBackend::DoFree(int index, void* ptr) {
  DeviceState& st = Dev(*ctx_, index);
  std::lock_guard<std::mutex> lk(st.mu);
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
      std::lock_guard<std::mutex> lk(t.mu);
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
    std::lock_guard<std::mutex> lk(st.mu);
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
    std::lock_guard<std::mutex> lk(st.mu);
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

// ---- IpcBackend ----------------------------------------------------------------------------------

namespace {

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
// exported segment gives its up. Caller holds st.mu.
void KeepExportFd(DeviceState& st, Segment* seg, int fd) {
  if (st.kept_export_fds >= internal::kKeptExportFdsMax) {
    Segment* oldest = nullptr;
    for (const auto& [base, other] : st.segments) {
      if (other->export_fd >= 0 && (oldest == nullptr || other->export_tick < oldest->export_tick)) {
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
    std::lock_guard<std::mutex> lk(st.mu);
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
    const CUresult r = d->cuMemExportToShareableHandle(
        &fd, alloc, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
      if (r == CUDA_ERROR_OUT_OF_MEMORY || r == CUDA_ERROR_TOO_MANY_PEERS) {
        throw Error(ErrorCode::kResourceExhausted,
                    absl::StrCat("ExportMemory: cuMemExportToShareableHandle failed: ",
                                 internal::CuResultText(*d, r),
                                 "; close unused descriptors (ulimit -n)"));
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
    std::lock_guard<std::mutex> lk(st.mu);
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
                             r != CUDA_SUCCESS
                                 ? absl::StrCat(" (cuMemGetAddressRange: ",
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
  h.segment_id = internal::HashBytes(ipc.reserved, 64);
  h.segment_size = size;
  h.offset = p - base;
  h.size = bytes;
  h.exporter = getpid();
  std::lock_guard<std::mutex> lk(st.mu);
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
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ImportMemory: the range [", handle.offset, ", +", handle.size,
                             ") does not lie inside the segment of ", handle.segment_size,
                             " bytes"));
  }
  if (handle.kind == IpcKind::kLegacy) {
    std::string key(reinterpret_cast<const char*>(handle.opaque.data()), handle.opaque.size());
    std::lock_guard<std::mutex> lk(st.mu);
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
      if (!ProcessAlive(handle.exporter)) {
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
        if (!ProcessAlive(handle.exporter)) {
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
  std::lock_guard<std::mutex> lk(st.mu);
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
    ThrowCu(*d, r, absl::StrCat("ImportMemory: mapping a segment of ", size, " bytes on cuda:",
                                index, " (cuMemAddressReserve/cuMemMap/cuMemSetAccess)"),
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
  bool needs_unmap = false;  // the last reference to a legacy import goes
  std::vector<internal::Imported*> victims;  // idle imports over the bounds
  {
    std::lock_guard<std::mutex> lk(st.mu);
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
  std::lock_guard<std::mutex> lk(st.mu);
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
  std::lock_guard<std::mutex> lk(st.mu);
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
    if (b->prev) b->prev->next = head; else seg->first = head;
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

IpcEventHandle CudaBackend::RecordIpcEvent(int index) {
  Enter(index, "RecordIpcEvent");
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  IpcEventHandle h;
  h.exporter = getpid();
  CUstream stream = nullptr;
  {
    std::lock_guard<std::mutex> lk(st.mu);
    stream = st.stream;
    // Everything queued so far has finished (the usual case after a synchronous copy): nothing
    // to wait for, and no event a receiver would have to open while this process still lives.
    // That includes the IPC waits queued on the stream: they are done, so they are forgotten
    // (kept, they would make every later send record an event, and the list would only grow).
    if (st.failure.empty() && d->cuStreamQuery(stream) == CUDA_SUCCESS) {
      st.waits.clear();
      h.complete = true;
      return h;
    }
    size_t slot = static_cast<size_t>(st.next_slot % kIpcEventPoolCapacity);
    bool have = slot < st.pool.size();
    if (!have && slot == st.pool.size()) {
      CUevent ev = nullptr;
      CUipcEventHandle eh{};
      if (d->cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) {
        if (d->cuIpcGetEventHandle(&eh, ev) == CUDA_SUCCESS) {
          st.pool.push_back(ev);
          st.pool_handles.push_back(eh);
          have = true;
        } else {
          d->cuEventDestroy(ev);
        }
      }
    }
    if (!have && !st.pool.empty()) {  // the pool could not grow: reuse what it has
      slot = static_cast<size_t>(st.next_slot % st.pool.size());
      have = true;
    }
    if (have) {
      const CUresult r = d->cuEventRecord(st.pool[slot], stream);
      if (r != CUDA_SUCCESS) ThrowCu(*d, r, absl::StrCat("RecordIpcEvent on cuda:", index));
      ++st.next_slot;
      h.complete = false;
      h.fd = ctx_->exit_fd;  // borrowed: read by receivers if this process is gone
      h.pool_id = st.pool_id;
      h.slot = static_cast<uint32_t>(slot);
      h.sequence = ++st.sequence;
      static_assert(sizeof(CUipcEventHandle) == 64, "CUipcEventHandle is 64 bytes");
      std::memcpy(h.opaque.data(), st.pool_handles[slot].reserved, 64);
      return h;
    }
  }
  // No event at all: the work is done when the stream is.
  SyncStream(*ctx_, st, "RecordIpcEvent");
  h.complete = true;
  return h;
}

void CudaBackend::WaitIpcEvent(int index, const IpcEventHandle& event) {
  Enter(index, "WaitIpcEvent");
  if (event.complete) return;
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  std::lock_guard<std::mutex> lk(st.mu);
  CUevent ev = nullptr;
  if (event.exporter == getpid() && event.pool_id == st.pool_id) {
    if (event.slot >= st.pool.size()) {
      throw Error(ErrorCode::kInvalidArgument, "WaitIpcEvent: no such slot in this process's pool");
    }
    ev = st.pool[event.slot];
  } else {
    const auto key = std::make_pair(event.exporter, std::make_pair(event.pool_id, event.slot));
    auto it = st.opened.find(key);
    if (it != st.opened.end()) {
      ev = it->second.event;
    } else {
      if (st.opened.size() >= 1024) {  // forget events of exporters that have exited
        for (auto o = st.opened.begin(); o != st.opened.end();) {
          const bool awaited = std::any_of(st.waits.begin(), st.waits.end(),
                                           [&](const auto& w) { return w.event == o->second.event; });
          if (!awaited && !ProcessAlive(o->second.exporter)) {
            d->cuEventDestroy(o->second.event);
            o = st.opened.erase(o);
          } else {
            ++o;
          }
        }
      }
      CUipcEventHandle eh{};
      std::memcpy(eh.reserved, event.opaque.data(), 64);
      const CUresult r = d->cuIpcOpenEventHandle(&ev, eh);
      if (r != CUDA_SUCCESS) {
        if (!ProcessAlive(event.exporter) && ExitedAfterFinishingItsWork(event.fd)) return;
        if (!ProcessAlive(event.exporter)) {
          // Its work may or may not have finished: say so at the next Synchronize.
          st.failure = absl::StrCat("process ", event.exporter,
                                    " exited before its IPC event could be opened here "
                                    "(cuIpcOpenEventHandle: ",
                                    internal::CuResultText(*d, r),
                                    "); the data it wrote may be incomplete");
          return;
        }
        ThrowCu(*d, r, "WaitIpcEvent: cuIpcOpenEventHandle",
                "the handle must come from RecordIpcEvent of a CUDA backend");
      }
      st.opened[key] = internal::OpenedEvent{ev, event.exporter};
    }
  }
  // Waits queued earlier that the stream has passed are done: forget them (bounded list).
  if (!st.waits.empty() && d->cuStreamQuery(st.stream) == CUDA_SUCCESS) st.waits.clear();
  const CUresult r = d->cuStreamWaitEvent(st.stream, ev, 0);
  if (r != CUDA_SUCCESS) ThrowCu(*d, r, absl::StrCat("WaitIpcEvent on cuda:", index));
  if (event.exporter != getpid()) {
    st.waits.push_back(internal::PendingWait{ev, event.exporter, st.next_ticket++});
  }
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
    std::lock_guard<std::mutex> lk(st.mu);
    victims = TakeIdleVictims(st, true);
  }
  SyncBeforeUnmap(*ctx_, st, "EmptyCache", victims);  // freed blocks' work too
  std::lock_guard<std::mutex> lk(st.mu);
  ReleaseFreeSegments(ctx_->d, st);
  for (internal::Imported* imp : victims) DestroyImport(ctx_->d, st, imp);
}

#else  // !FORKSAFE_HAVE_CUDA_HEADERS: a backend without devices.

namespace internal {
struct CudaContext {};
}  // namespace internal

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
