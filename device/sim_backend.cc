#include "device/sim_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/error.h"

namespace forksafe::device {
namespace internal {

namespace {
constexpr uint64_t kTag = 0xF5ull << 56;          // non-canonical on x86-64 and arm64
constexpr uint64_t kTagMask = 0xFFull << 56;
constexpr int kIndexShift = 40;                    // 1 TiB of offset per device
constexpr uint64_t kOffsetMask = (1ull << kIndexShift) - 1;
constexpr size_t kAlign = 256;

int EnvInt(const char* name, int def, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < lo || n > hi) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         absl::StrCat("environment variable ", name, "=\"", v,
                                      "\" is not an integer in [", lo, ", ", hi,
                                      "]; fix or unset it"));
  }
  return static_cast<int>(n);
}
}  // namespace

int SimDeviceCount() { return EnvInt("FORKSAFE_SIM_DEVICES", 2, 0, 16); }
size_t SimMemoryBytes() {
  return static_cast<size_t>(EnvInt("FORKSAFE_SIM_MEMORY_MB", 64, 1, 65536)) << 20;
}

struct SimDeviceMemory {
  char* base = nullptr;
  size_t size = 0;
  std::map<size_t, size_t> free_blocks;  // offset -> length
  std::map<size_t, size_t> allocations;  // offset -> length
  size_t in_use = 0;
};

struct SimContext {
  pid_t owner = 0;
  std::vector<SimDeviceMemory> devices;  // guarded by mem_mu
  mutable std::mutex mem_mu;

  // The stream: one device thread running queued operations in order.
  std::mutex q_mu;
  std::condition_variable q_cv;
  std::condition_variable done_cv;
  std::deque<std::function<void()>> queue;
  uint64_t submitted = 0;
  uint64_t completed = 0;
  std::exception_ptr async_error;
  std::thread device_thread;

  void Run() {
    std::unique_lock<std::mutex> lk(q_mu);
    for (;;) {
      q_cv.wait(lk, [this] { return !queue.empty(); });
      std::function<void()> op = std::move(queue.front());
      queue.pop_front();
      lk.unlock();
      std::exception_ptr err;
      try {
        op();
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      if (err && !async_error) async_error = err;
      ++completed;
      done_cv.notify_all();
    }
  }

  uint64_t Enqueue(std::function<void()> op) {
    std::lock_guard<std::mutex> lk(q_mu);
    queue.push_back(std::move(op));
    q_cv.notify_one();
    return ++submitted;
  }

  void WaitFor(uint64_t ticket) {
    std::unique_lock<std::mutex> lk(q_mu);
    done_cv.wait(lk, [&] { return completed >= ticket; });
  }

  void WaitAll() {
    std::unique_lock<std::mutex> lk(q_mu);
    const uint64_t target = submitted;
    done_cv.wait(lk, [&] { return completed >= target; });
  }

  void Drain() {
    std::unique_lock<std::mutex> lk(q_mu);
    const uint64_t target = submitted;
    done_cv.wait(lk, [&] { return completed >= target; });
    if (async_error) std::rethrow_exception(std::exchange(async_error, nullptr));
  }

  // Translates a tagged device pointer into a host view of `bytes` bytes, checking that the
  // range lies inside one live allocation.
  char* Translate(int index, const void* dev_ptr, size_t bytes, const char* what) const {
    const uint64_t v = reinterpret_cast<uint64_t>(dev_ptr);
    if ((v & kTagMask) != kTag || static_cast<int>((v & ~kTagMask) >> kIndexShift) != index) {
      throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                           absl::StrCat(what, ": pointer ", absl::Hex(v),
                                        " is not memory of device sim:", index,
                                        "; pass a pointer returned by Allocate on that device"));
    }
    const size_t off = v & kOffsetMask;
    std::lock_guard<std::mutex> lk(mem_mu);
    const SimDeviceMemory& dev = devices[index];
    auto it = dev.allocations.upper_bound(off);
    if (it == dev.allocations.begin() ||
        (--it, off + bytes > it->first + it->second || off < it->first)) {
      throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                           absl::StrCat(what, ": range of ", bytes, " bytes at sim:", index,
                                        " offset ", off,
                                        " is not inside a live allocation (freed memory, or an "
                                        "access past the end)"));
    }
    return dev.base + off;
  }
};

}  // namespace internal

using internal::SimContext;

SimBackend::SimBackend() = default;

SimBackend::~SimBackend() {
  // Backends live for the whole process; the context (and its device thread) is never torn down.
}

int SimBackend::DeviceCount() const {
  // Once the context exists its device list is fixed, whatever the environment says later.
  if (state() == BackendState::kReady || state() == BackendState::kPoisoned) {
    return ctx_ != nullptr ? static_cast<int>(ctx_->devices.size()) : 0;
  }
  return internal::SimDeviceCount();
}

DeviceProperties SimBackend::Properties(int index) const {
  CheckIndex(index, "Properties");
  DeviceProperties p;
  p.name = absl::StrCat("forksafe simulated accelerator ", index);
  p.total_memory = (ctx_ != nullptr && state() != BackendState::kUninitialized)
                       ? ctx_->devices[index].size
                       : internal::SimMemoryBytes();
  p.host_accessible = false;
  p.supports_ipc = false;
  return p;
}

