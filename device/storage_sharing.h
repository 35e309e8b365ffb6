// device/storage_sharing.h: the extension point through which a sharing layer makes storages
// cross processes.
//
// What it offers
//   The device layer owns storages (device/storage.h); placing one in memory that other processes
//   can map is the job of a sharing layer above it (mp/, the only one). This header is the whole
//   contract between the two, in both directions, so that device/ never depends on mp/ and code
//   below mp/'s sharing (mp/process.h's fork path) needs only device/:
//   - StorageSharing: the callbacks the sharing layer provides, installed once per process with
//     InstallStorageSharing() and reached through GetStorageSharing() / ShareHostStorage().
//   - Born-shared CPU storages: Storage::Allocate on the CPU asks the installed layer's
//     allocate_host first, and uses the backend's private memory only when it declines (the layer
//     decides: mp/'s opt-in, mp::set_tensors_born_shared in mp/sharing.h).
//   - What the device layer lets the sharing layer do to a storage beyond its public API:
//     WeakStorage (an identity table that does not keep blocks alive), MoveStorageData (move a
//     block's contents into shared memory in place), WrapStorageRelease (wrap a block's release,
//     to defer a framework's free while other processes map it) and IsBackendAllocation.
//
// Who installs it, and when
//   mp/ only (mp/sharing.cc), through mp::internal::InstallStorageSharing(): an explicit,
//   idempotent init function that each mp/ entry point that can need it calls first
//   (share_memory_, SharedEmpty, tensor export and import, and Process's fork path through
//   mp::internal::ShareForFork). It is installed before its first use, in every program that
//   links mp/'s sharing, with no static initializer and no reliance on `alwayslink`. Nothing else
//   may install it; the operations below are for the installed layer only.
//
// Guarantees
//   - Thread-safe: InstallStorageSharing may race with itself and with GetStorageSharing (an
//     atomic pointer to a table of static storage duration). Installing the same table again is
//     a no-op; a different one throws kAlreadyExists (one sharing layer per process).
//   - ShareHostStorage of a storage that is not on the CPU, or with nothing installed, does
//     nothing and returns false: memory stays private, as in a program without mp/.
//
// Fork behaviour
//   The installed table is plain static data: a forked child inherits it and may use it at once.
//   The operations take only the storage's own small lock (see device/storage.h's Hazards).
//
// Hazards
//   - MoveStorageData releases the old memory: raw data() pointers taken before dangle, and a move
//     racing with another thread's use of the data is a use-after-free (mp/ moves a block only
//     from share_memory_(), which documents this).
//   - WrapStorageRelease runs `wrap` under the storage's lock: it must only build the new
//     release, never touch the storage.
#ifndef FORKSAFE_DEVICE_STORAGE_SHARING_H_
#define FORKSAFE_DEVICE_STORAGE_SHARING_H_

#include <functional>
#include <memory>
#include <optional>

#include "forksafe/device/storage.h"

namespace forksafe::device {

/// The callbacks of a sharing layer. Instances must have static storage duration.
struct StorageSharing {
  /// Who installed it ("mp"), for error messages.
  const char* layer = "";
  /// Moves a CPU storage's block into memory other processes can map, in place (every handle and
  /// tensor over it sees the move); a no-op when it is shared already. Throws runtime::Error
  /// (kResourceExhausted when shared memory runs out).
  void (*share_host_storage)(const Storage& storage) = nullptr;
  /// Optional (null: never). Called by Storage::Allocate for every CPU storage of nbytes > 0:
  /// returns false to let the CPU backend allocate private memory, or true with `*out` set to a
  /// storage of `nbytes` bytes (uninitialized) already in shared memory (is_shared() true). Throws
  /// runtime::Error (kResourceExhausted when shared memory runs out); must not call
  /// Storage::Allocate on the CPU itself.
  bool (*allocate_host)(size_t nbytes, Storage* out) = nullptr;
};

/// Installs the process's sharing layer (see the banner: mp/ only). Throws kAlreadyExists when a
/// different table is installed, kInvalidArgument for a null table or callback.
void InstallStorageSharing(const StorageSharing* sharing);

/// The installed sharing layer, or null when none is (a program without mp/'s sharing).
const StorageSharing* GetStorageSharing();

/// Moves `storage` into shared memory through the installed layer when it is a CPU storage and a
/// layer is installed (returns true), else does nothing (returns false).
bool ShareHostStorage(const Storage& storage);

// ---- What the installed sharing layer may do to a storage ------------------------------------

/// A reference to a Storage's block that does not keep it alive (the sharing layer maps each
/// shared segment to one Storage with it). Thread-safe like std::weak_ptr.
class WeakStorage {
 public:
  WeakStorage() = default;
  explicit WeakStorage(const Storage& storage);
  /// True when the block has been released (or for a default-constructed WeakStorage).
  bool expired() const { return impl_.expired(); }
  /// A handle to the block, or nullopt when it has been released.
  std::optional<Storage> Lock() const;

 private:
  std::weak_ptr<internal::StorageImpl> impl_;
};

/// Makes `new_data` the block's memory for every handle and tensor over it, with `new_deleter` as
/// its release, then releases the old memory with the old release (outside the lock). The caller
/// has already copied the contents: `new_data` holds storage.nbytes() bytes on the same device.
/// Throws kInvalidArgument for a null `new_data` with a non-zero size.
void MoveStorageData(const Storage& storage, void* new_data,
                     std::function<void(void*)> new_deleter);

/// Replaces the block's release with `wrap(old_release)`, atomically (the old release is never
/// run by the device layer: the wrapper owns it). See the hazard on `wrap` above.
void WrapStorageRelease(
    const Storage& storage,
    const std::function<std::function<void(void*)>(std::function<void(void*)>)>& wrap);

/// True when the block was made by Storage::Allocate (the backend's own allocator), false for
/// FromExternal memory.
bool IsBackendAllocation(const Storage& storage);

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_STORAGE_SHARING_H_
