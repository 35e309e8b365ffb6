// device/internal/sim_context.cc: the simulated accelerator's context (device/internal/
// sim_context.h): its configuration, its stream (the device thread), its memory (segments and the
// caching allocator) and the machine-wide memory count.
#include "forksafe/device/internal/sim_context.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/memory_bounds.h"
#include "forksafe/runtime/internal/random.h"
#include "forksafe/runtime/tbb_fork.h"

namespace forksafe::device::internal {

using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

namespace {

int EnvInt(const char* name, int def, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < lo || n > hi) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("environment variable ", name, "=\"", v, "\" is not an integer in [",
                             lo, ", ", hi, "]; fix or unset it"));
  }
  return static_cast<int>(n);
}

}  // namespace

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

int SimDeviceCount() { return EnvInt("FORKSAFE_SIM_DEVICES", 2, 0, 16); }
size_t SimMemoryBytes() {
  return static_cast<size_t>(EnvInt("FORKSAFE_SIM_MEMORY_MB", 64, 1, 65536)) << 20;
}
int SimIpcEvents() { return EnvInt("FORKSAFE_SIM_IPC_EVENTS", 64, 0, kMaxEvents); }

// ---- the stream
// ----------------------------------------------------------------------------------

void SimContext::Run() {
  MutexLock lk(&q_mu);
  for (;;) {
    while (queue.empty() || parked_for_fork.load()) q_cv.Wait(&lk);
    std::function<void()> op = std::move(queue.front());
    queue.pop_front();
    lk.Unlock();
    std::exception_ptr err;
    try {
      op();
    } catch (...) {
      err = std::current_exception();
    }
    op = nullptr;  // what the operation captured goes before it counts as completed
    // A kernel that ran a oneTBB algorithm left this thread holding oneTBB state: dropped here,
    // so that the idle device thread holds none (a fork may park it: ParkForFork).
    runtime::ReleaseTbbThreadState();
    lk.Lock();
    if (err && !async_error) async_error = err;
    ++completed;
    done_cv.NotifyAll();
  }
}

void SimContext::ParkForFork() {
  // Counted first: a fork that cannot turn quiet writes nothing here (each page written around a
  // fork costs a copy-on-write fault).
  if (!runtime::ParkingWouldQuietFork(1)) return;
  if (!q_mu.TryLock()) return;  // in use this instant: not idle, and a prepare does not wait
  // Idle: every operation queued so far has completed (its completion is counted under q_mu
  // after its oneTBB state was dropped), so the device thread waits on q_cv, or for q_mu before
  // its first wait, holding nothing else. Only a running thread could queue more; when parking
  // makes the fork quiet there is none but the forking thread, and anything queued from now on
  // waits for UnparkAfterFork.
  if (queue.empty() && completed == submitted && !parked_for_fork.load()) {
    parked_for_fork.store(true);
    runtime::NoteThreadsParkedForFork(1);
  }
  q_mu.Unlock();
}

void SimContext::UnparkAfterFork() {
  if (!parked_for_fork.load()) return;  // written only under q_mu, by this (forking) thread
  MutexLock lk(&q_mu);
  parked_for_fork.store(false);
  if (!queue.empty()) q_cv.NotifyOne();
}

uint64_t SimContext::Enqueue(std::function<void()> op) {
  MutexLock lk(&q_mu);
  queue.push_back(std::move(op));
  q_cv.NotifyOne();
  return ++submitted;
}

void SimContext::WaitFor(uint64_t ticket) {
  MutexLock lk(&q_mu);
  while (completed < ticket) done_cv.Wait(&lk);
}

void SimContext::WaitAll() {
  MutexLock lk(&q_mu);
  const uint64_t target = submitted;
  while (completed < target) done_cv.Wait(&lk);
}

void SimContext::Drain() {
  MutexLock lk(&q_mu);
  const uint64_t target = submitted;
  while (completed < target) done_cv.Wait(&lk);
  if (async_error) std::rethrow_exception(std::exchange(async_error, nullptr));
}

// Rethrows (once) an error of earlier stream work, like a sticky CUDA error at the next
// synchronous call.
void SimContext::RaiseAsyncError() {
  MutexLock lk(&q_mu);
  if (async_error) std::rethrow_exception(std::exchange(async_error, nullptr));
}

// ---- memory ------------------------------------------------------------------------------------

// The device offset of a tagged pointer of device `index`; throws for anything else.
uint64_t SimContext::Offset(int index, const void* dev_ptr, const char* what) {
  const uint64_t v = reinterpret_cast<uint64_t>(dev_ptr);
  if ((v & kTagMask) != kTag || static_cast<int>((v & ~kTagMask) >> kIndexShift) != index) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat(what, ": pointer ", absl::Hex(v), " is not memory of device sim:",
                             index, "; pass a pointer returned by Allocate on that device"));
  }
  return v & kOffsetMask;
}

