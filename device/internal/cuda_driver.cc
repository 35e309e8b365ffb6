#include "forksafe/device/internal/cuda_driver.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace forksafe::device::internal {
namespace {

// What NVML left open (NvmlKeptDescriptors): published once, read without a lock (a fork while
// a query runs must not leave a lock held in the child); a racing second query merges its own.
std::atomic<const std::map<int, std::string>*> g_nvml_kept{nullptr};

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)
void PublishNvmlKept(const std::map<int, std::string>& found) {
  if (found.empty()) return;
  const std::map<int, std::string>* seen = g_nvml_kept.load(std::memory_order_acquire);
  for (;;) {
    auto* merged = new std::map<int, std::string>(found);
    if (seen != nullptr) merged->insert(seen->begin(), seen->end());
    // On success the replaced map stays allocated on purpose: a reader may be copying it.
    if (g_nvml_kept.compare_exchange_weak(seen, merged, std::memory_order_acq_rel)) return;
    delete merged;  // lost the race: `seen` now holds the newer map; merge again
  }
}
#endif

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

// ---- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------------

struct VisibleDevices {
  bool all = true;           // unset: every device, in order
  bool plain = true;         // a list of indices (else UUIDs or MIG names: only CUDA can map it)
  std::vector<int> indices;  // when !all && plain, up to the first entry CUDA would stop at
};

VisibleDevices ParseVisibleDevices() {
  VisibleDevices v;
  const char* env = getenv("CUDA_VISIBLE_DEVICES");
  if (env == nullptr) return v;
  v.all = false;
  std::string s(env);
  size_t pos = 0;
  while (pos <= s.size() && !s.empty()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    // Trim spaces, as the driver does.
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (item.empty()) break;  // CUDA stops at the first empty or invalid entry
    bool digits = true;
    for (char c : item) digits = digits && c >= '0' && c <= '9';
    if (!digits) {
      if (item[0] == '-') break;  // a negative index ends the list, as in CUDA
      v.plain = false;            // GPU-<uuid>, MIG-<uuid>: leave it to the driver
      return v;
    }
    const long idx = strtol(item.c_str(), nullptr, 10);
    bool dup = false;
    for (int x : v.indices) dup = dup || x == idx;
    if (dup) {  // a repeated index makes CUDA show no device at all
      v.indices.clear();
      break;
    }
    if (idx > 1 << 20) break;
    v.indices.push_back(static_cast<int>(idx));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return v;
}

// ---- NVML (declared here: there is no nvml.h to include) ---------------------------------------

using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
struct nvmlMemory_t {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
constexpr nvmlReturn_t kNvmlSuccess = 0;

// Returns false (with *why) when NVML cannot answer, or when only CUDA can (MIG, UUID lists).
bool QueryNvml(const VisibleDevices& visible, CudaDeviceSummary* out, std::string* why) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    *why = absl::StrCat("libnvidia-ml.so.1 not found (", e ? e : "?", ")");
    return false;
  }
  // The library stays loaded: unloading a driver library is not worth the risk.
  auto init = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(lib, "nvmlInit_v2"));
  auto shutdown = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(lib, "nvmlShutdown"));
  auto count = reinterpret_cast<nvmlReturn_t (*)(unsigned*)>(dlsym(lib, "nvmlDeviceGetCount_v2"));
  auto handle = reinterpret_cast<nvmlReturn_t (*)(unsigned, nvmlDevice_t*)>(
      dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
  auto get_name = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, char*, unsigned)>(
      dlsym(lib, "nvmlDeviceGetName"));
  auto memory = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t*)>(
      dlsym(lib, "nvmlDeviceGetMemoryInfo"));
  auto mig = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned*, unsigned*)>(
      dlsym(lib, "nvmlDeviceGetMigMode"));  // optional (older drivers lack it)
  if (!init || !shutdown || !count || !handle || !get_name || !memory) {
    *why = "libnvidia-ml.so.1 lacks nvmlInit_v2/nvmlDeviceGetCount_v2";
    return false;
  }
  const std::map<int, std::string> fds_before = OpenDescriptors();
  if (init() != kNvmlSuccess) {
    *why = "nvmlInit_v2 failed";
    return false;
  }
  unsigned n = 0;
  std::vector<CudaDeviceSummary::Entry> all;
  bool ok = count(&n) == kNvmlSuccess;
  bool mig_enabled = false;
  for (unsigned i = 0; ok && i < n; ++i) {
    nvmlDevice_t d = nullptr;
    if (handle(i, &d) != kNvmlSuccess) {
      ok = false;
      break;
    }
    char name[96] = {0};
    nvmlMemory_t mem{};
    CudaDeviceSummary::Entry e;
    if (get_name(d, name, sizeof name) == kNvmlSuccess) e.name = name;
    if (memory(d, &mem) == kNvmlSuccess) e.total_memory = static_cast<size_t>(mem.total);
    unsigned current = 0, pending = 0;
    if (mig != nullptr && mig(d, &current, &pending) == kNvmlSuccess && current == 1) {
      mig_enabled = true;
    }
    all.push_back(std::move(e));
  }
  shutdown();
  // nvmlShutdown does not close everything nvmlInit opened (driver 580 keeps two eventfds and
  // two pipes): what is still open now belongs to the library for the life of the process.
  // Only what NVML opens (eventfds, pipes, /dev/nvidia*): a descriptor another thread opened
  // meanwhile must not be taken for the library's and hidden from the tests' leak check.
  std::map<int, std::string> kept;
  for (const auto& [fd, target] : OpenDescriptors()) {
    auto b = fds_before.find(fd);
    const bool nvml_like = target == "anon_inode:[eventfd]" || target.rfind("pipe:", 0) == 0 ||
                           target.rfind("/dev/nvidia", 0) == 0;
    if (nvml_like && (b == fds_before.end() || b->second != target)) kept.emplace(fd, target);
  }
  PublishNvmlKept(kept);
  if (!ok) {
    *why = "nvmlDeviceGetCount_v2/nvmlDeviceGetHandleByIndex_v2 failed";
    return false;
  }
  if (mig_enabled) {
    *why = "MIG is enabled: only CUDA knows which instances this process sees";
    return false;
  }
  if (visible.all) {
    out->devices = std::move(all);
  } else {
    for (int idx : visible.indices) {
      if (idx >= static_cast<int>(all.size())) break;  // CUDA ignores the rest of the list
      out->devices.push_back(all[idx]);
    }
  }
  out->source = "nvml";
  if (out->devices.empty()) {
    out->why = all.empty() ? "NVML reports no NVIDIA GPU on this machine"
                           : "CUDA_VISIBLE_DEVICES hides every GPU";
  }
  return true;
}

