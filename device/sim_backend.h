// device/sim_backend.h: a simulated accelerator that behaves like a GPU across fork().
//
// What it offers
//   A backend that lets every fork rule and the whole interprocess path be tested on machines
//   without a GPU. Like a CUDA context, its context belongs to the process that initialized it:
//   - each device has its own memory, reachable only through the backend; its pointers are
//     tagged, non-canonical addresses that fault if dereferenced on the host, so forgetting an
//     explicit Copy is caught at once;
//   - memory comes in exportable segments, like CUDA's cuMemCreate with POSIX descriptor
//     handles: each segment is a memfd ("forksafe_simseg_<device>_<bytes>", mode 0600) of a
//     multiple of 2 MiB (the "allocation granularity"); allocations up to 1 MiB are carved from
//     shared 2 MiB segments, larger ones get segments of their own; freed blocks are cached and
//     coalesce within their segment (EmptyCache gives unused segments back);
//   - IpcBackend (device/ipc.h): segments cross processes as descriptors; an importer maps a
//     segment once; the memory lives while any process maps it or holds its descriptor, so the
//     exporter may free or exit at once. Events are slots of a shared page ("forksafe_simevt"),
//     recorded and waited on through the device threads, from a recycled pool per process;
//   - AllocateForeign()/FreeForeign() stand for a framework's own cudaMalloc: memory forksafe's
//     allocator does not own, which only legacy handles (ExportLegacyMemory) can share and which
//     dies with its exporter or its FreeForeign, exactly the legacy IPC rule;
//   - a device thread (the "stream") executes copies, memsets and kernels in order; Copy waits for
//     its own completion, LaunchKernel does not (Synchronize waits for everything queued);
//   - the context does not survive fork(): a child forked after initialization finds the
//     backend poisoned (ErrorCode::kForkPoisoned), exactly as CUDA refuses to re-initialize in a
//     forked child;
//   - at a fork whose other threads are all parked pool workers, the idle device thread is
//     parked too (it starts nothing queued until the parent callback), so that the fork stays
//     quiet (runtime/at_fork.h, NoteThreadsParkedForFork); a busy one is left running, as
//     before. A kernel that runs oneTBB has the device thread's oneTBB state dropped after it.
//
// Configuration (read on every query; never initializes the backend)
//   FORKSAFE_SIM_DEVICES    number of devices, 0..16 (default 2)
//   FORKSAFE_SIM_MEMORY_MB  memory per device in MiB, 1..65536 (default 64): what one process may
//                           have in its own segments on the device (imports do not count)
//   FORKSAFE_SIM_IPC_EVENTS interprocess events per device and process, 0..1024 (default 64;
//                           0 makes RecordIpcEvent synchronize instead, the fallback path)
//
// Memory accounting: BytesInUse() is this process's live allocations; MemoryInfo() is the device
// as a GPU would report it, machine-wide: every sim segment of that device that any process
// still maps or holds a descriptor of (found in /proc, deduplicated by inode), cached ones
// included.
//
// Thread safety: all methods are thread-safe.
#ifndef FORKSAFE_DEVICE_SIM_BACKEND_H_
#define FORKSAFE_DEVICE_SIM_BACKEND_H_

#include <sys/types.h>

#include <functional>
#include <memory>

#include "forksafe/device/backend.h"
#include "forksafe/device/ipc.h"

namespace forksafe::device {

namespace internal {
struct SimContext;
}  // namespace internal

/// The simulated accelerator backend (DeviceType::kSimAccel).
class SimBackend final : public Backend, public IpcBackend {
 public:
  SimBackend();
  ~SimBackend() override;

  DeviceType type() const override { return DeviceType::kSimAccel; }
  std::string name() const override { return "sim"; }
  ForkBehavior fork_behavior() const override { return ForkBehavior::kPoisonInChild; }
  int DeviceCount() const override;
  DeviceProperties Properties(int index) const override;
  IpcBackend* ipc() override { return this; }
  void FinishQueuedWork() override;

  /// Queues `kernel` on device `index`'s stream, after all earlier work. It runs on the device
  /// thread with a host view of [ptr, ptr + bytes), which must lie inside one allocation.
  /// Returns at once; errors thrown by the kernel surface from the next Synchronize.
  void LaunchKernel(int index, void* ptr, size_t bytes,
                    std::function<void(void* view, size_t bytes)> kernel);

  /// Bytes currently allocated on device `index` by this process (0 before initialization).
  size_t BytesInUse(int index) const;
  /// Bytes of segments this process created on device `index` and still holds, cached included.
  size_t BytesReserved(int index) const;

  /// Memory the caching allocator does not own, standing for a framework's own cudaMalloc: only
  /// ExportLegacyMemory can share it, and importers lose it when it is freed here or this process
  /// exits. Free it with FreeForeign (Free refuses it).
  void* AllocateForeign(int index, size_t bytes);
  /// Frees memory from AllocateForeign.
  void FreeForeign(int index, void* ptr);

  // IpcBackend (device/ipc.h).
  IpcMemoryHandle ExportMemory(int index, const void* ptr, size_t bytes) override;
  IpcMemoryHandle ExportLegacyMemory(int index, const void* ptr, size_t bytes) override;
  void* ImportMemory(const IpcMemoryHandle& handle) override;
  void ReleaseImported(int index, void* ptr) override;
  void HoldAfterFree(int index, const void* ptr, std::function<bool()> released) override;
  IpcEventHandle RecordIpcEvent(int index) override;
  void WaitIpcEvent(int index, const IpcEventHandle& event) override;
  IpcMemoryInfo MemoryInfo(int index) override;
  void EmptyCache(int index) override;
  int IpcEventPoolCapacity(int index) const override;
  /// The pid that created the context, or 0 if none was created in this lineage.
  pid_t context_owner() const;

 protected:
  void DoInitialize() override;
  void* DoAllocate(int index, size_t bytes) override;
  void DoFree(int index, void* ptr) override;
  void DoCopy(void* dst, Device dst_device, const void* src, Device src_device,
              size_t bytes) override;
  void DoMemset(int index, void* ptr, int value, size_t bytes) override;
  void DoSynchronize(int index) override;
  void DoForkPrepare() override;
  void DoForkParent() override;
  // No DoForkChild: in a forked child the device thread does not exist and the context's mutexes
  // may be held by threads that do not exist either, so the context is abandoned untouched (its
  // mappings stay, never used again; its descriptors are close-on-exec and die with the child).

 private:
  internal::SimContext* ctx_ = nullptr;  // owned by the process that initialized; leaked after fork
};

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_SIM_BACKEND_H_
