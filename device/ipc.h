// device/ipc.h: exporting device memory to other processes, and ordering their work after ours.
//
// What it offers
//   IpcBackend is the one interface through which accelerator memory crosses processes. The
//   simulated accelerator (sim_backend.h) and the CUDA backend (cuda_backend.h) implement it; the
//   sharing layer (mp/sharing.h) uses it to send device tensors through Queue, Pipe, Process
//   arguments and Pool, so that CI exercises the whole path without a GPU.
//
//   - Segments. Memory from Backend::Allocate lives in exportable segments (the simulated
//     accelerator: memfds; CUDA: cuMemCreate allocations with POSIX file descriptor handles).
//     ExportMemory describes a range of one segment plus a descriptor of the segment; the
//     receiver's ImportMemory maps the segment once per process (reserve, map, set access) and
//     returns a device pointer to the range.
//   - Legacy handles. Memory forksafe did not allocate (a framework's own cudaMalloc) can only be
//     exported with ExportLegacyMemory: a handle that is valid only while the exporting process
//     keeps the allocation alive (the "producer keeps the tensor" rule, which applies there and
//     only there; mp/ enforces it with reference counts).
//   - Events. RecordIpcEvent marks the point in the exporter's stream after all work queued so
//     far; WaitIpcEvent makes the receiver's stream wait for it, so it never reads half-written
//     data. Events come from a recycled pool of bounded size per device; when no event can be
//     had, the exporter synchronizes instead and the handle says there is nothing to wait for.
//
// Lifetimes (guarantees)
//   - A segment's memory stays valid for as long as any process maps it or holds a descriptor of
//     it: the exporter may free its tensor or exit right after exporting. The kernel (memfd) or the
//     driver (cuMemCreate handles) counts the references, so a process killed with SIGKILL lets go
//     of its mappings like any other.
//   - The exporter's caching allocator must not hand a freed block to a new allocation while
//     another process still reads it: HoldAfterFree(ptr, released) keeps the block out of reuse
//     after Free until released() returns true (mp/ passes "no other process holds a reference").
//   - ImportMemory maps a segment once per process however often it arrives; each successful
//     ImportMemory is balanced by one ReleaseImported. When the last import goes, the segment is
//     unmapped (its device memory returned, if no one else holds it), or, where the backend says
//     so (CUDA), kept mapped idle for the next message naming it until EmptyCache.
//   - Memory imported here can be exported again (passed on to a third process), also after its
//     first exporter exited.
//
// Fork behaviour
//   Every method initializes the backend like any operation, so in a forked child of a process
//   that used it they throw ErrorCode::kForkPoisoned (use the spawn or forkserver start method).
//   MemoryInfo is the exception only in that it, too, needs the backend (it is not a query).
//
// Thread safety: all methods are thread-safe.
//
// Errors: runtime::Error, as everywhere (runtime/error.h): kInvalidArgument for a pointer or
// handle that does not describe this backend's memory, kFailedPrecondition for a legacy handle
// whose exporter has exited, kResourceExhausted when memory or descriptors run out, kInternal for
// a failing driver or system call (the message names it).
#ifndef FORKSAFE_DEVICE_IPC_H_
#define FORKSAFE_DEVICE_IPC_H_

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "forksafe/device/device.h"