// ---- The probe child ---------------------------------------------------------------------------

constexpr auto kProbeTimeout = std::chrono::seconds(30);

// Runs in the forked child: loads the driver, initializes it, writes the answer, _exits.
[[noreturn]] void ProbeChild(int wfd) {
  std::string msg;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    msg = absl::StrCat("ERR libcuda.so.1 not found (", e ? e : "?", ")\n");
  } else {
    auto init = reinterpret_cast<PFN_cuInit_v2000>(dlsym(lib, "cuInit"));
    auto count = reinterpret_cast<PFN_cuDeviceGetCount_v2000>(dlsym(lib, "cuDeviceGetCount"));
    auto get = reinterpret_cast<PFN_cuDeviceGet_v2000>(dlsym(lib, "cuDeviceGet"));
    auto get_name = reinterpret_cast<PFN_cuDeviceGetName_v2000>(dlsym(lib, "cuDeviceGetName"));
    auto total = reinterpret_cast<PFN_cuDeviceTotalMem_v3020>(dlsym(lib, "cuDeviceTotalMem_v2"));
    int n = 0;
    CUresult r = CUDA_ERROR_NOT_FOUND;
    if (!init || !count || !get || !get_name || !total) {
      msg = "ERR libcuda.so.1 lacks cuInit/cuDeviceGetCount\n";
    } else if ((r = init(0)) != CUDA_SUCCESS) {
      msg = absl::StrCat(
          "ERR cuInit failed with CUresult ", static_cast<int>(r),
          r == CUDA_ERROR_NO_DEVICE ? " (CUDA_ERROR_NO_DEVICE: no GPU is visible)" : "", "\n");
    } else if ((r = count(&n)) != CUDA_SUCCESS) {
      msg = absl::StrCat("ERR cuDeviceGetCount failed with CUresult ", static_cast<int>(r), "\n");
    } else {
      msg = absl::StrCat("OK ", n, "\n");
      for (int i = 0; i < n; ++i) {
        CUdevice d = 0;
        char name[96] = {0};
        size_t bytes = 0;
        if (get(&d, i) == CUDA_SUCCESS) {
          get_name(name, sizeof name - 1, d);
          total(&bytes, d);
        }
        for (char* c = name; *c; ++c) {
          if (*c == '\n' || *c == '\t') *c = ' ';
        }
        absl::StrAppend(&msg, bytes, "\t", name, "\n");
      }
    }
  }
  const char* p = msg.data();
  size_t left = msg.size();
  while (left > 0) {
    ssize_t w = write(wfd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    p += w;
    left -= static_cast<size_t>(w);
  }
  _exit(0);
}

