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
//     bytes. The header that carries the tensor is enough (mp/codec.h declares the hooks; this
//     component defines them). The receiver maps the segment once; the same storage sent twice
//     arrives as views of one storage.
//   - Born-shared CPU tensors (opt-in, beyond torch): set_tensors_born_shared(true) for the whole
//     process, or a BornSharedScope on one thread, makes every new CPU storage (Tensor::Empty,
//     Zeros, Full, the results of operations: whatever goes through device::Storage::Allocate)
//     come from the shared arena, as SharedEmpty does: is_shared() from birth, and share_memory_()
//     or a send moves no bytes. Off by default; see its Hazards below.
//
// Strategies
//   file_descriptor: segments are anonymous memory files (memfd, mode 0600) passed with
//     SCM_RIGHTS. Tensors are carved from a caching arena of a few large segments, and a receiver
//     keeps one descriptor per segment, not per tensor: 100,000 shared tensors live under a
//     1,024-descriptor limit (PyTorch keeps one per storage and hits "Too many open files").
//     A tensor over 16 MiB gets a segment of its own; when it is freed its creator keeps the
//     segment (mapped, warm) on a bounded cache for the next large tensor, reused only once no
//     process holds it: at most min(256 MiB or set_sharing_large_cache_limit, a quarter of the
//     memory the system could give); dropped by runtime::ReleaseCachedResources() and whenever an
//     allocation finds memory short. A fresh 64 MiB tensor's send then costs a copy into warm
//     memory, not a new memory file, 16,384 page faults and a new mapping in the receiver.
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
// Accelerator tensors (the simulated accelerator, CUDA: backends implementing device/ipc.h)
//   A device tensor crosses without leaving the device: the receiver maps the same device memory
//   (the segment's descriptor travels with SCM_RIGHTS; the receiver imports, reserves, maps and
//   sets access once per segment).
//   - The producer may drop its tensor or exit right after sending. The memory stays valid until
//     the last process that maps it lets go, and the producer's caching allocator does not reuse
//     the block while any other process holds a reference (a small shared block counts the
//     holders in every process, references in flight included).
//   - Ordering: each send records an interprocess event after the producer's work queued so far;
//     the receiver's stream waits for it before anything it queues on the tensor, so it never
//     reads half-written data (events come from a bounded, recycled pool; without one the
//     producer synchronizes before sending).
//   - Memory forksafe did not allocate (Storage::FromExternal over a framework's own cudaMalloc)
//     can only cross through a legacy handle. THERE, AND ONLY THERE, THE PRODUCER MUST KEEP THE
//     TENSOR ALIVE while receivers use it. It is enforced: if the producer drops its last handle
//     while receivers still hold the tensor, the free is deferred until they let go and an error
//     is reported on stderr; a receiver that imports after the producer freed the memory or exited
//     gets Error(kFailedPrecondition); a producer that exits while receivers hold such memory
//     reports it on stderr at exit.
//   - A receiver killed with SIGKILL lets go of its mappings (the kernel or driver closes them);
//     its references in the producer's count are never returned, so those blocks stay out of
//     reuse until the producer exits or EmptyCache finds them released. Device memory itself is
//     freed when no process maps it.
//   - A child started with the fork method cannot touch device tensors of a parent that used the
//     device (kForkPoisoned); pass them to spawn or forkserver children.
//
// Born-shared tensors: trade-offs (read before turning it on)
//   - Memory: counted as shared memory (memfd, or /dev/shm under file_system, whose size is often
//     small in containers: running out is Error(kResourceExhausted), with no fallback to private
//     memory), in the cgroup like any memory. Small tensors are rounded up to a power of two (up
//     to 2x their size) and each allocation takes the arena's lock and registers the block: worth
//     it for tensors that will be sent, not for a program's every temporary (use a scope around the
//     code that makes them: a data-loading worker's batch assembly).
//   - Freed blocks are reused by the arena once no process holds them, as for share_memory_().
//   - No environment variable turns it on: mp/ installs nothing before its first use (no static
//     initializer), so a setting read at start could not reach tensors made before it; call
//     set_tensors_born_shared(true) at the top of main instead.
//
// Hazards
//   - Born-shared tensors and fork: a forked child maps the same memory (MAP_SHARED), so a
//     child's write into an inherited born-shared tensor changes the PARENT's tensor, unlike
//     private memory, which fork copies on write. Accepted for the opt-in (it is what
//     share_memory_() tensors always did, and what sending a tensor to a worker means), and
//     written here: a forked child must treat inherited born-shared tensors as read-only, or
//     clone them (their clone, made with the setting off, is private). And, as for every shared
//     block inherited through fork (mp/internal/shared_arena.h, "Blocks across fork"), the child
//     holds no reference of its own: once the parent frees the tensor, its memory may be reused
//     under the child.
//   - share_memory_() changes where the storage's data lives: raw pointers taken earlier
//     (data_ptr()) point at the old private memory. Take pointers after sharing.
//   - Writes to a shared tensor are seen by every process that holds it; synchronize them (Lock,
//     Event, Queue) as you would threads.
#ifndef FORKSAFE_MP_SHARING_H_
#define FORKSAFE_MP_SHARING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/shared_arena.h"

