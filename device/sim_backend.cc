#include "forksafe/device/sim_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/internal/memory_bounds.h"

namespace forksafe::device {
namespace internal {

namespace {
using runtime::Error;
using runtime::ErrorCode;

constexpr uint64_t kTag = 0xF5ull << 56;          // non-canonical on x86-64 and arm64
constexpr uint64_t kTagMask = 0xFFull << 56;
constexpr int kIndexShift = 40;                    // 1 TiB of address space per device
constexpr uint64_t kOffsetMask = (1ull << kIndexShift) - 1;
constexpr size_t kAlign = 256;
constexpr size_t kGranularity = size_t{2} << 20;   // segment sizes are multiples of this
constexpr size_t kSmallMax = size_t{1} << 20;      // up to this, blocks share 2 MiB segments
constexpr size_t kEventPageBytes = 4096;
constexpr int kMaxEvents = static_cast<int>(kEventPageBytes / sizeof(uint32_t));
constexpr auto kEventWaitLimit = std::chrono::seconds(120);

constexpr char kSegmentName[] = "forksafe_simseg_";      // + <device>_<bytes>
constexpr char kForeignName[] = "forksafe_simforeign_";  // + <device>_<bytes>
constexpr char kEventName[] = "forksafe_simevt";

int EnvInt(const char* name, int def, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < lo || n > hi) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("environment variable ", name, "=\"", v,
                             "\" is not an integer in [", lo, ", ", hi, "]; fix or unset it"));
  }
  return static_cast<int>(n);
}

// Checked: a size near SIZE_MAX is kResourceExhausted, never a wrap to a tiny block.
size_t RoundUp(size_t n, size_t to) { return runtime::internal::RoundUpOrThrow(n, to, "sim"); }

uint64_t RandomId() {
  uint64_t id = 0;
  while (id == 0) {
    if (getentropy(&id, sizeof id) != 0) runtime::ThrowSystemError("sim: getentropy", errno);
  }
  return id;
}

// What /proc/self/fd/<fd> points at ("/memfd:NAME (deleted)"), or "".
std::string FdTarget(const std::string& proc_path) {
  char buf[256];
  const ssize_t n = readlink(proc_path.c_str(), buf, sizeof buf - 1);
  if (n <= 0) return "";
  return std::string(buf, static_cast<size_t>(n));
}

// Parses "/memfd:<prefix><device>_<bytes>..." into bytes when the device matches.
bool ParseSimMemfd(const std::string& target, const char* prefix, int device, size_t* bytes) {
  const std::string head = absl::StrCat("/memfd:", prefix, device, "_");
  if (target.compare(0, head.size(), head) != 0) return false;
  size_t end = head.size();
  while (end < target.size() && target[end] >= '0' && target[end] <= '9') ++end;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(target.substr(head.size(), end - head.size()), &v)) return false;
  *bytes = v;
  return true;
}

long Futex(uint32_t* addr, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, addr, op, val, timeout, nullptr, 0);
}

// True when `pid` has exited (gone, or a zombie not yet reaped by its parent).
bool ProcessGone(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() &&
         (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}
}  // namespace

int SimDeviceCount() { return EnvInt("FORKSAFE_SIM_DEVICES", 2, 0, 16); }
size_t SimMemoryBytes() {
  return static_cast<size_t>(EnvInt("FORKSAFE_SIM_MEMORY_MB", 64, 1, 65536)) << 20;
}
int SimIpcEvents() { return EnvInt("FORKSAFE_SIM_IPC_EVENTS", 64, 0, kMaxEvents); }

// One memfd mapped into this process, at a range of the device's address space.
struct SimSegment {
  enum Kind { kOwn, kForeign, kImported };
  Kind kind = kOwn;
  int fd = -1;
  char* host = nullptr;
  size_t size = 0;
  uint64_t va = 0;  // device offset of its first byte
  uint64_t id = 0;  // identity across processes
  std::map<size_t, size_t> free_blocks;  // kOwn: offset in segment -> length
  size_t live = 0;                       // kOwn: blocks allocated or held
  int imports = 0;                       // ImportMemory calls that returned memory of it

  ~SimSegment() {
    if (host != nullptr) munmap(host, size);
    if (fd >= 0) close(fd);
  }
};

struct SimBlock {
  size_t len = 0;
  SimSegment* seg = nullptr;
  bool parked = false;              // freed by the user, held for other processes
  std::function<bool()> released;  // set by HoldAfterFree
};

struct SimDeviceMemory {
  size_t capacity = 0;
  size_t reserved = 0;  // bytes of kOwn + kForeign segments
  size_t in_use = 0;    // bytes of live (not parked) blocks
  uint64_t next_va = kGranularity;
  std::map<uint64_t, std::unique_ptr<SimSegment>> segments;  // by va
  std::map<uint64_t, SimSegment*> by_id;
  std::map<uint64_t, SimBlock> blocks;  // kOwn and kForeign blocks, by va
};

