// device/sim_backend.h: a simulated accelerator that behaves like a GPU across fork().
//
// What it offers
//   A backend that lets every fork rule be tested on machines without a GPU. Like a CUDA
//   context, its context belongs to the process that initialized it:
//   - each device has its own memory (a private mapping per device), reachable only through the
//     backend; its pointers are tagged, non-canonical addresses that fault if dereferenced on
//     the host, so forgetting an explicit Copy is caught at once;
//   - a device thread (the "stream") executes copies, memsets and kernels in order; Copy waits for
//     its own completion, LaunchKernel does not (Synchronize waits for everything queued);
//   - the context does not survive fork(): a child forked after initialization finds the
//     backend poisoned (ErrorCode::kForkPoisoned), exactly as CUDA refuses to re-initialize in a
//     forked child.
//
// Configuration (read on every query; never initializes the backend)
//   FORKSAFE_SIM_DEVICES    number of devices, 0..16 (default 2)
//   FORKSAFE_SIM_MEMORY_MB  memory per device in MiB, 1..65536 (default 64)
//
// Thread safety: all methods are thread-safe.
#ifndef FORKSAFE_DEVICE_SIM_BACKEND_H_
#define FORKSAFE_DEVICE_SIM_BACKEND_H_

#include <sys/types.h>

#include <functional>
#include <memory>

#include "device/backend.h"

namespace forksafe::device {

namespace internal {
struct SimContext;
}  // namespace internal

/// The simulated accelerator backend (DeviceType::kSimAccel).
class SimBackend final : public Backend {
 public:
  SimBackend();
  ~SimBackend() override;

  DeviceType type() const override { return DeviceType::kSimAccel; }
  std::string name() const override { return "sim"; }
  ForkBehavior fork_behavior() const override { return ForkBehavior::kPoisonInChild; }
  int DeviceCount() const override;
  DeviceProperties Properties(int index) const override;

  /// Queues `kernel` on device `index`'s stream, after all earlier work. It runs on the device
  /// thread with a host view of [ptr, ptr + bytes), which must lie inside one allocation.
  /// Returns at once; errors thrown by the kernel surface from the next Synchronize.
  void LaunchKernel(int index, void* ptr, size_t bytes,
                    std::function<void(void* view, size_t bytes)> kernel);

  /// Bytes currently allocated on device `index` (0 before initialization).
  size_t BytesInUse(int index) const;
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
  void DoForkChild() override;

 private:
  internal::SimContext* ctx_ = nullptr;  // owned by the process that initialized; leaked after fork
};

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_SIM_BACKEND_H_