// The segment holding device offset `off`, or null. Caller holds mem_mu.
SimSegment* SimContext::SegmentAt(SimDeviceMemory& dev, uint64_t off) {
  auto it = dev.segments.upper_bound(off);
  if (it == dev.segments.begin()) return nullptr;
  --it;
  SimSegment* seg = it->second.get();
  return off < seg->va + seg->size ? seg : nullptr;
}

// Translates a tagged device pointer into a host view of `bytes` bytes, checking that the
// range lies inside one live (or held) block, or inside an imported segment.
char* SimContext::Translate(int index, const void* dev_ptr, size_t bytes, const char* what) {
  const uint64_t off = Offset(index, dev_ptr, what);
  MutexLock lk(&mem_mu);
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
                absl::StrCat(what, ": range of ", bytes, " bytes at sim:", index, " offset ", off,
                             " is not inside a live allocation (freed memory, or an access "
                             "past the end)"));
  }
  return seg->host + (off - seg->va);
}

// Maps `fd` (owned from now on) as a segment of `dev`. Caller holds mem_mu.
SimSegment* SimContext::AddSegment(int index, SimDeviceMemory& dev, SimSegment::Kind kind, int fd,
                                   size_t size, uint64_t id) {
  auto seg = std::make_unique<SimSegment>();
  seg->kind = kind;
  seg->fd = fd;
  seg->size = size;
  seg->id = id;
  void* host = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (host == MAP_FAILED) {
    const int err = errno;
    runtime::ThrowSystemError(
        absl::StrCat("sim:", index, ": mapping a segment of ", size, " bytes"),
        err);  // ~SimSegment closes fd
  }
  seg->host = static_cast<char*>(host);
  if (size > kOffsetMask - dev.next_va) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat("sim:", index, " ran out of device address space"));
  }
  seg->va = dev.next_va;
  dev.next_va += runtime::internal::RoundUpOrThrow(size, kGranularity, "sim");
  SimSegment* raw = seg.get();
  dev.by_id[id] = raw;
  dev.segments[raw->va] = std::move(seg);
  return raw;
}

void SimContext::DropSegment(SimDeviceMemory& dev, SimSegment* seg) {
  if (seg->kind != SimSegment::kImported) dev.reserved -= seg->size;
  dev.by_id.erase(seg->id);
  dev.segments.erase(seg->va);  // unmaps and closes
}

// A new memfd of `size` bytes, reserved so that running out is an error here, not a SIGBUS.
int SimContext::CreateMemfd(int index, const char* prefix, size_t size) {
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
                  absl::StrCat("sim:", index, ": reserving a segment of ", size, " bytes failed: ",
                               std::strerror(err), " (host memory or descriptors ran out)"));
    }
    runtime::ThrowSystemError(absl::StrCat("sim:", index, ": sizing a segment of ", size, " bytes"),
                              err);
  }
  return fd;
}

// Returns held blocks whose holders all let go to their segments. Caller holds mem_mu.
void SimContext::ReclaimParked(SimDeviceMemory& dev) {
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
void SimContext::ReturnBlock(SimDeviceMemory& dev, uint64_t va) {
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
void SimContext::ReleaseFreeSegments(SimDeviceMemory& dev) {
  std::vector<SimSegment*> drop;
  for (auto& [va, seg] : dev.segments) {
    if (seg->kind == SimSegment::kOwn && seg->live == 0 && seg->imports == 0) {
      drop.push_back(seg.get());
    }
  }
  for (SimSegment* s : drop) DropSegment(dev, s);
}

// First fit over the cached free blocks. Caller holds mem_mu.
void* SimContext::Carve(int index, SimDeviceMemory& dev, size_t need) {
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
void SimContext::Reserve(int index, SimDeviceMemory& dev, size_t size, size_t requested) {
  if (size <= dev.capacity && dev.reserved <= dev.capacity - size) return;
  ReclaimParked(dev);
  ReleaseFreeSegments(dev);
  if (size <= dev.capacity && dev.reserved <= dev.capacity - size) return;
  throw Error(ErrorCode::kResourceExhausted,
              absl::StrCat("sim:", index, " is out of memory: ", requested, " bytes requested, ",
                           dev.capacity - dev.in_use, " of ", dev.capacity,
                           " free (fragmented, held for other processes, or full); free "
                           "tensors, or raise FORKSAFE_SIM_MEMORY_MB"));
}

SimEventPool& SimContext::EventPool(int index) {
  SimEventPool& pool = event_pools[index];
  if (pool.page == nullptr) {
    auto page = std::make_shared<SimEventPage>();
    page->fd = CreateMemfd(index, kEventName, kEventPageBytes);
    void* p = mmap(nullptr, kEventPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, page->fd, 0);
    if (p == MAP_FAILED) runtime::ThrowSystemError("sim: mapping the event page", errno);
    page->words = static_cast<uint32_t*>(p);
    page->id = runtime::internal::RandomId();
    pool.capacity = SimIpcEvents();
    pool.sequence.assign(static_cast<size_t>(kMaxEvents), 0);
    pool.page = std::move(page);
  }
  return pool;
}

// ---- the machine-wide memory count
// ---------------------------------------------------------------

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

}  // namespace forksafe::device::internal
