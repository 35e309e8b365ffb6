#include "forksafe/mp/sharing.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "forksafe/device/ipc.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/storage.h"
#include "forksafe/device/storage_sharing.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::Mutex;
using runtime::internal::MutexLock;

namespace {

std::atomic<int> g_strategy{0};  // 0 file_descriptor, 1 file_system
std::atomic<bool> g_cache{true};
std::atomic<bool> g_born_shared{false};
// This thread's BornSharedScope: -1 none, else its setting (overrides g_born_shared).
thread_local int t_born_scope = -1;

// What mp/ keeps in a shared Storage's sharing_context(): the block it lives in.
// For a device storage, `block` is the small shared block that counts its holders in every
// process (its contents are unused).
struct SharingContext {
  std::shared_ptr<internal::SharedBlock> block;
  bool legacy = false;    // device memory shared through a legacy handle
  bool imported = false;  // device memory that came from another process
};

// Storages backed by shared blocks in this process, by block key, so that a block that arrives
// again (or comes back to its creator) becomes the same Storage.
struct Identity {
  Mutex mu;
  std::unordered_map<std::string, device::WeakStorage> by_key FORKSAFE_GUARDED_BY(mu);
  // Prune dead entries when the map grows past this (amortized O(1)).
  size_t prune_at FORKSAFE_GUARDED_BY(mu) = 4096;
};
Identity& Ids() {
  static auto* ids = new Identity();
  return *ids;
}

// Two threads sharing the same storage at once share it once.
Mutex& MovesMu() {
  static auto* mu = new Mutex();
  return *mu;
}

// Both held across every fork (registered at load time, before any thread): a child never
// inherits them held by a thread it does not have (a Python child's first shared tensor hung in
// Remember() when another thread of its parent was sharing one at the fork).
const bool g_sharing_fork_handlers = [] {
  runtime::HoldAcrossFork(&Ids().mu, "mp_sharing_identity");
  runtime::HoldAcrossFork(&MovesMu(), "mp_sharing_moves");
  return true;
}();

internal::SegmentKind Kind() {
  return g_strategy.load() == 0 ? internal::SegmentKind::kMemfd : internal::SegmentKind::kNamed;
}

// The IPC interface of a device tensor's backend, or a clear error when it has none.
device::IpcBackend& DeviceIpc(const device::Tensor& t, const char* what) {
  device::IpcBackend* ipc = device::GetBackend(t.device().type).ipc();
  if (ipc == nullptr) {
    throw Error(ErrorCode::kUnavailable,
                absl::StrCat(what, ": tensors on ", t.device().ToString(),
                             " cannot be shared between processes (its backend cannot export "
                             "memory); copy it to the CPU with To(device::kCPU) first"));
  }
  return *ipc;
}

void Remember(const std::shared_ptr<internal::SharedBlock>& block, const device::Storage& s) {
  Identity& ids = Ids();
  MutexLock lk(&ids.mu);
  if (ids.by_key.size() > ids.prune_at) {
    for (auto it = ids.by_key.begin(); it != ids.by_key.end();) {
      it = it->second.expired() ? ids.by_key.erase(it) : std::next(it);
    }
    ids.prune_at = std::max<size_t>(4096, 2 * ids.by_key.size());
  }
  ids.by_key[block->key()] = device::WeakStorage(s);
}

// Moves a CPU storage into a shared block (once) and returns its context: null only for a storage
// marked shared by someone else without one.
std::shared_ptr<SharingContext> ShareStorage(const device::Storage& s) {
  MutexLock lk(&MovesMu());
  if (s.is_shared()) return std::static_pointer_cast<SharingContext>(s.sharing_context());
  auto block = internal::SharedArena::Get().Allocate(s.nbytes(), Kind(), g_cache.load());
  if (s.nbytes() > 0) std::memcpy(block->data(), s.data(), s.nbytes());
  device::MoveStorageData(s, block->data(), [keep = block](void*) mutable { keep.reset(); });
  auto ctx = std::make_shared<SharingContext>(SharingContext{block});
  s.set_sharing_context(ctx);
  s.set_shared(true);
  Remember(block, s);
  return ctx;
}

// A new CPU storage of `bytes` in a shared block (SharedEmpty, born-shared storages).
device::Storage NewSharedStorage(size_t bytes) {
  auto block = internal::SharedArena::Get().Allocate(bytes, Kind(), g_cache.load());
  device::Storage s = device::Storage::FromExternal(
      device::kCPU, block->data(), bytes, [keep = block](void*) mutable { keep.reset(); });
  s.set_sharing_context(std::make_shared<SharingContext>(SharingContext{block}));
  s.set_shared(true);
  Remember(block, s);
  return s;
}

// The device layer's born-shared hook (StorageSharing::allocate_host): declines unless the
// opt-in is on for this thread.
bool AllocateBornShared(size_t nbytes, device::Storage* out) {
  if (!tensors_born_shared()) return false;
  *out = NewSharedStorage(nbytes);
  return true;
}

// ---- Accelerator tensors ------------------------------------------------------------------------

// Frees of legacy-shared memory that receivers still held when its producer dropped it: run when
// they let go (checked on every legacy export and import, and reported at exit if never).
struct DeferredRelease {
  std::shared_ptr<internal::SharedBlock> count;
  std::function<void(void*)> release;
  void* data;
  std::string what;
};
struct Deferred {
  Mutex mu;
  std::list<DeferredRelease> list FORKSAFE_GUARDED_BY(mu);
};
Deferred& Defer() {
  static auto* d = new Deferred();
  return *d;
}

void RunDeferredReleases() {
  std::list<DeferredRelease> ready;
  {
    Deferred& d = Defer();
    MutexLock lk(&d.mu);
    for (auto it = d.list.begin(); it != d.list.end();) {
      if (it->count->shared_count() <= 1) {
        ready.splice(ready.end(), d.list, it++);
      } else {
        ++it;
      }
    }
  }
  for (DeferredRelease& r : ready) {
    if (r.release) r.release(r.data);
  }
}

void ReportLegacyAtExit() {
  Deferred& d = Defer();
  MutexLock lk(&d.mu);
  for (const DeferredRelease& r : d.list) {
    const int32_t others = r.count->shared_count() - 1;
    if (others > 0) {
      std::fprintf(stderr,
                   "forksafe: error: pid %d exits while %d reference(s) in other processes still "
                   "use %s, shared through a legacy IPC handle; that memory dies with this "
                   "process. Keep the producer alive until receivers drop such tensors, or "
                   "allocate them with forksafe (Storage::Allocate) so that they outlive it.\n",
                   static_cast<int>(getpid()), others, r.what.c_str());
    }
  }
}

// Sets up a device storage for sending, once: its holder count, and for forksafe's own
// allocations the hold that keeps the block out of reuse while other processes use it.
std::shared_ptr<SharingContext> DeviceSharing(const device::Storage& s, device::IpcBackend& ipc) {
  static Mutex mu;  // two threads sending the same storage at once set it up once
  MutexLock lk(&mu);
  if (auto ctx = std::static_pointer_cast<SharingContext>(s.sharing_context())) return ctx;
  auto ctl = internal::SharedArena::Get().Allocate(64, Kind(), true);
  auto ctx = std::make_shared<SharingContext>(SharingContext{ctl, false});
  const int index = s.device().index;
  if (device::IsBackendAllocation(s)) {
    // Reusable by our allocator once no other process holds it (the predicate's own reference
    // is the one left).
    ipc.HoldAfterFree(index, s.data(), [ctl] { return ctl->shared_count() <= 1; });
  } else {
    // A framework's own memory: a legacy handle, valid only while this process keeps it. Defer
    // the framework's free while receivers hold it, and say that the rule was broken.
    ctx->legacy = true;
    const std::string what =
        absl::StrCat("a tensor of ", s.nbytes(), " bytes on ", s.device().ToString());
    device::WrapStorageRelease(s, [&ctl, &what](std::function<void(void*)> old) {
      return std::function<void(void*)>([ctl, old = std::move(old), what](void* data) mutable {
        if (ctl->shared_count() <= 1) {
          if (old) old(data);
          return;
        }
        std::fprintf(stderr,
                     "forksafe: error: %s shared through a legacy IPC handle was released by "
                     "its producer (pid %d) while %d reference(s) in other processes still use "
                     "it. Its free is deferred until they let go: keep the producer's tensor "
                     "alive for as long as receivers use it (memory not allocated by forksafe "
                     "cannot outlive its producer).\n",
                     what.c_str(), static_cast<int>(getpid()), ctl->shared_count() - 1);
        static const bool at_exit = [] { return std::atexit(ReportLegacyAtExit) == 0; }();
        (void)at_exit;
        Deferred& d = Defer();
        MutexLock lk(&d.mu);
        d.list.push_back(DeferredRelease{ctl, std::move(old), data, what});
      });
    });
  }
  s.set_sharing_context(ctx);
  s.set_shared(true);
  Remember(ctl, s);
  return ctx;
}

void ExportDeviceTensor(const device::Tensor& t, internal::TensorHandle& h) {
  device::IpcBackend& ipc = DeviceIpc(t, "sending a tensor");
  const device::Storage& s = t.storage();
  if (s.nbytes() == 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("sending a tensor: an empty ", t.device().ToString(),
                             " tensor has no memory to share; send its shape instead"));
  }
  std::shared_ptr<SharingContext> ctx = DeviceSharing(s, ipc);
  if (ctx->legacy && ctx->imported) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("sending a tensor: this ", t.device().ToString(),
                             " tensor arrived through a legacy IPC handle (memory its producer "
                             "allocated outside forksafe), which cannot be passed on; have the "
                             "producer send it, or copy it into a tensor allocated here"));
  }
  if (ctx->legacy) RunDeferredReleases();
  const int index = s.device().index;
  device::IpcMemoryHandle m = ctx->legacy ? ipc.ExportLegacyMemory(index, s.data(), s.nbytes())
                                          : ipc.ExportMemory(index, s.data(), s.nbytes());
  FileDescriptor memory_fd(m.fd);  // ours to close (the codec sends a duplicate)
  const device::IpcEventHandle e = ipc.RecordIpcEvent(index);
  internal::DeviceTensorWire& w = h.device;
  w.device_type = static_cast<uint8_t>(s.device().type);
  w.device_index = index;
  w.kind = static_cast<uint8_t>(m.kind);
  w.memory_fd = std::move(memory_fd);
  w.segment_id = m.segment_id;
  w.segment_size = m.segment_size;
  w.offset = m.offset;
  w.size = m.size;
  w.exporter = m.exporter;
  std::memcpy(w.opaque, m.opaque.data(), sizeof w.opaque);
  w.event_complete = e.complete;
  w.event_fd = FileDescriptor::Borrow(e.fd);  // the pool keeps it open
  w.event_pool = e.pool_id;
  w.event_slot = e.slot;
  w.event_sequence = e.sequence;
  std::memcpy(w.event_opaque, e.opaque.data(), sizeof w.event_opaque);
  h.on_device = true;
  h.block = ctx->block->Export();  // last: nothing below can fail and strand the reference
}

