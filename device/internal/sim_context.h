// device/internal/sim_context.h: NOT FOR USERS. The simulated accelerator's context: its memory
// (segments, blocks, the caching allocator), its stream (one device thread) and its event pages.
//
// What it offers
//   SimContext and the plain records it holds, shared by the three files of the simulated
//   accelerator: device/sim_backend.cc (the Backend methods), device/internal/sim_ipc.cc (the
//   IpcBackend methods) and device/internal/sim_context.cc (the context's own methods). The
//   behaviour users see is described in device/sim_backend.h.
//
// Guarantees
//   - Memory state (devices, event_pools, peer_pages) is guarded by mem_mu, the stream's queue
//     and counters by q_mu; functions marked FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu) expect the
//     caller to hold it. Lock order: mem_mu before q_mu (RecordIpcEvent takes q_mu after
//     releasing mem_mu; nothing takes mem_mu while holding q_mu).
//   - num_devices and capacity are written once by SimBackend::DoInitialize before the context
//     is published, and only read afterwards.
//
// Hazards
//   - Fork: the context belongs to the process that created it (`owner`). A forked child never
//     touches it (its device thread does not exist there and its locks may be held by threads
//     that are gone): the backend is poisoned in the child, and every registered callback checks
//     `owner` first.
#ifndef FORKSAFE_DEVICE_INTERNAL_SIM_CONTEXT_H_
#define FORKSAFE_DEVICE_INTERNAL_SIM_CONTEXT_H_

#include <sys/mman.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::device::internal {

inline constexpr uint64_t kTag = 0xF5ull << 56;  // non-canonical on x86-64 and arm64
inline constexpr uint64_t kTagMask = 0xFFull << 56;
inline constexpr int kIndexShift = 40;  // 1 TiB of address space per device
inline constexpr uint64_t kOffsetMask = (1ull << kIndexShift) - 1;
inline constexpr size_t kAlign = 256;
inline constexpr size_t kGranularity = size_t{2} << 20;  // segment sizes are multiples of this
inline constexpr size_t kSmallMax = size_t{1} << 20;     // up to this, blocks share 2 MiB segments
inline constexpr size_t kEventPageBytes = 4096;
inline constexpr int kMaxEvents = static_cast<int>(kEventPageBytes / sizeof(uint32_t));
inline constexpr auto kEventWaitLimit = std::chrono::seconds(120);

inline constexpr char kSegmentName[] = "forksafe_simseg_";      // + <device>_<bytes>
inline constexpr char kForeignName[] = "forksafe_simforeign_";  // + <device>_<bytes>
inline constexpr char kEventName[] = "forksafe_simevt";

/// FORKSAFE_SIM_DEVICES, FORKSAFE_SIM_MEMORY_MB (in bytes) and FORKSAFE_SIM_IPC_EVENTS, checked.
int SimDeviceCount();
size_t SimMemoryBytes();
int SimIpcEvents();

/// What /proc/self/fd/<fd> points at ("/memfd:NAME (deleted)"), or "".
std::string FdTarget(const std::string& proc_path);
/// Parses "/memfd:<prefix><device>_<bytes>..." into bytes when the device matches.
bool ParseSimMemfd(const std::string& target, const char* prefix, int device, size_t* bytes);
/// The futex system call.
long Futex(uint32_t* addr, int op, uint32_t val, const timespec* timeout);
/// Sums the sizes of the sim segments of `index` that any visible process maps or holds a
/// descriptor of, each counted once.
size_t MachineWideBytes(int index);

// One memfd mapped into this process, at a range of the device's address space.
struct SimSegment {
  enum Kind { kOwn, kForeign, kImported };
  Kind kind = kOwn;
  int fd = -1;
  char* host = nullptr;
  size_t size = 0;
  uint64_t va = 0;                       // device offset of its first byte
  uint64_t id = 0;                       // identity across processes
  std::map<size_t, size_t> free_blocks;  // kOwn: offset in segment -> length
  size_t live = 0;                       // kOwn: blocks allocated or held
  int imports = 0;                       // ImportMemory calls that returned memory of it

  ~SimSegment() {
    if (host != nullptr) munmap(host, size);
    if (fd >= 0) close(fd);
  }
};

struct SimBlock {
  size_t len = 0;
  SimSegment* seg = nullptr;
  bool parked = false;             // freed by the user, held for other processes
  std::function<bool()> released;  // set by HoldAfterFree
};

struct SimDeviceMemory {
  size_t capacity = 0;
  size_t reserved = 0;  // bytes of kOwn + kForeign segments
  size_t in_use = 0;    // bytes of live (not parked) blocks
  uint64_t next_va = kGranularity;
  std::map<uint64_t, std::unique_ptr<SimSegment>> segments;  // by va
  std::map<uint64_t, SimSegment*> by_id;
  std::map<uint64_t, SimBlock> blocks;  // kOwn and kForeign blocks, by va
};

// A page of event words, shared with other processes.
struct SimEventPage {
  int fd = -1;
  uint32_t* words = nullptr;
  uint64_t id = 0;
  ~SimEventPage() {
    if (words != nullptr) munmap(words, kEventPageBytes);
    if (fd >= 0) close(fd);
  }
};