namespace forksafe::device {

/// How the memory behind an export stays alive.
enum class IpcKind : uint8_t {
  kSegment = 0,  ///< A shareable segment: valid while any process maps it or holds its descriptor.
  kLegacy = 1,   ///< A legacy handle: valid only while the exporter keeps the allocation alive.
};

/// Exported device memory: what a receiver needs to map it. Plain data; it does not own `fd`.
struct IpcMemoryHandle {
  Device device;
  IpcKind kind = IpcKind::kSegment;
  /// kSegment: a descriptor of the segment (-1 for kLegacy). ExportMemory returns a descriptor
  /// that the caller owns and must close; ImportMemory only borrows the one it is given.
  int fd = -1;
  uint64_t segment_id = 0;    ///< Identity of the segment (or legacy allocation) across processes.
  uint64_t segment_size = 0;  ///< Bytes of the whole segment (or legacy allocation).
  uint64_t offset = 0;        ///< Start of the exported range inside the segment.
  uint64_t size = 0;          ///< Bytes of the exported range.
  pid_t exporter = 0;         ///< The exporting process.
  std::array<uint8_t, 64> opaque{};  ///< kLegacy: the backend's own handle bytes.
};

/// A point in the exporter's stream. Plain data; it does not own `fd`.
struct IpcEventHandle {
  /// True when the exporter synchronized instead of recording (no event could be had): there is
  /// nothing to wait for.
  bool complete = true;
  int fd = -1;            ///< The event pool's descriptor where the backend needs one, else -1.
  uint64_t pool_id = 0;   ///< Identity of the exporter's event pool.
  uint32_t slot = 0;      ///< Which event of the pool.
  uint64_t sequence = 0;  ///< Which recording of that event.
  pid_t exporter = 0;     ///< The recording process.
  std::array<uint8_t, 64> opaque{};  ///< The backend's own event handle bytes (CUDA).
};

/// Device memory as the device sees it, across all processes.
struct IpcMemoryInfo {
  size_t free = 0;   ///< Bytes free on the device.
  size_t total = 0;  ///< Bytes the device has.
};

/// Implemented by backends whose memory can cross processes (Backend::ipc()).
class IpcBackend {
 public:
  virtual ~IpcBackend() = default;

  /// Describes [ptr, ptr + bytes), which lies inside one block this process allocated with
  /// Allocate or imported with ImportMemory, for another process. The returned fd is new and the
  /// caller's to close. Throws kInvalidArgument for any other range.
  virtual IpcMemoryHandle ExportMemory(int index, const void* ptr, size_t bytes) = 0;

  /// Describes [ptr, ptr + bytes) of memory this backend did not allocate (a framework's own
  /// allocation) with a legacy handle. HAZARD: the receiver's mapping is valid only while this
  /// process keeps that allocation alive. Throws kUnavailable where the backend has no legacy
  /// handles, kInvalidArgument for a range that is not device memory.
  virtual IpcMemoryHandle ExportLegacyMemory(int index, const void* ptr, size_t bytes) = 0;

  /// Maps what `handle` describes and returns its device pointer (on handle.device). The fd is
  /// borrowed (duplicated when the segment is new here). A segment of this process's own comes
  /// back as the original pointer. Throws kInvalidArgument for a handle that does not describe a
  /// segment of this backend, kFailedPrecondition for a legacy handle whose exporter has exited.
  virtual void* ImportMemory(const IpcMemoryHandle& handle) = 0;

  /// Balances one ImportMemory that returned `ptr`. Unmaps the segment when no import of it is
  /// left (a backend may keep it mapped, idle, until EmptyCache). Throws kInvalidArgument for a
  /// pointer that is not an import, or one released as often as it was imported.
  virtual void ReleaseImported(int index, void* ptr) = 0;

  /// After Free(ptr), keeps the block that starts at `ptr` out of reuse until `released()`
  /// returns true. released() is polled when memory is needed and by EmptyCache; it must be
  /// cheap, must not throw and must not call into this backend.
  virtual void HoldAfterFree(int index, const void* ptr, std::function<bool()> released) = 0;

  /// Records an event after all work queued on device `index` by this process.
  virtual IpcEventHandle RecordIpcEvent(int index) = 0;

  /// Makes this process's later work on device `index` wait for `event` (which may come from
  /// another process). Returns at once; the wait happens on the device's stream. If the recording
  /// process dies before the event completes, the next Synchronize throws kProcessFailed.
  virtual void WaitIpcEvent(int index, const IpcEventHandle& event) = 0;

  /// Free and total memory of device `index`, counting every process's allocations and imports.
  virtual IpcMemoryInfo MemoryInfo(int index) = 0;

  /// Returns the cached, unused segments of device `index` to the device (held blocks whose
  /// released() now returns true count as unused), and unmaps idle imports.
  virtual void EmptyCache(int index) = 0;

  /// Events the pool of device `index` may hold at most (recycled beyond that).
  virtual int IpcEventPoolCapacity(int index) const = 0;
};

/// The IPC interface of `device`'s backend. Throws kUnavailable, naming the cure, for a device
/// whose memory cannot cross processes this way (CPU memory crosses through mp/'s shared memory).
IpcBackend& GetIpcBackend(Device device);

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_IPC_H_
