// device/internal/storage_impl.h: NOT FOR USERS. What a Storage handle points at, shared by
// device/storage.cc (the handle) and device/storage_sharing.cc (what the sharing layer may do).
//
// What it offers
//   StorageImpl (the block: device, address, size, release, sharing state), Release (runs a
//   release without ever throwing) and StorageAccess (the one friend of Storage: the block behind
//   a handle, and a handle for a block).
//
// Guarantees
//   - `mu` guards `deleter` and `sharing_context`; `data` and `shared` are atomics; `device`,
//     `nbytes` never change; `from_allocate` is written once, before the block is shared.
//
// Hazards
//   - Fork: a fork while another thread holds a block's `mu` leaves it held in the child (see
//     device/storage.h's Hazards).
#ifndef FORKSAFE_DEVICE_INTERNAL_STORAGE_IMPL_H_
#define FORKSAFE_DEVICE_INTERNAL_STORAGE_IMPL_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

#include "forksafe/device/device.h"
#include "forksafe/device/storage.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::device::internal {

/// Runs `deleter(data)`, which must not throw; reports on stderr instead of throwing when it does
/// (silently for kForkPoisoned: the parent's memory, forgotten in a forked child).
void Release(const Device& device, size_t nbytes, const std::function<void(void*)>& deleter,
             void* data) noexcept;

struct StorageImpl {
  const Device device;
  std::atomic<void*> data;
  const size_t nbytes;
  runtime::internal::Mutex mu;
  std::function<void(void*)> deleter
      FORKSAFE_GUARDED_BY(mu);  // empty: borrowed, or nothing to free
  std::atomic<bool> shared{false};
  std::shared_ptr<void> sharing_context FORKSAFE_GUARDED_BY(mu);
  bool from_allocate = false;  // made by Storage::Allocate; set once, before any sharing

  StorageImpl(Device d, void* p, size_t n, std::function<void(void*)> del)
      : device(d), data(p), nbytes(n), deleter(std::move(del)) {}

  // No handle is left, so nothing else can touch the block: no lock needed.
  ~StorageImpl() FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
    Release(device, nbytes, deleter, data.load(std::memory_order_acquire));
  }
};

/// The one friend of Storage: the block behind a handle, and a handle for a block.
struct StorageAccess {
  static StorageImpl& Impl(const Storage& s) { return *s.impl_; }
  static const std::shared_ptr<StorageImpl>& Shared(const Storage& s) { return s.impl_; }
  static Storage Make(std::shared_ptr<StorageImpl> impl) { return Storage(std::move(impl)); }
};

}  // namespace forksafe::device::internal

#endif  // FORKSAFE_DEVICE_INTERNAL_STORAGE_IMPL_H_