namespace forksafe::mp {

/// {"file_descriptor", "file_system"}.
std::vector<std::string> get_all_sharing_strategies();
/// The strategy used for storages shared from now on ("file_descriptor" unless set).
std::string get_sharing_strategy();
/// Sets the strategy. Throws kInvalidArgument for an unknown name, listing the valid ones.
void set_sharing_strategy(const std::string& strategy);

/// Moves `tensor`'s storage into shared memory (in place; a no-op when already shared) and
/// returns the tensor. Accelerator tensors whose backend can export memory (device/ipc.h: the
/// simulated accelerator, CUDA) are shareable where they are: this only marks them shared, as
/// torch does for CUDA. Other devices throw kUnavailable.
device::Tensor& share_memory_(device::Tensor& tensor);

/// A new CPU tensor allocated directly in shared memory (no copy later).
device::Tensor SharedEmpty(const std::vector<int64_t>& shape,
                           device::DType dtype = device::DType::kFloat32);

/// Whether the shared-memory arena serves fresh tensors from its cache (default true); off, every
/// storage gets a segment of its own (for measuring what the cache saves), and large segments are
/// neither reused nor kept.
void set_sharing_cache_enabled(bool enabled);

/// Bounds the cache of large (over 16 MiB, file_descriptor) segments kept for reuse, in bytes
/// (default 256 MiB; 0 turns it off), evicting what is over it now. The system's room bounds it
/// further (a quarter of what it could give; see the banner).
void set_sharing_large_cache_limit(size_t bytes);

/// Born-shared CPU tensors for the whole process (default false): every new CPU storage is
/// allocated in shared memory (see the banner's trade-offs and Hazards). Threads inside a
/// BornSharedScope follow their scope instead. Inherited by forked children.
void set_tensors_born_shared(bool enabled);

/// Whether a CPU storage allocated now, on this thread, is born shared.
bool tensors_born_shared();

/// Born-shared CPU tensors (or not, with `enabled` false) for this thread while the scope lives,
/// whatever the process-wide setting; scopes nest, each restoring the setting it found.
class BornSharedScope {
 public:
  explicit BornSharedScope(bool enabled = true);
  ~BornSharedScope();
  BornSharedScope(const BornSharedScope&) = delete;
  BornSharedScope& operator=(const BornSharedScope&) = delete;

 private:
  int previous_;
};

namespace internal {
/// The wire form of accelerator memory (device::IpcMemoryHandle) and of the producer's event
/// (device::IpcEventHandle), for tensors on a device whose backend implements device/ipc.h.
struct DeviceTensorWire {
  uint8_t device_type = 0;
  int32_t device_index = 0;
  uint8_t kind = 0;  // device::IpcKind
  FileDescriptor memory_fd;
  uint64_t segment_id = 0, segment_size = 0, offset = 0, size = 0;
  int32_t exporter = 0;
  uint64_t opaque[8] = {};
  bool event_complete = true;
  FileDescriptor event_fd;
  uint64_t event_pool = 0;
  uint32_t event_slot = 0;
  uint64_t event_sequence = 0;
  uint64_t event_opaque[8] = {};

  template <class Archive>
  void serialize(Archive& ar) {
    ar(device_type, device_index, kind, memory_fd, segment_id, segment_size, offset, size,
       exporter);
    for (uint64_t& w : opaque) ar(w);
    ar(event_complete, event_fd, event_pool, event_slot, event_sequence);
    for (uint64_t& w : event_opaque) ar(w);
  }
};

/// The wire form of a tensor. CPU tensors travel as a shared block; device tensors travel as a
/// small shared block that counts their holders in every process (`block`) plus `device`.
struct TensorHandle {
  uint8_t dtype = 0;
  std::vector<int64_t> shape, strides;
  int64_t offset = 0;
  SharedBlock::Handle block;
  bool on_device = false;
  DeviceTensorWire device;
  template <class Archive>
  void save(Archive& ar) const {
    ar(dtype, shape, strides, offset, block, on_device);
    if (on_device) ar(device);
  }
  template <class Archive>
  void load(Archive& ar) {
    ar(dtype, shape, strides, offset, block, on_device);
    if (on_device) ar(device);
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

#endif  // FORKSAFE_MP_SHARING_H_