void CheckDeviceWire(const internal::DeviceTensorWire& w) {
  if (w.device_type == static_cast<uint8_t>(device::DeviceType::kCPU) ||
      w.device_type >= device::kNumDeviceTypes || w.device_index < 0 ||
      w.kind > static_cast<uint8_t>(device::IpcKind::kLegacy)) {
    throw Error(ErrorCode::kInvalidArgument, "malformed tensor handle: bad device section");
  }
}

device::Storage ImportDeviceStorage(internal::TensorHandle& h,
                                    std::shared_ptr<internal::SharedBlock> ctl) {
  internal::DeviceTensorWire& w = h.device;
  const device::Device dev(static_cast<device::DeviceType>(w.device_type), w.device_index);
  device::IpcBackend& ipc = device::GetIpcBackend(dev);
  if (w.kind == static_cast<uint8_t>(device::IpcKind::kLegacy)) RunDeferredReleases();
  device::IpcEventHandle e;
  e.complete = w.event_complete;
  e.fd = w.event_fd.get();
  e.pool_id = w.event_pool;
  e.slot = w.event_slot;
  e.sequence = w.event_sequence;
  e.exporter = w.exporter;
  std::memcpy(e.opaque.data(), w.event_opaque, sizeof w.event_opaque);

  device::Storage storage;
  Identity& ids = Ids();
  MutexLock lk(&ids.mu);
  auto it = ids.by_key.find(ctl->key());
  std::optional<device::Storage> known;
  if (it != ids.by_key.end()) known = it->second.Lock();
  if (known.has_value()) {
    storage = *known;  // our adopted reference goes with `ctl`
    lk.Unlock();
  } else {
    device::IpcMemoryHandle m;
    m.device = dev;
    m.kind = static_cast<device::IpcKind>(w.kind);
    m.fd = w.memory_fd.get();  // borrowed: the backend duplicates it for a new segment
    m.segment_id = w.segment_id;
    m.segment_size = w.segment_size;
    m.offset = w.offset;
    m.size = w.size;
    m.exporter = w.exporter;
    std::memcpy(m.opaque.data(), w.opaque, sizeof w.opaque);
    void* data = ipc.ImportMemory(m);
    const int index = dev.index;
    try {
      storage = device::Storage::FromExternal(
          dev, data, w.size, [&ipc, index, ctl](void* p) { ipc.ReleaseImported(index, p); });
    } catch (...) {
      ipc.ReleaseImported(index, data);
      throw;
    }
    storage.set_sharing_context(std::make_shared<SharingContext>(
        SharingContext{ctl, w.kind == static_cast<uint8_t>(device::IpcKind::kLegacy), true}));
    storage.set_shared(true);
    ids.by_key[ctl->key()] = device::WeakStorage(storage);
    lk.Unlock();
  }
  // Whatever this process queues on the tensor from now on runs after the producer's writes.
  ipc.WaitIpcEvent(dev.index, e);
  return storage;
}

