// device/storage.h: a reference-counted block of device memory.
//
// What it offers
//   `Storage` is a handle to one block of memory on one device. Copies of the handle share the
//   block; the block is released when the last handle goes. A Storage is made in one of two ways:
//   - Storage::Allocate(device, nbytes) allocates through the backend registry and frees through
//     it (device/registry.h); on the CPU, a sharing layer may serve it from shared memory instead
//     (born-shared storages: StorageSharing::allocate_host in device/storage_sharing.h, mp/'s
//     opt-in mp::set_tensors_born_shared), and is_shared() is then true from the start;
//   - Storage::FromExternal(device, data, nbytes, deleter) wraps memory that someone else
//     allocated; `deleter(data)` runs when the last handle goes. This is how DLPack imports
//     (device/dlpack.h) and memory mapped from shared segments (mp/) become tensors.
//   Tensors (device/tensor.h) are views over a Storage. What a sharing layer (mp/) may do to a
//   storage beyond this API is the extension point of device/storage_sharing.h.
//
// Guarantees
//   - The reference count is atomic: handles to the same block may be copied and destroyed from
//     any threads at once. The release (Free or deleter) runs exactly once, on the thread that
//     drops the last handle.
//   - The block's size and device never change. Its address changes only when the sharing layer
//     moves the contents into shared memory (MoveStorageData of device/storage_sharing.h, used by
//     mp/'s share_memory_()); every handle and tensor over the block sees the new address at once.
//   - Zero-byte storages are allowed; their data() may be null and nothing is ever freed.
//   - is_shared() and sharing_context() may be read and written from any thread.
//
// Fork behaviour
//   A Storage is plain process memory bookkeeping and is inherited by a forked child like any
//   other object. Whether its *memory* is usable there is the device's business:
//   - CPU memory is readable in the child (copy-on-write: the child's writes are its own unless
//     the memory is a shared segment from mp/, born-shared storages included: there a child's
//     writes land in the parent's memory);
//   - memory of a backend that is poisoned in the child (the simulated accelerator, CUDA) cannot be
//     touched there (operations throw kForkPoisoned). Dropping the last handle to such a block in
//     the child does not throw: the block belongs to the parent's device context, so the child
//     quietly forgets it (the parent still frees its own handle normally).
//
// Hazards
//   - MoveStorageData (device/storage_sharing.h) releases the old memory: a raw data() pointer
//     taken before the move dangles afterwards, and a move racing with another thread's use of
//     the data is a use-after-free. mp/ moves a block only from share_memory_(), which documents
//     this.
//   - A deleter passed to FromExternal must not throw. If it does, the exception is caught and
//     reported on stderr (a destructor cannot throw).
//   - A fork at the very instant another thread is inside set_sharing_context(),
//     sharing_context(), MoveStorageData() or WrapStorageRelease() of the same Storage leaves that
//     storage's small internal lock held in the child; calling any of them on that storage in the
//     child would then block forever.
#ifndef FORKSAFE_DEVICE_STORAGE_H_
#define FORKSAFE_DEVICE_STORAGE_H_

#include <cstddef>
#include <functional>
#include <memory>

#include "forksafe/device/device.h"

namespace forksafe::device {

namespace internal {
struct StorageImpl;
struct StorageAccess;
}  // namespace internal

/// A shared, reference-counted block of memory on one device. Copies share the block.
class Storage {
 public:
  /// An empty (zero-byte, null) CPU storage.
  Storage();

  /// Allocates `nbytes` on `device` through the backend registry; freed through the registry when
  /// the last handle goes. The memory is uninitialized. On the CPU the installed sharing layer may
  /// place it in shared memory instead (see the banner; then is_shared() is true). `nbytes` == 0
  /// allocates nothing (data() is null). Throws kInvalidArgument/kUnavailable for a device that
  /// does not exist, kResourceExhausted when memory runs out, kForkPoisoned in a forked child for a
  /// poisoned backend.
  static Storage Allocate(Device device, size_t nbytes);

  /// Wraps `nbytes` of existing memory at `data` on `device`. `deleter(data)` runs exactly once,
  /// when the last handle goes; an empty deleter means the memory is borrowed and the caller keeps
  /// it alive for as long as any handle (or tensor over it) exists. Throws kInvalidArgument for a
  /// null `data` with a non-zero size, kInvalidArgument/kUnavailable for a device that does not
  /// exist. If it throws, the deleter is not called and the memory stays the caller's.
  static Storage FromExternal(Device device, void* data, size_t nbytes,
                              std::function<void(void*)> deleter);

  /// Address of the block: a host pointer for the CPU, a device pointer otherwise (for the
  /// simulated accelerator, a tagged address that must not be dereferenced on the host). Changes
  /// only through MoveStorageData (device/storage_sharing.h; see the hazard above).
  void* data() const;
  /// Size of the block in bytes.
  size_t nbytes() const;
  /// The device the block lives on.
  Device device() const;
  /// Number of handles to this block in this process (tensors over it count: each holds one).
  /// Like std::shared_ptr::use_count, exact only when no other thread copies or drops handles.
  long use_count() const;

  /// True when the sharing layer (mp/) has placed this block in memory that other processes can
  /// map. Always false for storages made by Allocate or FromExternal until mp/ says otherwise.
  bool is_shared() const;
  /// Set by the sharing layer (mp/) only. Const: it marks the shared block, not this handle.
  void set_shared(bool shared) const;

  /// An opaque slot for the sharing layer (mp/): it keeps here whatever describes the shared
  /// segment behind this block (name, handle, its own reference). device/ never looks inside.
  /// Null unless mp/ set it.
  std::shared_ptr<void> sharing_context() const;
  /// Set by the sharing layer (mp/) only. Const: it changes the shared block, not this handle.
  void set_sharing_context(std::shared_ptr<void> context) const;

  /// True when both handles refer to the same block (identity, not contents).
  friend bool operator==(const Storage& a, const Storage& b) { return a.impl_ == b.impl_; }
  friend bool operator!=(const Storage& a, const Storage& b) { return !(a == b); }

 private:
  friend struct internal::StorageAccess;  // device/internal/storage_impl.h
  explicit Storage(std::shared_ptr<internal::StorageImpl> impl);

  std::shared_ptr<internal::StorageImpl> impl_;  // never null
};

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_STORAGE_H_
