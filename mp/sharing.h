// mp/sharing.h: tensors that cross processes without copies, and the sharing strategies.
//
// What it offers
//   - get_all_sharing_strategies() / get_sharing_strategy() / set_sharing_strategy(), as in
//     torch.multiprocessing: "file_descriptor" (the default) and "file_system".
//   - share_memory_(tensor): moves a CPU tensor's storage into shared memory, in place: every
//     tensor over that storage (views included) sees the move. is_shared() then reports true.
//   - Tensors as values of the codec: a device::Tensor put on a Queue, sent on a Pipe, passed as a
//     Process/spawn argument or given to / returned from a Pool task moves to shared memory (if it
//     is not there yet) and crosses as a handle (segment, offset, size, shape, strides), never as
//     bytes. The receiver maps the segment once; the same storage sent twice arrives as views of
//     one storage.
//
// Strategies
//   file_descriptor: segments are anonymous memory files (memfd, mode 0600) passed with
//     SCM_RIGHTS. Tensors are carved from a caching arena of a few large segments, and a receiver
//     keeps one descriptor per segment, not per tensor: 100,000 shared tensors live under a
//     1,024-descriptor limit (PyTorch keeps one per storage and hits "Too many open files").
//   file_system: segments are named POSIX shm objects
//     ("/forksafe_<pid>_<128 bits from getrandom()>", mode 0600) passed by name; the creator
//     unlinks a segment once no reference to it is left anywhere.
//
// Lifetimes (guarantees)
//   A shared CPU tensor stays valid in a receiver after the sender dropped it or exited: every
//   block carries a reference count shared by all processes, including references in flight.
//   Memory is reused by its creator once the count drops to zero, and returns to the system when
//   the last process unmaps its segment. Running out of memory or of /dev/shm is a clear
//   Error(kResourceExhausted) at allocation, never a SIGBUS.
//
// Hazards
//   - share_memory_() changes where the storage's data lives: raw pointers taken earlier
//     (data_ptr()) point at the old private memory. Take pointers after sharing.
//   - Writes to a shared tensor are seen by every process that holds it; synchronize them (Lock,
//     Event, Queue) as you would threads.
#ifndef FORKSAFE_MP_SHARING_H_
#define FORKSAFE_MP_SHARING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "device/tensor.h"
#include "mp/codec.h"
#include "mp/internal/shared_arena.h"

namespace forksafe::mp {

/// {"file_descriptor", "file_system"}.
std::vector<std::string> get_all_sharing_strategies();
/// The strategy used for storages shared from now on ("file_descriptor" unless set).
std::string get_sharing_strategy();
/// Sets the strategy. Throws kInvalidArgument for an unknown name, listing the valid ones.
void set_sharing_strategy(const std::string& strategy);

/// Moves `tensor`'s storage into shared memory (in place; a no-op when already shared) and
/// returns the tensor. CPU tensors only for now: other devices throw kUnavailable.
device::Tensor& share_memory_(device::Tensor& tensor);

/// A new CPU tensor allocated directly in shared memory (no copy later).
device::Tensor SharedEmpty(const std::vector<int64_t>& shape,
                           device::DType dtype = device::DType::kFloat32);

/// Whether the shared-memory arena serves fresh tensors from its cache (default true); off, every
/// storage gets a segment of its own (for measuring what the cache saves).
void set_sharing_cache_enabled(bool enabled);

namespace internal {
/// The wire form of a tensor.
struct TensorHandle {
  uint8_t dtype = 0;
  std::vector<int64_t> shape, strides;
  int64_t offset = 0;
  SharedBlock::Handle block;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(dtype, shape, strides, offset, block);
  }
};
TensorHandle ExportTensor(const device::Tensor& t);
/// Checks what a handle from another process says before anything is mapped: a known dtype and a
/// well-formed block handle (CheckHandle). Error(kInvalidArgument) otherwise. The view itself
/// (shape, strides, offset) is checked against the block by Tensor::FromStorage.
void CheckTensorHandle(const TensorHandle& h);
device::Tensor ImportTensor(TensorHandle h);
}  // namespace internal

}  // namespace forksafe::mp

namespace forksafe::device {
// cereal hooks: a Tensor crosses as a shared-memory handle (see above).
template <class Archive>
void save(Archive& ar, const Tensor& t) {
  ar(mp::internal::ExportTensor(t));
}
template <class Archive>
void load(Archive& ar, Tensor& t) {
  mp::internal::TensorHandle h;
  ar(h);
  t = mp::internal::ImportTensor(std::move(h));
}
}  // namespace forksafe::device

#endif  // FORKSAFE_MP_SHARING_H_