// A page of event words, shared with other processes.
struct SimEventPage {
  int fd = -1;
  uint32_t* words = nullptr;
  uint64_t id = 0;
  ~SimEventPage() {
    if (words != nullptr) munmap(words, kEventPageBytes);
    if (fd >= 0) close(fd);
  }
};

struct SimEventPool {
  std::shared_ptr<SimEventPage> page;
  int capacity = 0;
  uint32_t next = 0;
  std::vector<uint32_t> sequence;  // last recording per slot
};

struct SimContext {
  pid_t owner = 0;
  std::vector<SimDeviceMemory> devices;  // guarded by mem_mu
  mutable std::mutex mem_mu;
  std::vector<SimEventPool> event_pools;                         // per device; guarded by mem_mu
  std::map<uint64_t, std::shared_ptr<SimEventPage>> peer_pages;  // by id; guarded by mem_mu

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

  // Rethrows (once) an error of earlier stream work, like a sticky CUDA error at the next
  // synchronous call.
  void RaiseAsyncError() {
    std::unique_lock<std::mutex> lk(q_mu);
    if (async_error) std::rethrow_exception(std::exchange(async_error, nullptr));
  }

  static uint64_t Encode(int index, uint64_t va) {
    return kTag | (static_cast<uint64_t>(index) << kIndexShift) | va;
  }
  static void* Pointer(int index, uint64_t va) {
    return reinterpret_cast<void*>(Encode(index, va));
  }