void QueryProbe(CudaDeviceSummary* out, const std::string& nvml_why) {
  out->source = "probe";
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    out->why =
        absl::StrCat(nvml_why, "; and the probe could not start (pipe: ", strerror(errno), ")");
    return;
  }
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    ProbeChild(fds[1]);
  }
  close(fds[1]);
  if (pid < 0) {
    const int err = errno;
    close(fds[0]);
    out->why =
        absl::StrCat(nvml_why, "; and the probe could not start (fork: ", strerror(err), ")");
    return;
  }
  std::string text;
  bool timed_out = false;
  const auto deadline = std::chrono::steady_clock::now() + kProbeTimeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      timed_out = r == 0;
      break;
    }
    char buf[512];
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    out->why = absl::StrCat("the CUDA probe process (cuInit in a child) did not answer within ",
                            kProbeTimeout.count(), " s");
    return;
  }
  if (text.rfind("OK ", 0) != 0) {
    std::string msg = text.rfind("ERR ", 0) == 0 ? text.substr(4) : text;
    while (!msg.empty() && msg.back() == '\n') msg.pop_back();
    if (msg.empty()) msg = "the CUDA probe process ended without an answer";
    out->why = msg;
    return;
  }
  size_t line_end = text.find('\n');
  const int n = atoi(text.c_str() + 3);
  for (int i = 0; i < n && line_end != std::string::npos; ++i) {
    const size_t start = line_end + 1;
    line_end = text.find('\n', start);
    if (line_end == std::string::npos) break;
    const std::string line = text.substr(start, line_end - start);
    const size_t tab = line.find('\t');
    CudaDeviceSummary::Entry e;
    e.total_memory = static_cast<size_t>(strtoull(line.c_str(), nullptr, 10));
    if (tab != std::string::npos) e.name = line.substr(tab + 1);
    out->devices.push_back(std::move(e));
  }
  if (out->devices.empty()) out->why = "cuDeviceGetCount reports no device";
}

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

CudaDeviceSummary* Compute() {
  auto* out = new CudaDeviceSummary();
#if !defined(FORKSAFE_HAVE_CUDA_HEADERS)
  out->source = "none";
  out->why =
      "forksafe was built without the CUDA Toolkit headers (set FORKSAFE_CUDA_HOME to a toolkit "
      "with include/cuda.h, or install it at /usr/local/cuda, and rebuild)";
  return out;
#else
  const VisibleDevices visible = ParseVisibleDevices();
  std::string nvml_why;
  if (visible.plain && QueryNvml(visible, out, &nvml_why)) return out;
  if (!visible.plain) nvml_why = "CUDA_VISIBLE_DEVICES names devices by UUID";
  QueryProbe(out, nvml_why);
  return out;
#endif
}

}  // namespace

std::map<int, std::string> OpenDescriptors() {
  std::map<int, std::string> out;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  const int self = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = atoi(e->d_name);
    if (fd == self) continue;
    char target[256] = {0};
    const std::string path = absl::StrCat("/proc/self/fd/", fd);
    const ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
    out[fd] = n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string();
  }
  closedir(dir);
  return out;
}

std::map<int, std::string> NvmlKeptDescriptors() {
  const std::map<int, std::string>* kept = g_nvml_kept.load(std::memory_order_acquire);
  return kept == nullptr ? std::map<int, std::string>() : *kept;
}