void SimBackend::DoInitialize() {
  auto ctx = std::make_unique<SimContext>();
  ctx->owner = getpid();
  const int n = DeviceCount();
  const size_t size = internal::SimMemoryBytes();
  ctx->devices.resize(n);
  for (int i = 0; i < n; ++i) {
    void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      for (int j = 0; j < i; ++j) munmap(ctx->devices[j].base, size);
      runtime::ThrowSystemError(absl::StrCat("sim: mapping ", size, " bytes of device memory"),
                                err);
    }
    ctx->devices[i].base = static_cast<char*>(base);
    ctx->devices[i].size = size;
    ctx->devices[i].free_blocks[0] = size;
  }
  SimContext* raw = ctx.get();
  ctx->device_thread = std::thread([raw] { raw->Run(); });
  ctx_ = ctx.release();
}

void* SimBackend::DoAllocate(int index, size_t bytes) {
  const size_t need = (bytes + internal::kAlign - 1) / internal::kAlign * internal::kAlign;
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  internal::SimDeviceMemory& dev = ctx_->devices[index];
  for (auto it = dev.free_blocks.begin(); it != dev.free_blocks.end(); ++it) {
    if (it->second < need) continue;
    const size_t off = it->first;
    const size_t rest = it->second - need;
    dev.free_blocks.erase(it);
    if (rest > 0) dev.free_blocks[off + need] = rest;
    dev.allocations[off] = need;
    dev.in_use += need;
    return reinterpret_cast<void*>(internal::kTag |
                                   (static_cast<uint64_t>(index) << internal::kIndexShift) | off);
  }
  throw runtime::Error(runtime::ErrorCode::kResourceExhausted,
                       absl::StrCat("sim:", index, " is out of memory: ", bytes,
                                    " bytes requested, ", dev.size - dev.in_use, " of ", dev.size,
                                    " free (fragmented or full); free tensors, or raise "
                                    "FORKSAFE_SIM_MEMORY_MB"));
}

void SimBackend::DoFree(int index, void* ptr) {
  const uint64_t v = reinterpret_cast<uint64_t>(ptr);
  const size_t off = v & internal::kOffsetMask;
  if ((v & internal::kTagMask) != internal::kTag ||
      static_cast<int>((v & ~internal::kTagMask) >> internal::kIndexShift) != index) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         absl::StrCat("Free: pointer ", absl::Hex(v), " was not allocated on sim:",
                                      index));
  }
  ctx_->WaitAll();  // like cudaFree: pending work completes first (its errors stay for Synchronize)
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  internal::SimDeviceMemory& dev = ctx_->devices[index];
  auto it = dev.allocations.find(off);
  if (it == dev.allocations.end()) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         absl::StrCat("Free: sim:", index, " offset ", off,
                                      " is not the start of a live allocation (double free?)"));
  }
  size_t start = off;
  size_t len = it->second;
  dev.in_use -= len;
  dev.allocations.erase(it);
  // Coalesce with neighbours.
  auto next = dev.free_blocks.lower_bound(start);
  if (next != dev.free_blocks.end() && next->first == start + len) {
    len += next->second;
    next = dev.free_blocks.erase(next);
  }
  if (next != dev.free_blocks.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      dev.free_blocks.erase(prev);
    }
  }
  dev.free_blocks[start] = len;
}

void SimBackend::DoCopy(void* dst, Device dst_device, const void* src, Device src_device,
                        size_t bytes) {
  char* d = dst_device.type == DeviceType::kSimAccel
                ? ctx_->Translate(dst_device.index, dst, bytes, "Copy (destination)")
                : static_cast<char*>(dst);
  const char* s = src_device.type == DeviceType::kSimAccel
                      ? ctx_->Translate(src_device.index, src, bytes, "Copy (source)")
                      : static_cast<const char*>(src);
  // Synchronous, like cudaMemcpy: ordered after earlier work, returns when done.
  const uint64_t ticket = ctx_->Enqueue([d, s, bytes] { std::memmove(d, s, bytes); });
  ctx_->WaitFor(ticket);
}

void SimBackend::DoMemset(int index, void* ptr, int value, size_t bytes) {
  char* d = ctx_->Translate(index, ptr, bytes, "Memset");
  ctx_->Enqueue([d, value, bytes] { std::memset(d, value, bytes); });
}

void SimBackend::LaunchKernel(int index, void* ptr, size_t bytes,
                              std::function<void(void*, size_t)> kernel) {
  if (!kernel) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument, "LaunchKernel: empty kernel");
  }
  CheckIndex(index, "LaunchKernel");
  Initialize();  // lazy init and the fork-poison check, like every operation
  char* view = ctx_->Translate(index, ptr, bytes, "LaunchKernel");
  ctx_->Enqueue([view, bytes, k = std::move(kernel)] { k(view, bytes); });
}

void SimBackend::DoSynchronize(int index) { ctx_->Drain(); }

size_t SimBackend::BytesInUse(int index) const {
  CheckIndex(index, "BytesInUse");
  if (state() != BackendState::kReady) return 0;
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  return ctx_->devices[index].in_use;
}

pid_t SimBackend::context_owner() const { return ctx_ != nullptr ? ctx_->owner : 0; }

void SimBackend::DoForkChild() {
  // The device thread does not exist here and the context's mutexes may be held by threads that
  // do not exist either: the context is abandoned untouched (its memory stays mapped, copy-on-
  // write, and is never used again).
}

}  // namespace forksafe::device
