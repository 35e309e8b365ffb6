#include "forksafe/device/cpu_backend.h"

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

void* CpuBackend::DoAllocate(int index, size_t bytes) {
  // Bounded before anything is reserved: rounding must not wrap (SIZE_MAX - 8 would become a
  // 0-byte block), and a size beyond physical memory + swap or the process's limits is refused
  // at once instead of succeeding under overcommit and being killed at first touch.
  const size_t rounded = runtime::internal::RoundUpOrThrow(bytes, kAlignment, "cpu: Allocate");
  runtime::internal::CheckMemoryAvailable(rounded, runtime::internal::MemoryUse::kPrivate,
                                          "cpu: Allocate");
  void* p = std::aligned_alloc(kAlignment, rounded);
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
