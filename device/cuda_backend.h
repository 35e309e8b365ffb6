// device/cuda_backend.h: NVIDIA GPUs through the CUDA driver API, loaded at run time.
//
// What it offers
//   The "cuda" backend (DeviceType::kCUDA) and its interprocess interface (device/ipc.h):
//   - Nothing is linked: libcuda.so.1 is dlopen'd on first use, so every binary starts on a
//     machine without a GPU or driver. There DeviceCount() is 0 and every operation throws
//     kUnavailable naming the cause ("libcuda.so.1 not found (...)", or "built without the CUDA
//     Toolkit headers" when @forksafe_local_cuda found none at build time; see docs/building.md).
//   - Queries never initialize CUDA in this process: DeviceCount() and Properties() ask NVML
//     (honouring CUDA_VISIBLE_DEVICES when it lists indices) or, without NVML, a short-lived forked
//     child that runs cuInit; the answer is cached for the life of the process.
//   - The first operation initializes: cuInit; then per device, on its first use, its primary
//     context and one non-blocking stream. Every call makes that context current on the calling
//     thread (and leaves it current).
//   - Memory comes from a caching allocator over exportable segments (cuMemCreate with POSIX file
//     descriptor handles, mapped with cuMemAddressReserve/cuMemMap/cuMemSetAccess): requests up
//     to 1 MiB are carved from 2 MiB segments, larger ones get a segment of their own (rounded
//     to the allocation granularity) that may later be split for others. Freed blocks coalesce
//     within their segment and are reused; EmptyCache returns fully free segments to the driver.
//
// Ordering
//   All work of this process on one device runs in order on that device's stream. Copy is
//   synchronous (it returns when the bytes have arrived, like cudaMemcpy); Memset and
//   WaitIpcEvent only queue work (Synchronize waits for it). A freed block may be reused at once
//   by this process: later work on the same stream cannot overtake earlier work.
//
// Fork behaviour
//   ForkBehavior::kPoisonInChild: a child forked after initialization finds the backend poisoned
//   (kForkPoisoned naming spawn/forkserver; its default device is cpu) and never touches the
//   driver state it inherited. A child of a process that never initialized CUDA (queries do not
//   count) initializes it for itself.
//
// Thread safety: all methods are thread-safe; each device has its own lock.
#ifndef FORKSAFE_DEVICE_CUDA_BACKEND_H_
#define FORKSAFE_DEVICE_CUDA_BACKEND_H_

#include <cstddef>
#include <functional>
#include <string>

#include "forksafe/device/backend.h"
#include "forksafe/device/ipc.h"

namespace forksafe::device {

namespace internal {
struct CudaContext;
}  // namespace internal

/// The CUDA backend. Registers itself in every build (device/cuda_backend.cc); see above.
class CudaBackend final : public Backend, public IpcBackend {
 public:
  /// Events each device's IPC event pool holds at most.
  static constexpr int kIpcEventPoolCapacity = 64;

  CudaBackend();
  ~CudaBackend() override;

  DeviceType type() const override { return DeviceType::kCUDA; }
  std::string name() const override { return "cuda"; }
  ForkBehavior fork_behavior() const override { return ForkBehavior::kPoisonInChild; }
  /// Devices CUDA shows this process; 0 without headers, driver or GPU. Never initializes.
  int DeviceCount() const override;
  /// Name and total memory (from NVML or the probe); supports_ipc is true. Never initializes.
  DeviceProperties Properties(int index) const override;
  IpcBackend* ipc() override { return this; }
  void FinishQueuedWork() override;
  /// Why there are no devices ("libcuda.so.1 not found (...)"), or "" when there are.
  std::string UnavailableReason() const override;

