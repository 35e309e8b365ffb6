// device/storage_sharing.cc: the sharing layer's extension point (device/storage_sharing.h).
#include "forksafe/device/storage_sharing.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/storage_impl.h"
#include "forksafe/runtime/error.h"

namespace forksafe::device {

using internal::StorageAccess;
using internal::StorageImpl;
using runtime::Error;
using runtime::ErrorCode;

namespace {
std::atomic<const StorageSharing*> g_sharing{nullptr};
}  // namespace

void InstallStorageSharing(const StorageSharing* sharing) {
  if (sharing == nullptr || sharing->share_host_storage == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "InstallStorageSharing: a null table or callback");
  }
  const StorageSharing* expected = nullptr;
  if (g_sharing.compare_exchange_strong(expected, sharing, std::memory_order_acq_rel) ||
      expected == sharing) {
    return;
  }
  throw Error(ErrorCode::kAlreadyExists,
              absl::StrCat("InstallStorageSharing: the sharing layer \"", expected->layer,
                           "\" is installed already; \"", sharing->layer,
                           "\" cannot replace it (one sharing layer per process)"));
}

const StorageSharing* GetStorageSharing() { return g_sharing.load(std::memory_order_acquire); }

bool ShareHostStorage(const Storage& storage) {
  if (!storage.device().is_cpu()) return false;
  const StorageSharing* sharing = GetStorageSharing();
  if (sharing == nullptr) return false;
  sharing->share_host_storage(storage);
  return true;
}

WeakStorage::WeakStorage(const Storage& storage) : impl_(StorageAccess::Shared(storage)) {}

std::optional<Storage> WeakStorage::Lock() const {
  std::shared_ptr<StorageImpl> p = impl_.lock();
  if (!p) return std::nullopt;
  return StorageAccess::Make(std::move(p));
}

void MoveStorageData(const Storage& storage, void* new_data,
                     std::function<void(void*)> new_deleter) {
  StorageImpl& impl = StorageAccess::Impl(storage);
  if (new_data == nullptr && impl.nbytes != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("MoveStorageData: null destination for a ", impl.device.ToString(),
                             " storage of ", impl.nbytes, " bytes"));
  }
  void* old_data = nullptr;
  std::function<void(void*)> old_deleter;
  {
    runtime::internal::MutexLock lk(&impl.mu);
    old_data = impl.data.exchange(new_data, std::memory_order_acq_rel);
    old_deleter = std::exchange(impl.deleter, std::move(new_deleter));
  }
  internal::Release(impl.device, impl.nbytes, old_deleter, old_data);  // outside the lock
}

void WrapStorageRelease(
    const Storage& storage,
    const std::function<std::function<void(void*)>(std::function<void(void*)>)>& wrap) {
  StorageImpl& impl = StorageAccess::Impl(storage);
  runtime::internal::MutexLock lk(&impl.mu);
  impl.deleter = wrap(std::move(impl.deleter));
}

bool IsBackendAllocation(const Storage& storage) {
  return StorageAccess::Impl(storage).from_allocate;
}

}  // namespace forksafe::device