  // The device offset of a tagged pointer of device `index`; throws for anything else.
  static uint64_t Offset(int index, const void* dev_ptr, const char* what) {
    const uint64_t v = reinterpret_cast<uint64_t>(dev_ptr);
    if ((v & kTagMask) != kTag || static_cast<int>((v & ~kTagMask) >> kIndexShift) != index) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat(what, ": pointer ", absl::Hex(v), " is not memory of device sim:",
                               index, "; pass a pointer returned by Allocate on that device"));
    }
    return v & kOffsetMask;
  }

  // The segment holding device offset `off`, or null. Caller holds mem_mu.
  SimSegment* SegmentAt(SimDeviceMemory& dev, uint64_t off) {
    auto it = dev.segments.upper_bound(off);
    if (it == dev.segments.begin()) return nullptr;
    --it;
    SimSegment* seg = it->second.get();
    return off < seg->va + seg->size ? seg : nullptr;
  }

  // Translates a tagged device pointer into a host view of `bytes` bytes, checking that the
  // range lies inside one live (or held) block, or inside an imported segment.
  char* Translate(int index, const void* dev_ptr, size_t bytes, const char* what) {
    const uint64_t off = Offset(index, dev_ptr, what);
    std::lock_guard<std::mutex> lk(mem_mu);
    SimDeviceMemory& dev = devices[index];
    SimSegment* seg = SegmentAt(dev, off);
    bool ok = false;
    if (seg != nullptr && seg->kind == SimSegment::kImported) {
      ok = bytes <= seg->va + seg->size - off;
    } else if (seg != nullptr) {
      auto it = dev.blocks.upper_bound(off);
      if (it != dev.blocks.begin()) {
        --it;
        ok = off >= it->first && bytes <= it->first + it->second.len - off;
      }
    }
    if (!ok) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat(what, ": range of ", bytes, " bytes at sim:", index, " offset ",
                               off,
                               " is not inside a live allocation (freed memory, or an access "
                               "past the end)"));
    }
    return seg->host + (off - seg->va);
  }

  // Maps `fd` (owned from now on) as a segment of `dev`. Caller holds mem_mu.
  SimSegment* AddSegment(int index, SimDeviceMemory& dev, SimSegment::Kind kind, int fd,
                         size_t size, uint64_t id) {
    auto seg = std::make_unique<SimSegment>();
    seg->kind = kind;
    seg->fd = fd;
    seg->size = size;
    seg->id = id;
    void* host = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (host == MAP_FAILED) {
      const int err = errno;
      runtime::ThrowSystemError(absl::StrCat("sim:", index, ": mapping a segment of ", size,
                                             " bytes"),
                                err);  // ~SimSegment closes fd
    }
    seg->host = static_cast<char*>(host);
    if (size > kOffsetMask - dev.next_va) {
      throw Error(ErrorCode::kResourceExhausted,
                  absl::StrCat("sim:", index, " ran out of device address space"));
    }
    seg->va = dev.next_va;
    dev.next_va += RoundUp(size, kGranularity);
    SimSegment* raw = seg.get();
    dev.by_id[id] = raw;
    dev.segments[raw->va] = std::move(seg);
    return raw;
  }

  void DropSegment(SimDeviceMemory& dev, SimSegment* seg) {
    if (seg->kind != SimSegment::kImported) dev.reserved -= seg->size;
    dev.by_id.erase(seg->id);
    dev.segments.erase(seg->va);  // unmaps and closes
  }

  // A new memfd of `size` bytes, reserved so that running out is an error here, not a SIGBUS.
  static int CreateMemfd(int index, const char* prefix, size_t size) {
    const std::string name = absl::StrCat(prefix, index, "_", size);
    int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
    if (fd < 0) runtime::ThrowSystemError("sim: memfd_create", errno);
    int err = 0;
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) err = errno;
    if (err == 0) err = posix_fallocate(fd, 0, static_cast<off_t>(size));
    if (err != 0) {
      close(fd);
      if (err == ENOSPC || err == ENOMEM || err == EMFILE || err == ENFILE) {
        throw Error(ErrorCode::kResourceExhausted,
                    absl::StrCat("sim:", index, ": reserving a segment of ", size,
                                 " bytes failed: ", std::strerror(err),
                                 " (host memory or descriptors ran out)"));
      }
      runtime::ThrowSystemError(
          absl::StrCat("sim:", index, ": sizing a segment of ", size, " bytes"), err);
    }
    return fd;
  }

  // Returns held blocks whose holders all let go to their segments. Caller holds mem_mu.
  void ReclaimParked(SimDeviceMemory& dev) {
    for (auto it = dev.blocks.begin(); it != dev.blocks.end();) {
      SimBlock& b = it->second;
      if (b.parked && (!b.released || b.released())) {
        const uint64_t va = it->first;
        ++it;
        ReturnBlock(dev, va);
      } else {
        ++it;
      }
    }
  }

  // Puts the kOwn block at `va` back on its segment's free list, coalescing. Caller holds mem_mu.
  void ReturnBlock(SimDeviceMemory& dev, uint64_t va) {
    auto it = dev.blocks.find(va);
    SimSegment* seg = it->second.seg;
    size_t start = va - seg->va;
    size_t len = it->second.len;
    dev.blocks.erase(it);
    --seg->live;
    auto& fb = seg->free_blocks;
    auto next = fb.lower_bound(start);
    if (next != fb.end() && next->first == start + len) {
      len += next->second;
      next = fb.erase(next);
    }
    if (next != fb.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        len += prev->second;
        fb.erase(prev);
      }
    }
    fb[start] = len;
  }

  // Unmaps own segments with no live or held block. Caller holds mem_mu.
  void ReleaseFreeSegments(SimDeviceMemory& dev) {
    std::vector<SimSegment*> drop;
    for (auto& [va, seg] : dev.segments) {
      if (seg->kind == SimSegment::kOwn && seg->live == 0 && seg->imports == 0) {
        drop.push_back(seg.get());
      }
    }
    for (SimSegment* s : drop) DropSegment(dev, s);
  }

  // First fit over the cached free blocks. Caller holds mem_mu.
  void* Carve(int index, SimDeviceMemory& dev, size_t need) {
    for (auto& [va, seg] : dev.segments) {
      if (seg->kind != SimSegment::kOwn) continue;
      for (auto it = seg->free_blocks.begin(); it != seg->free_blocks.end(); ++it) {
        if (it->second < need) continue;
        const size_t off = it->first;
        const size_t rest = it->second - need;
        seg->free_blocks.erase(it);
        if (rest > 0) seg->free_blocks[off + need] = rest;
        ++seg->live;
        dev.blocks[seg->va + off] = SimBlock{need, seg.get(), false, nullptr};
        dev.in_use += need;
        return Pointer(index, seg->va + off);
      }
    }
    return nullptr;
  }

  // Makes room for `size` more reserved bytes, or throws. Caller holds mem_mu.
  void Reserve(int index, SimDeviceMemory& dev, size_t size, size_t requested) {
    if (size <= dev.capacity && dev.reserved <= dev.capacity - size) return;
    ReclaimParked(dev);
    ReleaseFreeSegments(dev);
    if (size <= dev.capacity && dev.reserved <= dev.capacity - size) return;
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat("sim:", index, " is out of memory: ", requested,
                             " bytes requested, ", dev.capacity - dev.in_use, " of ",
                             dev.capacity,
                             " free (fragmented, held for other processes, or full); free "
                             "tensors, or raise FORKSAFE_SIM_MEMORY_MB"));
  }

  SimEventPool& EventPool(int index) {
    SimEventPool& pool = event_pools[index];
    if (pool.page == nullptr) {
      auto page = std::make_shared<SimEventPage>();
      page->fd = CreateMemfd(index, kEventName, kEventPageBytes);
      void* p = mmap(nullptr, kEventPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, page->fd, 0);
      if (p == MAP_FAILED) runtime::ThrowSystemError("sim: mapping the event page", errno);
      page->words = static_cast<uint32_t*>(p);
      page->id = RandomId();
      pool.capacity = SimIpcEvents();
      pool.sequence.assign(static_cast<size_t>(kMaxEvents), 0);
      pool.page = std::move(page);
    }
    return pool;
  }
};