// mp/'s side of the device layer's extension point (device/storage_sharing.h).
const device::StorageSharing kSharing{"mp", [](const device::Storage& s) { ShareStorage(s); },
                                      &AllocateBornShared};

}  // namespace

namespace internal {
void InstallStorageSharing() {
  static const bool installed = (device::InstallStorageSharing(&kSharing), true);
  (void)installed;
}
}  // namespace internal

std::vector<std::string> get_all_sharing_strategies() { return {"file_descriptor", "file_system"}; }

std::string get_sharing_strategy() {
  return g_strategy.load() == 0 ? "file_descriptor" : "file_system";
}

void set_sharing_strategy(const std::string& strategy) {
  if (strategy == "file_descriptor") {
    g_strategy = 0;
  } else if (strategy == "file_system") {
    g_strategy = 1;
  } else {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("unknown sharing strategy \"", strategy,
                             "\"; valid strategies are: file_descriptor, file_system"));
  }
}

void set_sharing_cache_enabled(bool enabled) { g_cache = enabled; }

device::Tensor& share_memory_(device::Tensor& tensor) {
  internal::InstallStorageSharing();
  if (tensor.device().is_cpu()) {
    ShareStorage(tensor.storage());
  } else {
    device::IpcBackend& ipc = DeviceIpc(tensor, "share_memory_");
    if (tensor.storage().nbytes() > 0) DeviceSharing(tensor.storage(), ipc);
  }
  return tensor;
}

