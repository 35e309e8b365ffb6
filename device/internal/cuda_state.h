// device/internal/cuda_state.h: NOT FOR USERS. The CUDA backend's per-process and per-device
// state, and the helpers its files share.
//
// What it offers
//   The records of the CUDA backend (device/cuda_backend.h): a device's caching allocator
//   (Segment, Block), its imports (Imported, LegacyImport), its IPC events (OpenedEvent,
//   PendingWait), all in DeviceState, and the process's CudaContext; and the functions that more
//   than one of its files call. The files, by component:
//     device/cuda_backend.cc            the Backend: queries, initialization, kept resources,
//                                       allocation, copies, memsets, the exit drain
//     device/internal/cuda_context.cc   driver errors, per-device setup, stream synchronization
//     device/internal/cuda_allocator.cc the caching allocator and the idle-import cache
//     device/internal/cuda_ipc.cc       exporting and importing memory, holds after free
//     device/internal/cuda_ipc_events.cc interprocess events
//
// Guarantees
//   - Everything of a DeviceState marked FORKSAFE_GUARDED_BY(mu) is read and written only with its
//     `mu` held; functions marked FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) expect the caller to
//     hold it, and Dev/SyncStream must be called without it.
//   - `index` is fixed at creation; `dev`, `ctx`, `granularity` and `prop` are written once, under
//     `mu`, by EnsureDeviceLocked before `ready` becomes true, and only read afterwards (Dev takes
//     `mu` before anything reads them).
//   - Lock order: a DeviceState's mu before CudaContext::fds_mu; never two devices' mu at once.
//
// Hazards
//   - Fork: a CudaContext belongs to the process that initialized CUDA (`owner`). A forked child
//     finds the backend poisoned and never touches the context, its locks or its tables.
#ifndef FORKSAFE_DEVICE_INTERNAL_CUDA_STATE_H_
#define FORKSAFE_DEVICE_INTERNAL_CUDA_STATE_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/cuda_driver.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::device::internal {

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

inline constexpr size_t kRound = 512;                     // every block is a multiple of this
inline constexpr size_t kSmallMax = size_t{1} << 20;      // requests up to 1 MiB share segments...
inline constexpr size_t kSmallSegment = size_t{2} << 20;  // ...of 2 MiB (at least the granularity)
// Imports no tensor uses any more stay mapped (idle) for the next message that names the same
// segment, up to this many segments and bytes per device, least recently used out first.
inline constexpr size_t kIdleImportsMax = 32;
inline constexpr size_t kIdleImportBytesMax = size_t{1} << 30;
// Exported segments that keep their shareable descriptor, per device; beyond that the least
// recently exported one closes it (and asks the driver again at its next export).
inline constexpr size_t kKeptExportFdsMax = 256;

struct Segment;

struct Block {
  Segment* seg = nullptr;
  size_t offset = 0;
  size_t size = 0;
  bool allocated = false;
  bool held = false;                   // freed, kept out of reuse until `released` says so
  std::function<bool()> released;      // for held blocks
  std::function<bool()> hold_on_free;  // HoldAfterFree called while still allocated
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

inline CUdeviceptr Block::addr() const { return seg->base + offset; }

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
  runtime::internal::Mutex mu;
  std::atomic<bool> ready{false};
  // Written once by EnsureDeviceLocked (see the banner).
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  size_t granularity = 0;
  CUmemAllocationProp prop{};

  CUstream stream FORKSAFE_GUARDED_BY(mu) = nullptr;
  std::map<CUdeviceptr, Segment*> segments FORKSAFE_GUARDED_BY(mu);  // own, by base
  std::unordered_map<uint64_t, Segment*> segments_by_id FORKSAFE_GUARDED_BY(mu);
  std::map<CUdeviceptr, Block*> allocated FORKSAFE_GUARDED_BY(mu);  // by address
  std::set<Block*, BySize> free_small FORKSAFE_GUARDED_BY(mu), free_large FORKSAFE_GUARDED_BY(mu);
  std::vector<Block*> held FORKSAFE_GUARDED_BY(mu);
  // Recently freed block starts (HoldAfterFree).
  std::unordered_map<CUdeviceptr, size_t> freed_sizes FORKSAFE_GUARDED_BY(mu);
  size_t allocated_bytes FORKSAFE_GUARDED_BY(mu) = 0;
  size_t reserved_bytes FORKSAFE_GUARDED_BY(mu) = 0;