// Sums the sizes of the sim segments of `index` that any visible process maps or holds a
// descriptor of, each counted once.
size_t MachineWideBytes(int index) {
  std::set<uint64_t> seen;  // inodes (memfds all live on the kernel's one internal shmem mount)
  size_t total = 0;
  auto count = [&](const std::string& target, uint64_t ino) {
    size_t bytes = 0;
    if (!ParseSimMemfd(target, kSegmentName, index, &bytes) &&
        !ParseSimMemfd(target, kForeignName, index, &bytes)) {
      return;
    }
    if (seen.insert(ino).second) total += bytes;
  };
  // Only processes of this pid namespace: a device is a machine-wide thing, but test sandboxes
  // (one pid namespace each) that run at the same time must not see each other's memory.
  const std::string my_ns = FdTarget("/proc/self/ns/pid");
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return 0;
  while (dirent* e = readdir(proc)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    const std::string base = absl::StrCat("/proc/", e->d_name);
    if (!my_ns.empty() && FdTarget(base + "/ns/pid") != my_ns) continue;
    if (DIR* fds = opendir((base + "/fd").c_str())) {
      while (dirent* f = readdir(fds)) {
        if (f->d_name[0] == '.') continue;
        const std::string path = absl::StrCat(base, "/fd/", f->d_name);
        const std::string target = FdTarget(path);
        if (target.rfind("/memfd:forksafe_sim", 0) != 0) continue;
        struct stat st;
        if (stat(path.c_str(), &st) == 0) count(target, st.st_ino);
      }
      closedir(fds);
    }
    std::ifstream maps(base + "/maps");
    std::string line;
    while (std::getline(maps, line)) {
      const size_t at = line.find("/memfd:forksafe_sim");
      if (at == std::string::npos) continue;
      std::istringstream fields(line.substr(0, at));
      std::string range, perms, offset, devfield;
      uint64_t ino = 0;
      fields >> range >> perms >> offset >> devfield >> ino;
      count(line.substr(at), ino);
    }
  }
  closedir(proc);
  return total;
}

}  // namespace internal

using internal::SimBlock;
using internal::SimContext;
using internal::SimDeviceMemory;
using internal::SimSegment;
using runtime::Error;
using runtime::ErrorCode;

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
                       ? ctx_->devices[index].capacity
                       : internal::SimMemoryBytes();
  p.host_accessible = false;
  p.supports_ipc = true;
  return p;
}

void SimBackend::DoInitialize() {
  auto ctx = std::make_unique<SimContext>();
  ctx->owner = getpid();
  const int n = DeviceCount();
  const size_t size = internal::SimMemoryBytes();
  internal::SimIpcEvents();  // a bad setting is an error now, not at the first event
  ctx->devices.resize(n);
  ctx->event_pools.resize(n);
  for (int i = 0; i < n; ++i) ctx->devices[i].capacity = size;
  SimContext* raw = ctx.get();
  ctx->device_thread = std::thread([raw] { raw->Run(); });
  ctx_ = ctx.release();
  // Like a GPU context torn down at exit, queued work finishes when the process exits normally,
  // so memory exported just before exit() holds what was written to it. (_exit and signals skip
  // this; importers waiting on its events then get kProcessFailed.)
  static SimContext* at_exit_ctx = nullptr;
  at_exit_ctx = raw;
  static const bool registered = [] {
    std::atexit([] {
      SimContext* c = at_exit_ctx;
      if (c != nullptr && c->owner == getpid()) c->WaitAll();
    });
    return true;
  }();
  (void)registered;
  // What the context keeps for the life of the process (its event pages and the mappings of
  // segments still in use or cached), and its caches for runtime::ReleaseCachedResources().
  // Nothing in a forked child: the inherited context's locks may be held by threads that are gone.
  runtime::internal::RegisterKeptResources(
      "sim_backend",
      [raw](runtime::internal::KeptResources& k) {
        if (raw->owner != getpid()) return;
        std::lock_guard<std::mutex> lk(raw->mem_mu);
        auto page = [&k](const internal::SimEventPage& p) {
          k.AddFd(p.fd, "simulated accelerator's event page");
          const auto start = reinterpret_cast<uintptr_t>(p.words);
          k.mappings.push_back({{start, start + internal::kEventPageBytes},
                                "simulated accelerator's event page"});
        };
        for (const auto& pool : raw->event_pools) {
          if (pool.page != nullptr) page(*pool.page);
        }
        for (const auto& [id, p] : raw->peer_pages) page(*p);
        for (const auto& dev : raw->devices) {
          for (const auto& [va, seg] : dev.segments) {
            k.AddFd(seg->fd, "simulated accelerator's segment in use");
            const auto start = reinterpret_cast<uintptr_t>(seg->host);
            k.mappings.push_back(
                {{start, start + seg->size}, "simulated accelerator's segment in use"});
          }
        }
      },
      [raw] {
        if (raw->owner != getpid()) return;
        raw->WaitAll();
        std::lock_guard<std::mutex> lk(raw->mem_mu);
        for (auto& dev : raw->devices) {
          raw->ReclaimParked(dev);
          raw->ReleaseFreeSegments(dev);
        }
      });
}

