// device/cpu_backend.h: host memory as a backend.
//
// What it offers
//   The CPU backend: one device ("cpu"), 64-byte aligned host memory, memcpy/memset, a no-op
//   Synchronize. It is fork-safe: a forked child keeps using it (and its inherited allocations).
//
// Large blocks in huge pages
//   A block of kHugePageThreshold (4 MiB) or more is 2 MiB aligned, rounded up to 2 MiB, and
//   advised to the kernel as transparent huge pages (madvise(MADV_HUGEPAGE)), as the kernel's
//   default THP mode "madvise" expects. First touch then costs one fault per 2 MiB instead of one
//   per 4 KiB (64 MiB filled: 7 ms against 320-580 ms on a VM whose faults are slow, and its free
//   1 ms against 10-14 ms: docs/performance.md, "Fresh large tensors"). Where THP is "never" the
//   advice is ignored and nothing changes.
//   Trade-off: after a fork, the first write of either process to such a page copies 2 MiB, not
//   4 KiB (a child that writes one float of an inherited 64 MiB tensor copies 2 MiB). A process
//   that forks children which write into large inherited tensors, and cares about that latency,
//   sets FORKSAFE_CPU_HUGEPAGES=0 (read once, at the first large allocation): blocks are then
//   allocated as before. "1", "" or unset mean huge pages; any other value is refused: the large
//   allocation throws kInvalidArgument saying what to set (a typo is not silently ignored).
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
  /// Blocks of at least this many bytes are placed in transparent huge pages (see the banner).
  static constexpr size_t kHugePageThreshold = size_t{4} << 20;

  DeviceType type() const override { return DeviceType::kCPU; }
  std::string name() const override { return "cpu"; }
  ForkBehavior fork_behavior() const override { return ForkBehavior::kForkSafe; }
  int DeviceCount() const override { return 1; }
  DeviceProperties Properties(int index) const override;

  /// Reads a FORKSAFE_CPU_HUGEPAGES value (nullptr when unset): true for unset, "" or "1",
  /// false for "0"; any other value throws Error(kInvalidArgument) saying what to set.
  static bool HugePagesSetting(const char* value);

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
