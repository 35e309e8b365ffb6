#include "forksafe/device/cpu_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "forksafe/device/registry.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/memory_bounds.h"

namespace forksafe::device {

// Registers itself with the device registry at load time (this library is alwayslink).
FORKSAFE_REGISTER_BACKEND(DeviceType::kCPU, CpuBackend);

DeviceProperties CpuBackend::Properties(int index) const {
  CheckIndex(index, "Properties");
  DeviceProperties p;
  p.name = "host memory";
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  p.total_memory = pages > 0 && page_size > 0 ? static_cast<size_t>(pages) * page_size : 0;
  p.host_accessible = true;
  p.supports_ipc = false;  // plain host memory; shared tensors come with mp/
  return p;
}

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// FORKSAFE_CPU_HUGEPAGES=0 turns the huge-page placement off (the banner's trade-off); read once
// (a refused value throws each time: a static's initialisation that throws is tried again).
bool HugePagesWanted() {
  static const bool wanted = CpuBackend::HugePagesSetting(std::getenv("FORKSAFE_CPU_HUGEPAGES"));
  return wanted;
}

}  // namespace

bool CpuBackend::HugePagesSetting(const char* value) {
  if (value == nullptr || *value == '\0' || std::strcmp(value, "1") == 0) return true;
  if (std::strcmp(value, "0") == 0) return false;
  throw runtime::Error(
      runtime::ErrorCode::kInvalidArgument,
      absl::StrCat("FORKSAFE_CPU_HUGEPAGES=\"", value,
                   "\" is neither 0 nor 1: set it to 0 to keep large CPU blocks out of transparent "
                   "huge pages, or to 1 (or unset it) to place them there"));
}

void* CpuBackend::DoAllocate(int index, size_t bytes) {
  // Bounded before anything is reserved: rounding must not wrap (SIZE_MAX - 8 would become a
  // 0-byte block), and a size beyond physical memory + swap or the process's limits is refused
  // at once instead of succeeding under overcommit and being killed at first touch.
  const size_t rounded = runtime::internal::RoundUpOrThrow(bytes, kAlignment, "cpu: Allocate");
  runtime::internal::CheckMemoryAvailable(rounded, runtime::internal::MemoryUse::kPrivate,
                                          "cpu: Allocate");
  void* p = nullptr;
  if (rounded >= kHugePageThreshold && HugePagesWanted()) {
    // 2 MiB aligned and a whole number of 2 MiB pages, so that every page of the block can be a
    // huge one; the advice is only a hint (EINVAL where the kernel has no THP: ignored).
    const size_t huge = runtime::internal::RoundUpOrThrow(rounded, kHugePage, "cpu: Allocate");
    p = std::aligned_alloc(kHugePage, huge);
    if (p != nullptr) madvise(p, huge, MADV_HUGEPAGE);
  } else {
    p = std::aligned_alloc(kAlignment, rounded);
  }
  if (p == nullptr) {
    throw runtime::Error(runtime::ErrorCode::kResourceExhausted,
                         absl::StrCat("cpu: could not allocate ", bytes,
                                      " bytes of host memory; free tensors or lower batch sizes"));
  }
  return p;
}

void CpuBackend::DoFree(int index, void* ptr) { std::free(ptr); }

void CpuBackend::DoCopy(void* dst, Device, const void* src, Device, size_t bytes) {
  std::memmove(dst, src, bytes);
}

void CpuBackend::DoMemset(int index, void* ptr, int value, size_t bytes) {
  std::memset(ptr, value, bytes);
}

}  // namespace forksafe::device