void* SimBackend::DoAllocate(int index, size_t bytes) {
  const size_t need = internal::RoundUp(bytes, internal::kAlign);
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  if (need <= dev.capacity) {
    if (void* p = ctx_->Carve(index, dev, need)) return p;
    ctx_->ReclaimParked(dev);
    if (void* p = ctx_->Carve(index, dev, need)) return p;
  }
  const size_t seg_size = need <= internal::kSmallMax
                              ? internal::kGranularity
                              : internal::RoundUp(need, internal::kGranularity);
  ctx_->Reserve(index, dev, seg_size, bytes);
  // The segment is reserved with fallocate: check what the host can give first.
  runtime::internal::CheckMemoryAvailable(seg_size, runtime::internal::MemoryUse::kShared,
                                          absl::StrCat("sim:", index, ": Allocate"));
  const int fd = SimContext::CreateMemfd(index, internal::kSegmentName, seg_size);
  SimSegment* seg =
      ctx_->AddSegment(index, dev, SimSegment::kOwn, fd, seg_size, internal::RandomId());
  dev.reserved += seg_size;
  seg->free_blocks[0] = seg_size;
  return ctx_->Carve(index, dev, need);
}

void SimBackend::DoFree(int index, void* ptr) {
  const uint64_t off = SimContext::Offset(index, ptr, "Free");
  ctx_->WaitAll();  // like cudaFree: pending work completes first (its errors stay for Synchronize)
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  auto it = dev.blocks.find(off);
  if (it == dev.blocks.end() || it->second.parked) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Free: sim:", index, " offset ", off,
                             " is not the start of a live allocation (double free?)"));
  }
  if (it->second.seg->kind == SimSegment::kForeign) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Free: sim:", index, " offset ", off,
                             " was allocated with AllocateForeign; free it with FreeForeign"));
  }
  dev.in_use -= it->second.len;
  if (it->second.released) {
    it->second.parked = true;  // other processes may still read it: out of reuse until released
    return;
  }
  ctx_->ReturnBlock(dev, off);
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
  // An earlier failure (an interprocess wait whose producer died, a faulting kernel) means this
  // copy may have seen data the stream never finished writing: say so here, like a sticky error.
  ctx_->RaiseAsyncError();
}

void SimBackend::DoMemset(int index, void* ptr, int value, size_t bytes) {
  char* d = ctx_->Translate(index, ptr, bytes, "Memset");
  ctx_->Enqueue([d, value, bytes] { std::memset(d, value, bytes); });
}

void SimBackend::LaunchKernel(int index, void* ptr, size_t bytes,
                              std::function<void(void*, size_t)> kernel) {
  if (!kernel) {
    throw Error(ErrorCode::kInvalidArgument, "LaunchKernel: empty kernel");
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

size_t SimBackend::BytesReserved(int index) const {
  CheckIndex(index, "BytesReserved");
  if (state() != BackendState::kReady) return 0;
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  return ctx_->devices[index].reserved;
}

void SimBackend::FinishQueuedWork() {
  if (state() == BackendState::kReady && ctx_ != nullptr && ctx_->owner == getpid()) {
    ctx_->WaitAll();
  }
}

pid_t SimBackend::context_owner() const { return ctx_ != nullptr ? ctx_->owner : 0; }

void SimBackend::DoForkChild() {
  // The device thread does not exist here and the context's mutexes may be held by threads that
  // do not exist either: the context is abandoned untouched (its mappings stay, and are never
  // used again; the descriptors are close-on-exec and die with the child).
}

void* SimBackend::AllocateForeign(int index, size_t bytes) {
  CheckIndex(index, "AllocateForeign");
  Initialize();
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "AllocateForeign: size must be > 0");
  }
  const size_t size = internal::RoundUp(bytes, internal::kAlign);
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  ctx_->Reserve(index, dev, size, bytes);
  runtime::internal::CheckMemoryAvailable(size, runtime::internal::MemoryUse::kShared,
                                          absl::StrCat("sim:", index, ": AllocateForeign"));
  const int fd = SimContext::CreateMemfd(index, internal::kForeignName, size);
  SimSegment* seg =
      ctx_->AddSegment(index, dev, SimSegment::kForeign, fd, size, internal::RandomId());
  dev.reserved += size;
  seg->live = 1;
  dev.blocks[seg->va] = SimBlock{size, seg, false, nullptr};
  dev.in_use += size;
  return SimContext::Pointer(index, seg->va);
}

