#include "forksafe/device/storage.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/storage_impl.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/storage_sharing.h"
#include "forksafe/runtime/error.h"

namespace forksafe::device {
namespace internal {

void Release(const Device& device, size_t nbytes, const std::function<void(void*)>& deleter,
             void* data) noexcept {
  if (!deleter) return;
  try {
    deleter(data);
  } catch (const runtime::Error& e) {
    // Memory of a backend poisoned by fork belongs to the parent's context: forgetting it here
    // is the only correct thing to do, and it is expected, so it is silent.
    if (e.code() != runtime::ErrorCode::kForkPoisoned) {
      std::fprintf(stderr, "forksafe: releasing a %s storage of %zu bytes failed in pid %d: %s\n",
                   device.ToString().c_str(), nbytes, static_cast<int>(getpid()), e.what());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "forksafe: the deleter of a %s storage of %zu bytes threw in pid %d: %s "
                 "(deleters must not throw)\n",
                 device.ToString().c_str(), nbytes, static_cast<int>(getpid()), e.what());
  } catch (...) {
    std::fprintf(stderr,
                 "forksafe: the deleter of a %s storage of %zu bytes threw a non-std exception "
                 "in pid %d (deleters must not throw)\n",
                 device.ToString().c_str(), nbytes, static_cast<int>(getpid()));
  }
}

}  // namespace internal

using internal::StorageImpl;

Storage::Storage() : impl_(std::make_shared<StorageImpl>(kCPU, nullptr, 0, nullptr)) {}

Storage::Storage(std::shared_ptr<StorageImpl> impl) : impl_(std::move(impl)) {}

Storage Storage::Allocate(Device device, size_t nbytes) {
  CheckDevice(device);
  if (nbytes == 0) return Storage(std::make_shared<StorageImpl>(device, nullptr, 0, nullptr));
  if (device.is_cpu()) {
    // Born shared when the sharing layer says so (device/storage_sharing.h).
    const StorageSharing* sharing = GetStorageSharing();
    Storage shared;
    if (sharing != nullptr && sharing->allocate_host != nullptr &&
        sharing->allocate_host(nbytes, &shared)) {
      return shared;
    }
  }
  void* p = device::Allocate(device, nbytes);
  std::function<void(void*)> release = [device](void* ptr) {
    Backend& b = GetBackend(device.type);
    if (b.poisoned()) return;  // a forked child: the parent's context owns this memory
    b.Free(device.index, ptr);
  };
  try {
    auto impl = std::make_shared<StorageImpl>(device, p, nbytes, std::move(release));
    impl->from_allocate = true;
    return Storage(std::move(impl));
  } catch (...) {
    device::Free(device, p);
    throw;
  }
}

Storage Storage::FromExternal(Device device, void* data, size_t nbytes,
                              std::function<void(void*)> deleter) {
  CheckDevice(device);
  if (data == nullptr && nbytes != 0) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         absl::StrCat("Storage::FromExternal on ", device.ToString(),
                                      " was given a null pointer with a size of ", nbytes,
                                      " bytes; pass the memory's address, or a size of 0"));
  }
  return Storage(std::make_shared<StorageImpl>(device, data, nbytes, std::move(deleter)));
}

void* Storage::data() const { return impl_->data.load(std::memory_order_acquire); }
size_t Storage::nbytes() const { return impl_->nbytes; }
Device Storage::device() const { return impl_->device; }
long Storage::use_count() const { return impl_.use_count(); }

bool Storage::is_shared() const { return impl_->shared.load(std::memory_order_acquire); }
void Storage::set_shared(bool shared) const {
  impl_->shared.store(shared, std::memory_order_release);
}

std::shared_ptr<void> Storage::sharing_context() const {
  runtime::internal::MutexLock lk(&impl_->mu);
  return impl_->sharing_context;
}

void Storage::set_sharing_context(std::shared_ptr<void> context) const {
  std::shared_ptr<void> old;
  {
    runtime::internal::MutexLock lk(&impl_->mu);
    old = std::exchange(impl_->sharing_context, std::move(context));
  }
  // `old` is released here, outside the lock: its destructor may do anything.
}

}  // namespace forksafe::device
