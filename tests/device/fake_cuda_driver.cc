// tests/device/fake_cuda_driver.cc: a FAKE libcuda.so.1 for running the CUDA backend's tests on
// machines without a GPU (//tests/device:cuda_backend_fake_driver_test). Not a driver.
//
// What it offers
//   The few driver entry points device/cuda_backend.cc resolves (exported under their versioned
//   names; there is no cuGetProcAddress, so the backend's dlsym fallback is what runs), with host
//   memory standing in for device memory: cuMemCreate makes a memfd, cuMemAddressReserve an
//   inaccessible reservation, cuMemMap maps the memfd there, export/import pass the memfd, and
//   legacy IPC handles name /proc/<pid>/fd/<n> of a memfd. Copies and memsets write at once,
//   but a memset keeps its stream busy for 2 ms as queued work would: cuStreamQuery says
//   CUDA_ERROR_NOT_READY until then, cuStreamSynchronize sleeps until then, an event recorded
//   on it completes then. An event opened from another process's handle is complete (its
//   recording is not visible here). FAKE_CUDA_DEVICES sets the count (default 1).
//
// Hazard: it proves the backend's bookkeeping (allocator, IPC tables, the fork rules), not its
// use of a real driver: ordering, contexts and driver errors only a GPU can check.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
typedef int CUresult;
typedef unsigned long long DP;
struct Alloc {
  int fd;
  size_t size;
  bool imported = false;  // made by cuMemImportFromShareableHandle
};
static std::mutex mu;
static size_t g_used = 0;
static const size_t kTotal = size_t{80} << 30;
static std::map<DP, std::pair<size_t, int>> g_legacy;  // cuMemAlloc: base -> size, fd
static std::map<DP, size_t> g_opened;
static int Devs() {
  const char* v = getenv("FAKE_CUDA_DEVICES");
  return v ? atoi(v) : 1;
}
extern "C" {
CUresult cuInit(unsigned) { return Devs() > 0 ? 0 : 100; }
CUresult cuGetErrorName(CUresult r, const char** s) {
  static thread_local char b[64];
  snprintf(b, 64, "CUDA_ERROR_FAKE_%d", r);
  *s = b;
  return 0;
}
CUresult cuGetErrorString(CUresult r, const char** s) {
  *s = "fake error";
  return 0;
}
CUresult cuDriverGetVersion(int* v) {
  *v = 12040;
  return 0;
}
CUresult cuDeviceGet(int* d, int i) {
  if (i >= Devs()) return 101;
  *d = i;
  return 0;
}
CUresult cuDeviceGetCount(int* n) {
  *n = Devs();
  return 0;
}
CUresult cuDeviceGetName(char* name, int len, int d) {
  snprintf(name, len, "Fake GPU %d", d);
  return 0;
}
CUresult cuDeviceTotalMem_v2(size_t* b, int) {
  *b = kTotal;
  return 0;
}
CUresult cuDeviceGetAttribute(int* v, int, int) {
  *v = 1;
  return 0;
}
CUresult cuDevicePrimaryCtxRetain(void** c, int d) {
  *c = reinterpret_cast<void*>(uintptr_t(0x1000 + d));
  return 0;
}
CUresult cuCtxSetCurrent(void*) { return 0; }
// Streams and events hold when their work is done (steady-clock nanoseconds; 0: nothing queued).
struct Timeline {
  std::atomic<int64_t> done_at{0};
};
constexpr int64_t kMemsetNanos = 2000000;  // how long a memset keeps its stream busy
constexpr CUresult kNotReady = 600;        // CUDA_ERROR_NOT_READY
int64_t NowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
CUresult cuStreamCreate(void** s, unsigned) {
  *s = new Timeline();
  return 0;
}
CUresult cuStreamSynchronize(void* s) {
  const int64_t left = static_cast<Timeline*>(s)->done_at.load() - NowNanos();
  if (left > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(left));
  return 0;
}
CUresult cuStreamQuery(void* s) {
  return static_cast<Timeline*>(s)->done_at.load() > NowNanos() ? kNotReady : 0;
}
CUresult cuStreamWaitEvent(void* s, void* e, unsigned) {
  auto* t = static_cast<Timeline*>(s);
  t->done_at.store(std::max(t->done_at.load(), static_cast<Timeline*>(e)->done_at.load()));
  return 0;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const void*, int) {
  *g = 2 << 20;
  return 0;
}
CUresult cuMemCreate(unsigned long long* h, size_t size, const void*, unsigned long long) {
  std::lock_guard<std::mutex> lk(mu);
  if (g_used + size > kTotal) return 2;
  int fd = memfd_create("fake_gpu_memory", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, size) != 0) return 2;
  g_used += size;
  *h = reinterpret_cast<uintptr_t>(new Alloc{fd, size});
  return 0;
}
CUresult cuMemRelease(unsigned long long h) {
  auto* a = reinterpret_cast<Alloc*>(h);
  std::lock_guard<std::mutex> lk(mu);
  g_used -= a->size;
  close(a->fd);
  delete a;
  return 0;
}
CUresult cuMemAddressReserve(DP* p, size_t size, size_t, DP, unsigned long long) {
  void* v = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (v == MAP_FAILED) return 2;
  *p = reinterpret_cast<uintptr_t>(v);
  return 0;
}
CUresult cuMemAddressFree(DP p, size_t size) {
  munmap(reinterpret_cast<void*>(p), size);
  return 0;
}
CUresult cuMemMap(DP p, size_t size, size_t off, unsigned long long h, unsigned long long) {
  auto* a = reinterpret_cast<Alloc*>(h);
  void* v = mmap(reinterpret_cast<void*>(p), size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                 a->fd, off);
  return v == MAP_FAILED ? 1 : 0;
}
CUresult cuMemUnmap(DP p, size_t size) {
  mmap(reinterpret_cast<void*>(p), size, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return 0;
}
CUresult cuMemSetAccess(DP, size_t, const void*, size_t) { return 0; }
CUresult cuMemExportToShareableHandle(void* out, unsigned long long h, int, unsigned long long) {
  // As the real driver (580): an imported handle cannot be exported again.
  if (reinterpret_cast<Alloc*>(h)->imported) return 1;  // CUDA_ERROR_INVALID_VALUE
  *static_cast<int*>(out) = dup(reinterpret_cast<Alloc*>(h)->fd);
  return 0;
}
CUresult cuMemImportFromShareableHandle(unsigned long long* h, void* os, int) {
  int fd = static_cast<int>(reinterpret_cast<intptr_t>(os));
  struct stat st;
  if (fstat(fd, &st) != 0) return 1;
  int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  std::lock_guard<std::mutex> lk(mu);
  g_used += st.st_size;
  *h = reinterpret_cast<uintptr_t>(new Alloc{d, static_cast<size_t>(st.st_size), true});
  return 0;
}
CUresult cuMemcpyHtoDAsync_v2(DP d, const void* s, size_t n, void*) {
  memcpy(reinterpret_cast<void*>(d), s, n);
  return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void* d, DP s, size_t n, void*) {
  memcpy(d, reinterpret_cast<void*>(s), n);
  return 0;
}
CUresult cuMemcpyDtoDAsync_v2(DP d, DP s, size_t n, void*) {
  memmove(reinterpret_cast<void*>(d), reinterpret_cast<void*>(s), n);
  return 0;
}
CUresult cuMemcpyPeerAsync(DP d, void*, DP s, void*, size_t n, void*) {
  memmove(reinterpret_cast<void*>(d), reinterpret_cast<void*>(s), n);
  return 0;
}
CUresult cuMemsetD8Async(DP d, unsigned char v, size_t n, void* s) {
  memset(reinterpret_cast<void*>(d), v, n);
  if (s != nullptr) {
    auto* t = static_cast<Timeline*>(s);
    t->done_at.store(std::max(t->done_at.load(), NowNanos()) + kMemsetNanos);
  }
  return 0;
}
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) {
  std::lock_guard<std::mutex> lk(mu);
  *f = kTotal - g_used;
  *t = kTotal;
  return 0;
}
CUresult cuMemAlloc_v2(DP* p, size_t n) {
  int fd = memfd_create("fake_gpu_legacy", MFD_CLOEXEC);
  if (ftruncate(fd, n) != 0) return 2;
  void* v = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  std::lock_guard<std::mutex> lk(mu);
  *p = reinterpret_cast<uintptr_t>(v);
  g_legacy[*p] = {n, fd};
  return 0;
}
CUresult cuMemFree_v2(DP p) {
  std::lock_guard<std::mutex> lk(mu);
  auto it = g_legacy.find(p);
  if (it == g_legacy.end()) return 1;
  munmap(reinterpret_cast<void*>(p), it->second.first);
  close(it->second.second);
  g_legacy.erase(it);
  return 0;
}
CUresult cuMemGetAddressRange_v2(DP* base, size_t* size, DP p) {
  std::lock_guard<std::mutex> lk(mu);
  auto it = g_legacy.upper_bound(p);
  if (it == g_legacy.begin()) return 1;
  --it;
  if (p >= it->first + it->second.first) return 1;
  *base = it->first;
  *size = it->second.first;
  return 0;
}
struct IpcH {
  int pid;
  int fd;
  size_t size;
  char pad[48];
};
CUresult cuIpcGetMemHandle(void* h, DP p) {
  std::lock_guard<std::mutex> lk(mu);
  auto it = g_legacy.find(p);
  if (it == g_legacy.end()) return 1;
  IpcH x{getpid(), it->second.second, it->second.first, {}};
  memcpy(h, &x, 64);
  return 0;
}
struct H64 {
  char b[64];
};
CUresult cuIpcOpenMemHandle_v2(DP* p, H64 h, unsigned) {
  IpcH x;
  memcpy(&x, &h, 64);
  if (x.pid == getpid()) return 201;
  char path[64];
  snprintf(path, 64, "/proc/%d/fd/%d", x.pid, x.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return 400;
  void* v = mmap(nullptr, x.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (v == MAP_FAILED) return 2;
  std::lock_guard<std::mutex> lk(mu);
  *p = reinterpret_cast<uintptr_t>(v);
  g_opened[*p] = x.size;
  return 0;
}
CUresult cuIpcCloseMemHandle(DP p) {
  std::lock_guard<std::mutex> lk(mu);
  auto it = g_opened.find(p);
  if (it == g_opened.end()) return 1;
  munmap(reinterpret_cast<void*>(p), it->second);
  g_opened.erase(it);
  return 0;
}
CUresult cuEventCreate(void** e, unsigned) {
  *e = new Timeline();
  return 0;
}
CUresult cuEventRecord(void* e, void* s) {
  static_cast<Timeline*>(e)->done_at.store(s ? static_cast<Timeline*>(s)->done_at.load() : 0);
  return 0;
}
CUresult cuEventQuery(void* e) {
  return static_cast<Timeline*>(e)->done_at.load() > NowNanos() ? kNotReady : 0;
}
CUresult cuEventDestroy_v2(void* e) {
  delete static_cast<Timeline*>(e);
  return 0;
}
// An event handle names its process: like a real driver's, it cannot be opened once that process
// is gone (CUDA_ERROR_INVALID_HANDLE).
CUresult cuIpcGetEventHandle(void* h, void*) {
  memset(h, 7, 64);
  const int pid = getpid();
  memcpy(h, &pid, sizeof pid);
  return 0;
}
CUresult cuIpcOpenEventHandle(void** e, H64 h) {
  int pid = 0;
  memcpy(&pid, &h, sizeof pid);
  if (kill(pid, 0) != 0 && errno == ESRCH) return 400;
  *e = new Timeline();
  return 0;
}
}