void SimBackend::FreeForeign(int index, void* ptr) {
  CheckIndex(index, "FreeForeign");
  Initialize();
  const uint64_t off = SimContext::Offset(index, ptr, "FreeForeign");
  ctx_->WaitAll();
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  auto it = dev.blocks.find(off);
  if (it == dev.blocks.end() || it->second.seg->kind != SimSegment::kForeign) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("FreeForeign: sim:", index, " offset ", off,
                             " is not memory from AllocateForeign (or was freed already)"));
  }
  SimSegment* seg = it->second.seg;
  dev.in_use -= it->second.len;
  dev.blocks.erase(it);
  ctx_->DropSegment(dev, seg);  // importers keep their own mappings; new imports fail
}

IpcMemoryHandle SimBackend::ExportMemory(int index, const void* ptr, size_t bytes) {
  CheckIndex(index, "ExportMemory");
  Initialize();
  ctx_->Translate(index, ptr, bytes, "ExportMemory");  // inside a live block or an import
  const uint64_t off = SimContext::Offset(index, ptr, "ExportMemory");
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  SimSegment* seg = ctx_->SegmentAt(dev, off);
  if (seg->kind == SimSegment::kForeign) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ExportMemory: sim:", index, " offset ", off,
                             " is not from forksafe's allocator (AllocateForeign: a framework's "
                             "own memory); share it with ExportLegacyMemory, whose exporter must "
                             "keep it alive"));
  }
  IpcMemoryHandle h;
  h.device = Device(DeviceType::kSimAccel, index);
  h.kind = IpcKind::kSegment;
  h.fd = fcntl(seg->fd, F_DUPFD_CLOEXEC, 0);
  if (h.fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      throw Error(ErrorCode::kResourceExhausted, "ExportMemory: out of file descriptors");
    }
    runtime::ThrowSystemError("ExportMemory: dup", err);
  }
  h.segment_id = seg->id;
  h.segment_size = seg->size;
  h.offset = off - seg->va;
  h.size = bytes;
  h.exporter = getpid();
  return h;
}

IpcMemoryHandle SimBackend::ExportLegacyMemory(int index, const void* ptr, size_t bytes) {
  CheckIndex(index, "ExportLegacyMemory");
  Initialize();
  ctx_->Translate(index, ptr, bytes, "ExportLegacyMemory");
  const uint64_t off = SimContext::Offset(index, ptr, "ExportLegacyMemory");
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimSegment* seg = ctx_->SegmentAt(ctx_->devices[index], off);
  if (seg->kind != SimSegment::kForeign) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ExportLegacyMemory: sim:", index, " offset ", off,
                             " is memory of forksafe's allocator (or an import); share it with "
                             "ExportMemory, which needs no keep-alive rule"));
  }
  IpcMemoryHandle h;
  h.device = Device(DeviceType::kSimAccel, index);
  h.kind = IpcKind::kLegacy;
  h.segment_id = seg->id;
  h.segment_size = seg->size;
  h.offset = off - seg->va;
  h.size = bytes;
  h.exporter = getpid();
  const int32_t fdnum = seg->fd;  // the legacy handle: where the exporter holds the memory
  std::memcpy(h.opaque.data(), &fdnum, sizeof fdnum);
  return h;
}