  // IpcBackend (device/ipc.h).
  // - ExportMemory returns a new descriptor (close-on-exec) each call: the first export of a
  //   segment asks the driver (cuMemExportToShareableHandle, 28-46 us on an H100) and keeps that
  //   descriptor until the segment is released, later exports duplicate it (under 1 us); at most
  //   256 segments per device keep one, the least recently exported gives it up first. Memory
  //   imported from another process is passed on the same way, with the descriptor its import
  //   kept (the driver cannot export an imported handle).
  //   Hazard (descriptors): each imported segment, in use or idle, holds one descriptor, as
  //   with the file_descriptor sharing strategy. A process that holds more than about a
  //   thousand large CUDA tensors from other processes needs a higher `ulimit -n`.
  // - ImportMemory borrows handle.fd; it maps a segment once per process and counts imports.
  // - ReleaseImported of the last import keeps the segment mapped, idle, for the next message
  //   that names it (a training loop passes the same buffers again: no import, map or unmap).
  //   At most 32 segments and 1 GiB per device stay idle, least recently used out first;
  //   EmptyCache (and runtime::ReleaseCachedResources) unmaps them all. Hazard: an idle
  //   import keeps its memory alive on the device after its exporter freed or exited, until
  //   then.
  IpcMemoryHandle ExportMemory(int index, const void* ptr, size_t bytes) override;
  IpcMemoryHandle ExportLegacyMemory(int index, const void* ptr, size_t bytes) override;
  void* ImportMemory(const IpcMemoryHandle& handle) override;
  void ReleaseImported(int index, void* ptr) override;
  /// May also be called before Free(ptr): the hold then starts at the Free. HAZARD: called after
  /// Free, it must come before this process's next Allocate on the device, which could reuse the
  /// block (the block would then be held after its new owner frees it, and the old reader races).
  void HoldAfterFree(int index, const void* ptr, std::function<bool()> released) override;
  /// An event of the device's pool (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING), recorded on
  /// its stream. Slots are reused round robin: a receiver waiting on a later recording of the
  /// same slot waits a little longer, never too little. Without an event (creation failed) the
  /// stream is synchronized and the handle says complete.
  IpcEventHandle RecordIpcEvent(int index) override;
  /// cuStreamWaitEvent on the device's stream with the event opened from the handle (opened once
  /// per exporter slot and cached). Synchronize then polls, and throws kProcessFailed when a
  /// waited-for event is incomplete and its exporter has exited (the device gets a new stream).
  void WaitIpcEvent(int index, const IpcEventHandle& event) override;
  /// cuMemGetInfo.
  IpcMemoryInfo MemoryInfo(int index) override;
  void EmptyCache(int index) override;
  int IpcEventPoolCapacity(int index) const override { return kIpcEventPoolCapacity; }

  /// What the caching allocator of device `index` holds (all 0 before the device is used).
  struct CacheStats {
    size_t segments = 0;           ///< Segments mapped (own, not imported).
    size_t reserved_bytes = 0;     ///< Bytes of those segments.
    size_t allocated_bytes = 0;    ///< Bytes in blocks handed out by Allocate (rounded).
    size_t held_blocks = 0;        ///< Freed blocks kept out of reuse by HoldAfterFree.
    size_t imported_segments = 0;  ///< Segments of other processes mapped here and in use.
    size_t idle_imports = 0;       ///< Imported segments no tensor uses, kept mapped (see above).
    size_t ipc_waits = 0;   ///< WaitIpcEvent waits queued that the stream was not seen past yet.
    size_t export_fds = 0;  ///< Own segments keeping their shareable descriptor (see above).
  };
  /// Statistics of device `index`. Never initializes.
  CacheStats Stats(int index) const;

 protected:
  void DoInitialize() override;
  void* DoAllocate(int index, size_t bytes) override;
  void DoFree(int index, void* ptr) override;
  void DoCopy(void* dst, Device dst_device, const void* src, Device src_device,
              size_t bytes) override;
  void DoMemset(int index, void* ptr, int value, size_t bytes) override;
  void DoSynchronize(int index) override;
  /// Does nothing: the inherited context, streams and tables belong to the parent.
  void DoForkChild() override {}

 private:
  // CheckIndex + initialization for the IpcBackend methods, with `what` in the error.
  void Enter(int index, const char* what);
  // Registers (once) the exit handler that synchronizes every stream and marks the exit page.
  void RegisterExitDrain();

  internal::CudaContext* ctx_ = nullptr;  // created by DoInitialize; leaked after fork
};

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_CUDA_BACKEND_H_
