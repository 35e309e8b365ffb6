// device/backend.h: the interface every device backend implements.
//
// What it offers
//   A Backend owns the devices of one DeviceType: it allocates and frees their memory, copies
//   between them and the host, synchronizes, and answers queries about them. The non-virtual
//   public methods enforce the fork rules once for all backends; implementations override the
//   protected Do*() hooks.
//
// Fork behaviour
//   - Queries (DeviceCount, Properties, fork_behavior) never initialize the backend and are safe
//     in a forked child.
//   - The first operation (Allocate, Free, Copy, Memset, Synchronize) initializes the backend in
//     this process.
//   - A backend whose ForkBehavior is kPoisonInChild and that was initialized in the parent is
//     poisoned in a forked child: every operation there throws ErrorCode::kForkPoisoned naming the
//     cure (start the process with the "spawn" or "forkserver" method). A backend that was never
//     initialized in the parent is usable in the child (it initializes there for the first time),
//     as with CUDA.
//
// Thread safety
//   All public methods are thread-safe; initialization happens once per process.
#ifndef FORKSAFE_DEVICE_BACKEND_H_
#define FORKSAFE_DEVICE_BACKEND_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "forksafe/device/device.h"

namespace forksafe::device {
class IpcBackend;
namespace internal {
struct BackendInitLock;
}  // namespace internal
}  // namespace forksafe::device

namespace forksafe::device {

/// What a forked child may do with a backend that the parent initialized.
enum class ForkBehavior {
  kForkSafe,       ///< Usable in the child (host memory).
  kPoisonInChild,  ///< Context does not survive fork (GPUs): unusable in the child.
};

/// Static facts about one device, available without initializing its backend.
struct DeviceProperties {
  std::string name;
  size_t total_memory = 0;       ///< Bytes.
  bool host_accessible = false;  ///< Whether its pointers may be dereferenced on the host.
  bool supports_ipc = false;     ///< Whether its memory can be exported to another process.
};

/// Initialization state of a backend in this process.
enum class BackendState { kUninitialized, kReady, kPoisoned };

/// Base class of every backend.
class Backend {
 public:
  Backend();
  virtual ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  /// The device type this backend serves.
  virtual DeviceType type() const = 0;
  /// A short name ("cpu", "sim").
  virtual std::string name() const = 0;
  /// How the backend behaves in a forked child.
  virtual ForkBehavior fork_behavior() const = 0;
  /// Number of devices. Never initializes the backend; safe in a forked child.
  virtual int DeviceCount() const = 0;
  /// Properties of device `index`. Never initializes. Throws kInvalidArgument for a bad index.
  virtual DeviceProperties Properties(int index) const = 0;
  /// The backend's interprocess interface (device/ipc.h), or null when its memory cannot cross
  /// processes. Never initializes.
  virtual IpcBackend* ipc() { return nullptr; }
  /// Why the backend has no devices on this machine or in this build ("no CUDA devices:
  /// libcuda.so.1 not found (...)"), or "" when that needs no explanation. With a reason,
  /// operations on a backend without devices throw kUnavailable instead of kInvalidArgument. Never
  /// initializes.
  virtual std::string UnavailableReason() const { return ""; }

  /// Allocates `bytes` (> 0) on device `index`. Throws kResourceExhausted when memory runs out.
  void* Allocate(int index, size_t bytes);
  /// Frees memory from Allocate on the same device. Throws kInvalidArgument for unknown pointers.
  void Free(int index, void* ptr);
  /// Copies `bytes` from src to dst; one side may be the host (kCPU), the other this backend's.
  void Copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
  /// Sets `bytes` bytes at `ptr` on device `index` to `value`.
  void Memset(int index, void* ptr, int value, size_t bytes);
  /// Waits until all work queued on device `index` has finished.
  void Synchronize(int index);

  /// Initializes the backend now (normally it happens on first use). Throws like any operation.
  void Initialize();
  /// Waits for the work this process queued on the devices it used, if it initialized the
  /// backend (a no-op otherwise: never initializes). Errors stay for the next operation. mp/
  /// children call it before they exit, so that tensors they sent hold what was written.
  virtual void FinishQueuedWork() {}
  /// The state in this process.
  BackendState state() const { return state_.load(std::memory_order_acquire); }
  /// True when initialized in this process (and not poisoned).
  bool initialized() const { return state() == BackendState::kReady; }
  /// True in a forked child of a process that had initialized this backend.
  bool poisoned() const { return state() == BackendState::kPoisoned; }

  /// Fork hooks, called by the device registry's at-fork handler. Not for users.
  void OnForkPrepare();
  void OnForkParent();
  void OnForkChild();

 protected:
  virtual void DoInitialize() = 0;
  virtual void* DoAllocate(int index, size_t bytes) = 0;
  virtual void DoFree(int index, void* ptr) = 0;
  virtual void DoCopy(void* dst, Device dst_device, const void* src, Device src_device,
                      size_t bytes) = 0;
  virtual void DoMemset(int index, void* ptr, int value, size_t bytes) = 0;
  virtual void DoSynchronize(int index) = 0;
  /// Extra per-backend work in the fork's prepare and parent callbacks, for a backend initialized
  /// in this process; the defaults do nothing. Prepare must not block without bound (at_fork.h,
  /// "The rule for handlers"); parent undoes what prepare did (it also runs on a roll-back).
  virtual void DoForkPrepare() {}
  virtual void DoForkParent() {}
  /// Extra per-backend work in the child after the base class updated its state, for a backend
  /// that was initialized (or being initialized) at the fork; the default does nothing. Must not
  /// touch state inherited from other threads.
  virtual void DoForkChild() {}

  /// Throws kInvalidArgument unless 0 <= index < DeviceCount().
  void CheckIndex(int index, const char* what) const;

 private:
  void EnsureUsable(const char* what);

  // The initialization lock and what it guards (backend.cc), never null.
  const std::unique_ptr<internal::BackendInitLock> init_;
  std::atomic<BackendState> state_{BackendState::kUninitialized};
  // The pid that initialized it (the parent, once poisoned): written under the initialization
  // lock before state_ is published as kReady (release), read after state_ (acquire).
  pid_t initialized_by_ = 0;
  // Whether the latest fork's prepare ran DoForkPrepare, so that DoForkParent pairs with it even
  // when another thread finished initializing in between. Only the forking thread touches it,
  // inside the fork's callbacks; written only when it changes (a page per write around a fork).
  bool fork_prepared_ = false;
};

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_BACKEND_H_