void* SimBackend::ImportMemory(const IpcMemoryHandle& h) {
  if (h.device.type != DeviceType::kSimAccel) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ImportMemory: the handle describes ", h.device.ToString(),
                             " memory, not sim memory"));
  }
  const int index = h.device.index;
  CheckIndex(index, "ImportMemory");
  Initialize();
  if (h.size == 0 || h.segment_size == 0 || h.offset > h.segment_size ||
      h.size > h.segment_size - h.offset) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ImportMemory: malformed handle: a range of ", h.size,
                             " bytes at offset ", h.offset, " of a segment of ", h.segment_size,
                             " bytes"));
  }
  {
    std::lock_guard<std::mutex> lk(ctx_->mem_mu);
    SimDeviceMemory& dev = ctx_->devices[index];
    auto known = dev.by_id.find(h.segment_id);
    if (known != dev.by_id.end()) {  // mapped here already (ours, or imported before)
      SimSegment* seg = known->second;
      if (seg->size != h.segment_size) {
        throw Error(ErrorCode::kInvalidArgument,
                    "ImportMemory: malformed handle: segment size does not match the segment");
      }
      ++seg->imports;
      return SimContext::Pointer(index, seg->va + h.offset);
    }
  }
  // A segment new to this process: open and check it before mapping anything.
  int fd = -1;
  const char* prefix = nullptr;
  if (h.kind == IpcKind::kSegment) {
    if (h.fd < 0) {
      throw Error(ErrorCode::kInvalidArgument, "ImportMemory: malformed handle: no descriptor");
    }
    prefix = internal::kSegmentName;
    fd = fcntl(h.fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        throw Error(ErrorCode::kResourceExhausted, "ImportMemory: out of file descriptors");
      }
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ImportMemory: malformed handle: bad descriptor ", h.fd));
    }
  } else if (h.kind == IpcKind::kLegacy) {
    prefix = internal::kForeignName;
    int32_t fdnum = -1;
    std::memcpy(&fdnum, h.opaque.data(), sizeof fdnum);
    const std::string rule =
        " (memory not allocated by forksafe is shared through a legacy handle, which is valid "
        "only while its producer keeps the tensor alive)";
    if (h.exporter <= 0 || internal::ProcessGone(h.exporter)) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("ImportMemory: the process that exported this legacy handle (pid ",
                               h.exporter, ") has exited", rule));
    }
    fd = open(absl::StrCat("/proc/", h.exporter, "/fd/", fdnum).c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("ImportMemory: the memory behind this legacy handle was freed by "
                               "its producer (pid ", h.exporter, ")", rule));
    }
  } else {
    throw Error(ErrorCode::kInvalidArgument, "ImportMemory: malformed handle: unknown kind");
  }
  size_t named = 0;
  struct stat st;
  if (!internal::ParseSimMemfd(internal::FdTarget(absl::StrCat("/proc/self/fd/", fd)), prefix,
                               index, &named) ||
      fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != h.segment_size ||
      named != h.segment_size) {
    close(fd);
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ImportMemory: malformed handle: the descriptor is not a sim:", index,
                             " segment of ", h.segment_size, " bytes"));
  }
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  auto known = dev.by_id.find(h.segment_id);  // another thread may have mapped it meanwhile
  if (known != dev.by_id.end()) {
    close(fd);
    ++known->second->imports;
    return SimContext::Pointer(index, known->second->va + h.offset);
  }
  SimSegment* seg =
      ctx_->AddSegment(index, dev, SimSegment::kImported, fd, h.segment_size, h.segment_id);
  seg->imports = 1;
  return SimContext::Pointer(index, seg->va + h.offset);
}

void SimBackend::ReleaseImported(int index, void* ptr) {
  CheckIndex(index, "ReleaseImported");
  Initialize();
  const uint64_t off = SimContext::Offset(index, ptr, "ReleaseImported");
  ctx_->WaitAll();  // queued work may still use the mapping
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  SimSegment* seg = ctx_->SegmentAt(dev, off);
  if (seg == nullptr || seg->imports == 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ReleaseImported: sim:", index, " offset ", off,
                             " is not imported memory (or was released already)"));
  }
  if (--seg->imports == 0 && seg->kind == SimSegment::kImported) ctx_->DropSegment(dev, seg);
}

void SimBackend::HoldAfterFree(int index, const void* ptr, std::function<bool()> released) {
  CheckIndex(index, "HoldAfterFree");
  Initialize();
  if (!released) throw Error(ErrorCode::kInvalidArgument, "HoldAfterFree: empty predicate");
  const uint64_t off = SimContext::Offset(index, ptr, "HoldAfterFree");
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  auto it = dev.blocks.find(off);
  if (it == dev.blocks.end() || it->second.parked ||
      it->second.seg->kind != SimSegment::kOwn) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("HoldAfterFree: sim:", index, " offset ", off,
                             " is not the start of a live block of forksafe's allocator"));
  }
  if (it->second.released) {
    it->second.released = [a = std::move(it->second.released), b = std::move(released)] {
      return a() && b();
    };
  } else {
    it->second.released = std::move(released);
  }
}

IpcEventHandle SimBackend::RecordIpcEvent(int index) {
  CheckIndex(index, "RecordIpcEvent");
  Initialize();
  IpcEventHandle e;
  e.exporter = getpid();
  std::unique_lock<std::mutex> lk(ctx_->mem_mu);
  internal::SimEventPool& pool = ctx_->EventPool(index);
  if (pool.capacity == 0) {  // no event to be had: synchronize instead
    lk.unlock();
    ctx_->WaitAll();
    e.complete = true;
    return e;
  }
  const uint32_t slot = pool.next++ % static_cast<uint32_t>(pool.capacity);
  const uint32_t seq = ++pool.sequence[slot];
  uint32_t* word = &pool.page->words[slot];
  std::shared_ptr<internal::SimEventPage> page = pool.page;
  e.complete = false;
  e.fd = page->fd;
  e.pool_id = page->id;
  e.slot = slot;
  e.sequence = seq;
  lk.unlock();
  // Recordings of one slot are enqueued in sequence order (under mem_mu above, then here in the
  // same order per thread; across threads a later sequence may be stored first, which only makes
  // a waiter wait for more work, never less).
  auto complete = [page, word, seq] {
    uint32_t cur = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    while (static_cast<int32_t>(seq - cur) > 0 &&
           !__atomic_compare_exchange_n(word, &cur, seq, false, __ATOMIC_RELEASE,
                                        __ATOMIC_ACQUIRE)) {
    }
    internal::Futex(word, FUTEX_WAKE, INT_MAX, nullptr);
  };
  {
    // An idle stream has nothing for the event to follow: complete it here and spare the device
    // thread a wake-up (the common case of sending a tensor whose writes are long done).
    std::lock_guard<std::mutex> q(ctx_->q_mu);
    if (ctx_->completed == ctx_->submitted) {
      complete();
      return e;
    }
  }
  ctx_->Enqueue(std::move(complete));
  return e;
}