device::Tensor SharedEmpty(const std::vector<int64_t>& shape, device::DType dtype) {
  internal::InstallStorageSharing();
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      throw Error(ErrorCode::kInvalidArgument, "SharedEmpty: shape extents must be >= 0");
    }
    n *= d;
  }
  const size_t bytes = static_cast<size_t>(n) * device::DTypeSize(dtype);
  return device::Tensor::FromStorage(NewSharedStorage(bytes), dtype, shape);
}

void set_tensors_born_shared(bool enabled) {
  internal::InstallStorageSharing();
  g_born_shared.store(enabled, std::memory_order_relaxed);
}

bool tensors_born_shared() {
  const int scope = t_born_scope;
  return scope >= 0 ? scope != 0 : g_born_shared.load(std::memory_order_relaxed);
}

BornSharedScope::BornSharedScope(bool enabled) : previous_(t_born_scope) {
  internal::InstallStorageSharing();
  t_born_scope = enabled ? 1 : 0;
}

BornSharedScope::~BornSharedScope() { t_born_scope = previous_; }

void set_sharing_large_cache_limit(size_t bytes) {
  internal::SharedArena::Get().SetLargeCacheLimit(bytes);
}

namespace internal {

TensorHandle ExportTensor(const device::Tensor& t) {
  InstallStorageSharing();
  if (!t.device().is_cpu()) {
    TensorHandle h;
    h.dtype = static_cast<uint8_t>(t.dtype());
    h.shape = t.shape();
    h.strides = t.strides();
    h.offset = t.storage_offset();
    ExportDeviceTensor(t, h);
    return h;
  }
  const std::shared_ptr<SharingContext> ctx = ShareStorage(t.storage());
  if (!ctx) {
    throw Error(ErrorCode::kInternal, "a shared storage lost its sharing context");
  }
  TensorHandle h;
  h.dtype = static_cast<uint8_t>(t.dtype());
  h.shape = t.shape();
  h.strides = t.strides();
  h.offset = t.storage_offset();
  h.block = ctx->block->Export();
  return h;
}

void CheckTensorHandle(const TensorHandle& h) {
  if (h.dtype > static_cast<uint8_t>(device::DType::kBFloat16)) {
    throw Error(ErrorCode::kInvalidArgument, "malformed tensor handle: unknown dtype");
  }
  CheckHandle(h.block);
  if (h.on_device) CheckDeviceWire(h.device);
}

device::Tensor ImportTensor(TensorHandle h) {
  InstallStorageSharing();
  CheckTensorHandle(h);
  auto block = SharedArena::Get().Import(std::move(h.block));
  device::Storage storage;
  if (h.on_device) {
    storage = ImportDeviceStorage(h, std::move(block));
  } else {
    Identity& ids = Ids();
    MutexLock lk(&ids.mu);
    auto it = ids.by_key.find(block->key());
    std::optional<device::Storage> known;
    if (it != ids.by_key.end()) known = it->second.Lock();
    // A storage known under this key views the same memory only if it is the same block: one
    // of another size is a block its creator freed and reused since (a forked child inherits
    // its parent's identities; the parent may reuse a block after the fork). Map it afresh.
    if (known.has_value() && (known->data() != block->data() || known->nbytes() != block->size())) {
      known.reset();
    }
    if (known.has_value()) {
      storage = *known;  // our adopted reference goes with `block` below
    } else {
      storage = device::Storage::FromExternal(device::kCPU, block->data(), block->size(),
                                              [keep = block](void*) mutable { keep.reset(); });
      storage.set_sharing_context(std::make_shared<SharingContext>(SharingContext{block}));
      storage.set_shared(true);
      ids.by_key[block->key()] = device::WeakStorage(storage);
    }
  }
  // FromStorage validates that the view fits inside the storage.
  return device::Tensor::FromStorage(storage, static_cast<device::DType>(h.dtype),
                                     std::move(h.shape), std::move(h.strides), h.offset);
}

// The codec's hooks for device::Tensor (declared in mp/codec.h).
void SaveTensor(cereal::BinaryOutputArchive& ar, const device::Tensor& t) { ar(ExportTensor(t)); }

void LoadTensor(BoundedInputArchive& ar, device::Tensor& t) {
  TensorHandle h;
  ar(h);
  t = ImportTensor(std::move(h));
}

}  // namespace internal
}  // namespace forksafe::mp
