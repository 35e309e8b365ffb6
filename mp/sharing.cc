#include "mp/sharing.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "device/storage.h"
#include "mp/process.h"
#include "runtime/error.h"

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;

namespace {

std::atomic<int> g_strategy{0};  // 0 file_descriptor, 1 file_system
std::atomic<bool> g_cache{true};

// What mp/ keeps in a shared Storage's sharing_context(): the block it lives in.
struct SharingContext {
  std::shared_ptr<internal::SharedBlock> block;
};

// Storages backed by shared blocks in this process, by block key, so that a block that arrives
// again (or comes back to its creator) becomes the same Storage.
struct Identity {
  std::mutex mu;
  std::unordered_map<std::string, device::internal::WeakStorage> by_key;
  size_t prune_at = 4096;  // prune dead entries when the map grows past this (amortized O(1))
};
Identity& Ids() {
  static auto* ids = new Identity();
  return *ids;
}

internal::SegmentKind Kind() {
  return g_strategy.load() == 0 ? internal::SegmentKind::kMemfd : internal::SegmentKind::kNamed;
}

void CheckCpu(const device::Tensor& t, const char* what) {
  if (!t.device().is_cpu()) {
    throw Error(ErrorCode::kUnavailable,
                absl::StrCat(what, ": tensors on ", t.device().ToString(),
                             " cannot be shared between processes yet (accelerator IPC is not "
                             "built); copy it to the CPU with To(device::kCPU) first"));
  }
}

void Remember(const std::shared_ptr<internal::SharedBlock>& block, const device::Storage& s) {
  Identity& ids = Ids();
  std::lock_guard<std::mutex> lk(ids.mu);
  if (ids.by_key.size() > ids.prune_at) {
    for (auto it = ids.by_key.begin(); it != ids.by_key.end();) {
      it = it->second.expired() ? ids.by_key.erase(it) : std::next(it);
    }
    ids.prune_at = std::max<size_t>(4096, 2 * ids.by_key.size());
  }
  ids.by_key[block->key()] = device::internal::WeakStorage(s);
}

void ShareStorage(const device::Storage& s) {
  static std::mutex mu;  // two threads sharing the same storage at once share it once
  std::lock_guard<std::mutex> lk(mu);
  if (s.is_shared()) return;
  auto block = internal::SharedArena::Get().Allocate(s.nbytes(), Kind(), g_cache.load());
  if (s.nbytes() > 0) std::memcpy(block->data(), s.data(), s.nbytes());
  device::internal::MoveStorageData(s, block->data(), [keep = block](void*) mutable { keep.reset(); });
  s.set_sharing_context(std::make_shared<SharingContext>(SharingContext{block}));
  s.set_shared(true);
  Remember(block, s);
}

// Lets Process share tensor arguments before a fork (mp/process.h).
const bool g_hook_installed = [] {
  internal::g_share_tensor_hook.store(+[](const device::Tensor& t) {
    if (t.device().is_cpu()) ShareStorage(t.storage());
  });
  return true;
}();

}  // namespace

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
  CheckCpu(tensor, "share_memory_");
  ShareStorage(tensor.storage());
  return tensor;
}

device::Tensor SharedEmpty(const std::vector<int64_t>& shape, device::DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      throw Error(ErrorCode::kInvalidArgument, "SharedEmpty: shape extents must be >= 0");
    }
    n *= d;
  }
  const size_t bytes = static_cast<size_t>(n) * device::DTypeSize(dtype);
  auto block = internal::SharedArena::Get().Allocate(bytes, Kind(), g_cache.load());
  device::Storage s = device::Storage::FromExternal(device::kCPU, block->data(), bytes,
                                                    [keep = block](void*) mutable { keep.reset(); });
  s.set_sharing_context(std::make_shared<SharingContext>(SharingContext{block}));
  s.set_shared(true);
  Remember(block, s);
  return device::Tensor::FromStorage(s, dtype, shape);
}

namespace internal {

TensorHandle ExportTensor(const device::Tensor& t) {
  CheckCpu(t, "sending a tensor");
  ShareStorage(t.storage());
  auto ctx = std::static_pointer_cast<SharingContext>(t.storage().sharing_context());
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
}

device::Tensor ImportTensor(TensorHandle h) {
  CheckTensorHandle(h);
  auto block = SharedArena::Get().Import(std::move(h.block));
  device::Storage storage;
  {
    Identity& ids = Ids();
    std::lock_guard<std::mutex> lk(ids.mu);
    auto it = ids.by_key.find(block->key());
    std::optional<device::Storage> known;
    if (it != ids.by_key.end()) known = it->second.Lock();
    if (known.has_value()) {
      storage = *known;  // our adopted reference goes with `block` below
    } else {
      storage = device::Storage::FromExternal(device::kCPU, block->data(), block->size(),
                                              [keep = block](void*) mutable { keep.reset(); });
      storage.set_sharing_context(std::make_shared<SharingContext>(SharingContext{block}));
      storage.set_shared(true);
      ids.by_key[block->key()] = device::internal::WeakStorage(storage);
    }
  }
  // FromStorage validates that the view fits inside the storage.
  return device::Tensor::FromStorage(storage, static_cast<device::DType>(h.dtype),
                                     std::move(h.shape), std::move(h.strides), h.offset);
}

}  // namespace internal
}  // namespace forksafe::mp