void SimBackend::WaitIpcEvent(int index, const IpcEventHandle& e) {
  CheckIndex(index, "WaitIpcEvent");
  Initialize();
  if (e.complete) return;
  if (e.slot >= static_cast<uint32_t>(internal::kMaxEvents)) {
    throw Error(ErrorCode::kInvalidArgument, "WaitIpcEvent: malformed event: slot out of range");
  }
  std::shared_ptr<internal::SimEventPage> page;
  {
    std::lock_guard<std::mutex> lk(ctx_->mem_mu);
    for (auto& pool : ctx_->event_pools) {
      if (pool.page != nullptr && pool.page->id == e.pool_id) return;  // our own stream: ordered
    }
    auto it = ctx_->peer_pages.find(e.pool_id);
    if (it != ctx_->peer_pages.end()) page = it->second;
  }
  if (page == nullptr) {
    if (e.fd < 0) {
      throw Error(ErrorCode::kInvalidArgument, "WaitIpcEvent: malformed event: no descriptor");
    }
    const std::string target = internal::FdTarget(absl::StrCat("/proc/self/fd/", e.fd));
    if (target.rfind(absl::StrCat("/memfd:", internal::kEventName), 0) != 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "WaitIpcEvent: malformed event: the descriptor is not a sim event page");
    }
    auto fresh = std::make_shared<internal::SimEventPage>();
    fresh->fd = fcntl(e.fd, F_DUPFD_CLOEXEC, 0);
    if (fresh->fd < 0) runtime::ThrowSystemError("WaitIpcEvent: dup", errno);
    void* p = mmap(nullptr, internal::kEventPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   fresh->fd, 0);
    if (p == MAP_FAILED) runtime::ThrowSystemError("WaitIpcEvent: mapping the event page", errno);
    fresh->words = static_cast<uint32_t*>(p);
    fresh->id = e.pool_id;
    std::lock_guard<std::mutex> lk(ctx_->mem_mu);
    if (ctx_->peer_pages.size() >= 256) ctx_->peer_pages.erase(ctx_->peer_pages.begin());
    page = ctx_->peer_pages.emplace(e.pool_id, fresh).first->second;
  }
  uint32_t* word = &page->words[e.slot];
  const uint32_t seq = static_cast<uint32_t>(e.sequence);
  const pid_t exporter = e.exporter;
  // Already complete (the producer's stream was idle, or has caught up): nothing to wait for.
  if (static_cast<int32_t>(__atomic_load_n(word, __ATOMIC_ACQUIRE) - seq) >= 0) return;
  ctx_->Enqueue([page, word, seq, exporter] {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const uint32_t cur = __atomic_load_n(word, __ATOMIC_ACQUIRE);
      if (static_cast<int32_t>(cur - seq) >= 0) return;
      if (internal::ProcessGone(exporter)) {
        if (static_cast<int32_t>(__atomic_load_n(word, __ATOMIC_ACQUIRE) - seq) >= 0) return;
        throw Error(ErrorCode::kProcessFailed,
                    absl::StrCat("the process that produced this memory (pid ", exporter,
                                 ") exited before its work on it completed; the data may be "
                                 "incomplete"));
      }
      if (std::chrono::steady_clock::now() - start > internal::kEventWaitLimit) {
        throw Error(ErrorCode::kDeadlineExceeded,
                    absl::StrCat("waited 120 s for work of pid ", exporter,
                                 " on shared memory to complete"));
      }
      const timespec tick{0, 20 * 1000 * 1000};
      internal::Futex(word, FUTEX_WAIT, cur, &tick);
    }
  });
}

IpcMemoryInfo SimBackend::MemoryInfo(int index) {
  CheckIndex(index, "MemoryInfo");
  Initialize();
  IpcMemoryInfo info;
  info.total = ctx_->devices[index].capacity;
  const size_t used = internal::MachineWideBytes(index);
  info.free = used < info.total ? info.total - used : 0;
  return info;
}

void SimBackend::EmptyCache(int index) {
  CheckIndex(index, "EmptyCache");
  Initialize();
  ctx_->WaitAll();
  std::lock_guard<std::mutex> lk(ctx_->mem_mu);
  SimDeviceMemory& dev = ctx_->devices[index];
  ctx_->ReclaimParked(dev);
  ctx_->ReleaseFreeSegments(dev);
}

int SimBackend::IpcEventPoolCapacity(int index) const {
  CheckIndex(index, "IpcEventPoolCapacity");
  return internal::SimIpcEvents();
}

}  // namespace forksafe::device