  std::map<CUdeviceptr, Imported*> imports FORKSAFE_GUARDED_BY(mu);  // by base
  std::unordered_map<uint64_t, Imported*> imports_by_id FORKSAFE_GUARDED_BY(mu);
  std::vector<Imported*> idle_imports
      FORKSAFE_GUARDED_BY(mu);  // refs == 0, still mapped; oldest first
  size_t idle_import_bytes FORKSAFE_GUARDED_BY(mu) = 0;
  size_t kept_export_fds FORKSAFE_GUARDED_BY(mu) = 0;  // own segments with export_fd >= 0
  uint64_t export_clock FORKSAFE_GUARDED_BY(mu) = 0;
  std::map<CUdeviceptr, LegacyImport*> legacy FORKSAFE_GUARDED_BY(mu);  // by base
  std::map<std::string, LegacyImport*> legacy_by_key FORKSAFE_GUARDED_BY(mu);
  // id -> range
  std::unordered_map<uint64_t, std::pair<CUdeviceptr, size_t>> own_legacy FORKSAFE_GUARDED_BY(mu);

  uint64_t pool_id FORKSAFE_GUARDED_BY(mu) = 0;
  std::vector<CUevent> pool FORKSAFE_GUARDED_BY(mu);
  std::vector<CUipcEventHandle> pool_handles FORKSAFE_GUARDED_BY(mu);
  uint64_t next_slot FORKSAFE_GUARDED_BY(mu) = 0;
  uint64_t sequence FORKSAFE_GUARDED_BY(mu) = 0;
  std::map<std::pair<pid_t, std::pair<uint64_t, uint32_t>>, OpenedEvent> opened
      FORKSAFE_GUARDED_BY(mu);
  // IPC waits queued since the last completed synchronize.
  std::vector<PendingWait> waits FORKSAFE_GUARDED_BY(mu);
  uint64_t next_ticket FORKSAFE_GUARDED_BY(mu) = 0;
  // Set when an awaited exporter died before its event could be opened.
  std::string failure FORKSAFE_GUARDED_BY(mu);
};

struct CudaContext {
  const CudaDriver* d = nullptr;
  pid_t owner = 0;
  // A page other processes can read after this one is gone: 1 once it exited normally with all
  // its streams synchronized (its IPC events cannot be opened then, but all its work was done).
  int exit_fd = -1;
  uint32_t* exit_word = nullptr;
  std::vector<std::unique_ptr<DeviceState>> devices;  // fixed once initialized
  runtime::internal::Mutex fds_mu;
  // Descriptors the driver opened during initialization.
  std::set<int> driver_fds FORKSAFE_GUARDED_BY(fds_mu);
};

// ---- small helpers ------------------------------------------------------------------------------