struct SimEventPool {
  std::shared_ptr<SimEventPage> page;
  int capacity = 0;
  uint32_t next = 0;
  std::vector<uint32_t> sequence;  // last recording per slot
};

struct SimContext {
  pid_t owner = 0;
  int num_devices = 0;  // fixed at initialization (see the banner)
  size_t capacity = 0;  // bytes per device, fixed at initialization
  mutable runtime::internal::Mutex mem_mu;
  std::vector<SimDeviceMemory> devices FORKSAFE_GUARDED_BY(mem_mu);
  std::vector<SimEventPool> event_pools FORKSAFE_GUARDED_BY(mem_mu);  // per device
  std::map<uint64_t, std::shared_ptr<SimEventPage>> peer_pages
      FORKSAFE_GUARDED_BY(mem_mu);  // by id

  // The stream: one device thread running queued operations in order.
  runtime::internal::Mutex q_mu;
  runtime::internal::CondVar q_cv;
  runtime::internal::CondVar done_cv;
  std::deque<std::function<void()>> queue FORKSAFE_GUARDED_BY(q_mu);
  uint64_t submitted FORKSAFE_GUARDED_BY(q_mu) = 0;
  uint64_t completed FORKSAFE_GUARDED_BY(q_mu) = 0;
  std::exception_ptr async_error FORKSAFE_GUARDED_BY(q_mu);
  // Parked for a fork (ParkForFork): the device thread starts nothing queued until it is false.
  // Written under q_mu; read without it by the parent callback, so that a fork that did not park
  // the thread does not take q_mu (a write to its page) afterwards.
  std::atomic<bool> parked_for_fork{false};
  std::thread device_thread;

  // ---- the stream (device/internal/sim_context.cc) ----
  void Run() FORKSAFE_LOCKS_EXCLUDED(q_mu);
  uint64_t Enqueue(std::function<void()> op) FORKSAFE_LOCKS_EXCLUDED(q_mu);
  void WaitFor(uint64_t ticket) FORKSAFE_LOCKS_EXCLUDED(q_mu);
  void WaitAll() FORKSAFE_LOCKS_EXCLUDED(q_mu);
  void Drain() FORKSAFE_LOCKS_EXCLUDED(q_mu);
  // Rethrows (once) an error of earlier stream work, like a sticky CUDA error at the next
  // synchronous call.
  void RaiseAsyncError() FORKSAFE_LOCKS_EXCLUDED(q_mu);
  // For the fork's prepare callback: parks the device thread when it is idle and parking it makes
  // the fork quiet (runtime/at_fork.h, NoteThreadsParkedForFork); never waits for q_mu.
  void ParkForFork() FORKSAFE_LOCKS_EXCLUDED(q_mu);
  // For the parent callback (and a roll-back): lets a parked device thread go on.
  void UnparkAfterFork() FORKSAFE_LOCKS_EXCLUDED(q_mu);

  // ---- addresses ----
  static uint64_t Encode(int index, uint64_t va) {
    return kTag | (static_cast<uint64_t>(index) << kIndexShift) | va;
  }
  static void* Pointer(int index, uint64_t va) {
    return reinterpret_cast<void*>(Encode(index, va));
  }
  // The device offset of a tagged pointer of device `index`; throws for anything else.
  static uint64_t Offset(int index, const void* dev_ptr, const char* what);

  // ---- memory ----
  // The segment holding device offset `off`, or null.
  SimSegment* SegmentAt(SimDeviceMemory& dev, uint64_t off)
      FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
  // Translates a tagged device pointer into a host view of `bytes` bytes, checking that the
  // range lies inside one live (or held) block, or inside an imported segment.
  char* Translate(int index, const void* dev_ptr, size_t bytes, const char* what)
      FORKSAFE_LOCKS_EXCLUDED(mem_mu);
  // Maps `fd` (owned from now on) as a segment of `dev`.
  SimSegment* AddSegment(int index, SimDeviceMemory& dev, SimSegment::Kind kind, int fd,
                         size_t size, uint64_t id) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
  void DropSegment(SimDeviceMemory& dev, SimSegment* seg) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
  // A new memfd of `size` bytes, reserved so that running out is an error here, not a SIGBUS.
  static int CreateMemfd(int index, const char* prefix, size_t size);
  // Returns held blocks whose holders all let go to their segments.
  void ReclaimParked(SimDeviceMemory& dev) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
  // Puts the kOwn block at `va` back on its segment's free list, coalescing.
  void ReturnBlock(SimDeviceMemory& dev, uint64_t va) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
  // Unmaps own segments with no live or held block.
  void ReleaseFreeSegments(SimDeviceMemory& dev) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
  // First fit over the cached free blocks.
  void* Carve(int index, SimDeviceMemory& dev, size_t need)
      FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
  // Makes room for `size` more reserved bytes, or throws.
  void Reserve(int index, SimDeviceMemory& dev, size_t size, size_t requested)
      FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
  // The event pool of device `index`, its page created on first use.
  SimEventPool& EventPool(int index) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mem_mu);
};

}  // namespace forksafe::device::internal

#endif  // FORKSAFE_DEVICE_INTERNAL_SIM_CONTEXT_H_
