// device/cpu_backend.h: host memory as a backend.
//
// What it offers
//   The CPU backend: one device ("cpu"), 64-byte aligned host memory, memcpy/memset, a no-op
//   Synchronize. It is fork-safe: a forked child keeps using it (and its inherited allocations).
//
// Thread safety: all methods are thread-safe.
#ifndef FORKSAFE_DEVICE_CPU_BACKEND_H_
#define FORKSAFE_DEVICE_CPU_BACKEND_H_

#include "forksafe/device/backend.h"

namespace forksafe::device {

/// Host memory backend.
class CpuBackend final : public Backend {
 public:
  /// Alignment of every allocation, in bytes.
  static constexpr size_t kAlignment = 64;

  DeviceType type() const override { return DeviceType::kCPU; }
  std::string name() const override { return "cpu"; }
  ForkBehavior fork_behavior() const override { return ForkBehavior::kForkSafe; }
  int DeviceCount() const override { return 1; }
  DeviceProperties Properties(int index) const override;

 protected:
  void DoInitialize() override {}
  void* DoAllocate(int index, size_t bytes) override;
  void DoFree(int index, void* ptr) override;
  void DoCopy(void* dst, Device dst_device, const void* src, Device src_device,
              size_t bytes) override;
  void DoMemset(int index, void* ptr, int value, size_t bytes) override;
  void DoSynchronize(int index) override {}
};

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_CPU_BACKEND_H_