inline std::string P(const void* p) {
  return absl::StrCat("0x", absl::Hex(reinterpret_cast<uintptr_t>(p)));
}
inline CUdeviceptr DevPtr(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
}
inline void* HostPtr(CUdeviceptr p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

// The entry of `m` (by base address) whose [base, base + size) holds [p, p + n), or null.
template <typename T>
T* RangeOf(std::map<CUdeviceptr, T*>& m, CUdeviceptr p, size_t n) {
  auto it = m.upper_bound(p);
  if (it == m.begin()) return nullptr;
  --it;
  T* x = it->second;
  return p >= x->base && p + n <= x->base + x->size && n <= x->size ? x : nullptr;
}

// ---- device/internal/cuda_context.cc ------------------------------------------------------------

/// Throws runtime::Error for a failed driver call: kResourceExhausted for out of memory,
/// kInvalidArgument for invalid values or handles, kUnavailable for unsupported, else kInternal.
[[noreturn]] void ThrowCu(const CudaDriver& d, CUresult r, const std::string& what,
                          const std::string& advice = "");

// Calls the driver through `d` (a const CudaDriver* in scope) and throws on failure.
#define FS_CU(call, what)                                      \
  do {                                                         \
    const CUresult fs_cu_r = (call);                           \
    if (fs_cu_r != CUDA_SUCCESS) ThrowCu(*d, fs_cu_r, (what)); \
  } while (0)

/// Per-device setup on first use.
void EnsureDeviceLocked(CudaContext& c, DeviceState& st) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// The device's state, set up and its context current on this thread.
DeviceState& Dev(CudaContext& c, int index);
/// Waits for the device's stream. With IPC waits queued, polls, and fails (kProcessFailed) when
/// an awaited event is still incomplete and its exporter has exited: that stream would wait
/// forever, so the device gets a fresh one.
void SyncStream(CudaContext& c, DeviceState& st, const char* what) FORKSAFE_LOCKS_EXCLUDED(st.mu);
/// Work queued on memory about to be unmapped must finish first: synchronizes the stream before
/// the caller destroys `victims` (of TakeIdleVictims); if that throws, they go back to idle.
void SyncBeforeUnmap(CudaContext& c, DeviceState& st, const char* what,
                     const std::vector<Imported*>& victims) FORKSAFE_LOCKS_EXCLUDED(st.mu);
/// Synchronizes every stream this process used, then marks the exit page (see CudaContext).
void DrainAndMark(CudaContext* c);

// ---- device/internal/cuda_allocator.cc ----------------------------------------------------------

std::set<Block*, BySize>& PoolOf(DeviceState& st, const Segment* seg)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// Makes `b` free (not held) and merges it with free neighbours; inserts the result in its pool.
void InsertFree(DeviceState& st, Block* b) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// Releases every fully free own segment that no import of this process uses. The caller has
/// synchronized the stream (work queued on freed blocks has finished).
void ReleaseFreeSegments(const CudaDriver* d, DeviceState& st)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// Unmaps and releases an import (refs == 0, no longer idle). The caller has synchronized the
/// stream (work queued on the memory has finished).
void DestroyImport(const CudaDriver* d, DeviceState& st, Imported* imp)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// Takes `imp` off the idle list (it is used again, or about to be destroyed).
void TakeOffIdle(DeviceState& st, Imported* imp) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// Idle imports over the bounds (all of them when `all`), oldest first, taken off the idle list
/// and out of imports_by_id, so that no ImportMemory can use one again while the caller, having
/// unlocked st.mu, synchronizes the stream before destroying them (a message naming the segment
/// meanwhile maps it anew).
std::vector<Imported*> TakeIdleVictims(DeviceState& st, bool all)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// Puts victims of TakeIdleVictims back (the synchronize before their destruction failed): idle
/// again, usable again unless the segment was mapped anew meanwhile.
void ReturnIdleVictims(DeviceState& st, const std::vector<Imported*>& victims)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// Reserves `size` bytes of address space, maps `h` there and gives this device read-write
/// access; on failure undoes what it did (the caller releases `h`).
CUresult ReserveAndMap(const CudaDriver* d, const DeviceState& st, CUmemGenericAllocationHandle h,
                       size_t size, CUdeviceptr* va);
/// Allocates `bytes` from the device's cache, creating a segment when none fits.
void* AllocateLocked(const CudaDriver* d, DeviceState& st, size_t bytes)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);
/// The own segment containing [p, p + n), or null.
Segment* OwnSegmentOf(DeviceState& st, CUdeviceptr p, size_t n)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu);

#else  // !FORKSAFE_HAVE_CUDA_HEADERS: the backend has no devices and no state.

struct CudaContext {};

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

}  // namespace forksafe::device::internal

#endif  // FORKSAFE_DEVICE_INTERNAL_CUDA_STATE_H_