const CudaDeviceSummary& QueryCudaDevices() {
  // No lock: a fork while another thread computes must not leave one held in the child.
  static std::atomic<const CudaDeviceSummary*> cached{nullptr};
  if (const CudaDeviceSummary* s = cached.load(std::memory_order_acquire)) return *s;
  CudaDeviceSummary* mine = Compute();
  const CudaDeviceSummary* expected = nullptr;
  if (!cached.compare_exchange_strong(expected, mine, std::memory_order_acq_rel)) {
    delete mine;  // another thread answered first
    return *expected;
  }
  return *mine;
}

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

const CudaDriver* LoadCudaDriver(std::string* why) {
  static CudaDriver* loaded = nullptr;  // guarded by the caller (the backend's init lock)
  if (loaded != nullptr) return loaded;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    *why = absl::StrCat("libcuda.so.1 not found (", e ? e : "?",
                        "); install the NVIDIA driver, or run on a machine with a GPU");
    return nullptr;
  }
  auto* d = new CudaDriver();
  d->library = lib;
  d->cuInit = reinterpret_cast<PFN_cuInit_v2000>(dlsym(lib, "cuInit"));
  auto proc12 = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
  auto proc11 = reinterpret_cast<PFN_cuGetProcAddress_v11030>(dlsym(lib, "cuGetProcAddress"));
  if (d->cuInit == nullptr) {
    *why = "libcuda.so.1 has no cuInit (not an NVIDIA driver library?)";
    delete d;
    return nullptr;
  }
  const CUresult r = d->cuInit(0);
  // Resolution: ask the driver for the ABI of CUDA 12.0 (the typedef versions in the table), with
  // the legacy default-stream semantics; else the exported, versioned symbol.
  auto resolve = [&](const char* base, const char* symbol) -> void* {
    void* fn = nullptr;
    if (proc12 != nullptr) {
      CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      if (proc12(base, &fn, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found) != CUDA_SUCCESS ||
          found != CU_GET_PROC_ADDRESS_SUCCESS) {
        fn = nullptr;
      }
    } else if (proc11 != nullptr) {
      if (proc11(base, &fn, 11000, CU_GET_PROC_ADDRESS_LEGACY_STREAM) != CUDA_SUCCESS) {
        fn = nullptr;
      }
    }
    if (fn == nullptr) fn = dlsym(lib, symbol);
    return fn;
  };
  std::string missing;
#define FORKSAFE_CUDA_RESOLVE(name, version, symbol)                           \
  d->name = reinterpret_cast<PFN_##name##_v##version>(resolve(#name, symbol)); \
  if (d->name == nullptr) absl::StrAppend(&missing, missing.empty() ? "" : ", ", symbol);
  FORKSAFE_CUDA_DRIVER_FUNCTIONS(FORKSAFE_CUDA_RESOLVE)
#undef FORKSAFE_CUDA_RESOLVE
  if (r != CUDA_SUCCESS) {
    *why = absl::StrCat(
        "cuInit failed: ", CuResultText(*d, r),
        r == CUDA_ERROR_NO_DEVICE ? " (no GPU visible: check CUDA_VISIBLE_DEVICES)" : "");
    delete d;  // the library stays loaded; a later call tries cuInit again
    return nullptr;
  }
  if (!missing.empty()) {
    *why = absl::StrCat("the NVIDIA driver is too old: libcuda.so.1 lacks ", missing,
                        " (forksafe needs a driver for CUDA 11.0 or newer)");
    delete d;
    return nullptr;
  }
  d->cuDriverGetVersion(&d->driver_version);
  loaded = d;
  return loaded;
}

std::string CuResultText(const CudaDriver& driver, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver.cuGetErrorName == nullptr || driver.cuGetErrorName(result, &name) != CUDA_SUCCESS) {
    name = nullptr;
  }
  if (driver.cuGetErrorString == nullptr ||
      driver.cuGetErrorString(result, &text) != CUDA_SUCCESS) {
    text = nullptr;
  }
  return absl::StrCat(name ? name : "CUresult", " ", static_cast<int>(result), " (",
                      text ? text : "unknown error", ")");
}

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

}  // namespace forksafe::device::internal
