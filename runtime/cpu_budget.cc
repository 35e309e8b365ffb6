#include "forksafe/runtime/cpu_budget.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/cgroup.h"
#include "forksafe/runtime/internal/cpu_budget_parts.h"
#include "forksafe/runtime/launch_info.h"

namespace forksafe::runtime {
namespace internal {
namespace {

bool Blank(char c) { return c == ' ' || c == '\t' || c == '\n'; }

std::string_view TrimBlanks(std::string_view s) {
  while (!s.empty() && Blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && Blank(s.back())) s.remove_suffix(1);
  return s;
}

// One item of an override: a whole number in [1, kMaxThreadOverride], or 0 when it is not one.
int ParseCount(std::string_view item) {
  item = TrimBlanks(item);
  if (item.empty() || item.front() < '0' || item.front() > '9') return 0;  // no sign, no "+"
  long long v = 0;
  const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
  if (ec != std::errc() || end != item.data() + item.size()) return 0;
  return v >= 1 && v <= kMaxThreadOverride ? static_cast<int>(v) : 0;
}

// What a valid value of the variable looks like, for messages.
std::string OverrideForm(bool list) {
  return list ? absl::StrCat("a comma-separated list of whole numbers in [1, ", kMaxThreadOverride,
                             "] (\"8\" or \"8,2\"); forksafe sizes its default pools by the first")
              : absl::StrCat("a whole number in [1, ", kMaxThreadOverride, "]");
}

}  // namespace

int ParseThreadCountValue(const char* value, bool list) {
  if (value == nullptr || TrimBlanks(value).empty()) return 0;
  const std::string_view text(value);
  int first = 0;
  size_t start = 0;
  for (;;) {
    const size_t comma = list ? text.find(',', start) : std::string_view::npos;
    const int n = ParseCount(text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (n == 0) return -1;
    if (first == 0) first = n;
    if (comma == std::string_view::npos) return first;
    start = comma + 1;
  }
}

int ParseThreadOverride(const char* name, const char* value, bool list) {
  const int n = ParseThreadCountValue(value, list);
  if (n >= 0) return n;
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat(name, "=\"", value, "\" is not a thread count: it must be ",
                           OverrideForm(list), ". Fix or unset ", name,
                           " (unset, default pools use the CPUs this process may run on: its "
                           "affinity mask and cgroup quota), or give the pool an explicit size"));
}

int AffinityCpuCount() {
  const long configured = sysconf(_SC_NPROCESSORS_CONF);
  // glibc's cpu_set_t holds 1024 CPUs; a kernel with more refuses it (EINVAL): grow the set.
  for (size_t n = static_cast<size_t>(std::max(1024L, configured)); n <= (size_t{1} << 22);
       n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) return 0;
    const size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    // The main thread's mask (its tid is the pid), not the calling thread's: see the banner.
    int rc = sched_getaffinity(getpid(), bytes, set);
    // ESRCH: no main thread to read (not seen on Linux, where an exited main thread stays a zombie
    // while the process lives): the calling thread's mask is the best left.
    if (rc != 0 && errno == ESRCH) rc = sched_getaffinity(0, bytes, set);
    const int err = errno;
    const int count = rc == 0 ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (rc == 0) return count;
    if (err != EINVAL) return 0;
  }
  return 0;
}

CpuBudget ComputeCpuBudget(const CpuBudgetInputs& in) {
  CpuBudget b;
  b.affinity_cpus = in.affinity_cpus;
  b.quota_cpus = in.quota.cpus;
  b.quota_file = in.quota.cpus > 0 ? in.quota.file : "";
  b.hardware_cpus = in.hardware_cpus;
  // Ours decides when it is set: OMP_NUM_THREADS is then not even read (finding 1 of the review
  // of issue 14: a malformed one used to throw although it decided nothing).
  const int forksafe = ParseThreadOverride(kForksafeNumThreadsEnv, in.forksafe_num_threads, false);
  if (forksafe > 0) {
    b.cpus = forksafe;
    b.source = CpuBudgetSource::kForksafeNumThreads;
    return b;
  }
  // OMP_NUM_THREADS belongs to the OpenMP runtime: a value it would not take either is ignored
  // with a warning (GetCpuBudget prints it), as libgomp itself does, never an error of ours.
  const int omp = ParseThreadCountValue(in.omp_num_threads, true);
  if (omp > 0) {
    b.cpus = omp;
    b.source = CpuBudgetSource::kOmpNumThreads;
    return b;
  }
  int cpus = in.affinity_cpus;
  b.source = CpuBudgetSource::kAffinity;
  if (cpus <= 0) {
    cpus = in.hardware_cpus;
    b.source = CpuBudgetSource::kHardware;
  }
  if (in.quota.cpus > 0 && (cpus <= 0 || in.quota.cpus < cpus)) {
    cpus = in.quota.cpus;
    b.source = CpuBudgetSource::kCgroupQuota;
  }
  b.cpus = std::max(1, cpus);
  b.ranks_on_node = std::max(1, in.ranks_on_node);
  // Several ranks on this node: none takes more than its share of the node's CPUs (the machine,
  // or the cgroup quota when smaller). A rank bound to fewer CPUs keeps its mask's count.
  if (b.ranks_on_node > 1) {
    int node = in.hardware_cpus > 0 ? in.hardware_cpus : cpus;
    if (in.quota.cpus > 0 && in.quota.cpus < node) node = in.quota.cpus;
    const int share = std::max(1, node / b.ranks_on_node);
    if (share < b.cpus) {
      b.cpus = share;
      b.source = CpuBudgetSource::kLauncherShare;
    }
  }
  if (omp < 0) {
    b.warning = absl::StrCat("forksafe: ignoring ", kOmpNumThreadsEnv, "=\"", in.omp_num_threads,
                             "\": it is not a thread count (it must be ", OverrideForm(true),
                             "); forksafe's default pools use ", b.ToString(), " instead. Fix ",
                             kOmpNumThreadsEnv, ", or set ", kForksafeNumThreadsEnv,
                             " to size forksafe's pools without it");
  }
  return b;
}

}  // namespace internal

const char* CpuBudgetSourceName(CpuBudgetSource source) {
  switch (source) {
    case CpuBudgetSource::kForksafeNumThreads: return "FORKSAFE_NUM_THREADS";
    case CpuBudgetSource::kOmpNumThreads: return "OMP_NUM_THREADS";
    case CpuBudgetSource::kCgroupQuota: return "cgroup_quota";
    case CpuBudgetSource::kAffinity: return "affinity";
    case CpuBudgetSource::kHardware: return "hardware";
    case CpuBudgetSource::kLauncherShare: return "launcher_share";
  }
  return "unknown";
}

std::string CpuBudget::ToString() const {
  return absl::StrCat(
      cpus, cpus == 1 ? " CPU (" : " CPUs (", CpuBudgetSourceName(source), "; mask ",
      affinity_cpus > 0 ? std::to_string(affinity_cpus) : "unknown", ", cgroup quota ",
      quota_cpus > 0 ? absl::StrCat(quota_cpus, " from ", quota_file) : "none", ", machine ",
      hardware_cpus > 0 ? std::to_string(hardware_cpus) : "unknown",
      ranks_on_node > 1 ? absl::StrCat(", ", ranks_on_node, " ranks on the node") : std::string(),
      ")");
}

CpuBudget GetCpuBudget() {
  internal::CpuBudgetInputs in;
  in.forksafe_num_threads = std::getenv(kForksafeNumThreadsEnv);
  in.omp_num_threads = std::getenv(kOmpNumThreadsEnv);
  in.affinity_cpus = internal::AffinityCpuCount();
  in.quota = internal::ReadCpuQuota();
  in.hardware_cpus = static_cast<int>(std::thread::hardware_concurrency());
  std::string launcher_warning;
  try {
    in.ranks_on_node = GetLaunchInfo().local_world_size;
  } catch (const Error& e) {
    launcher_warning = absl::StrCat(e.what(), "; forksafe's default pools ignore the launcher");
  }
  CpuBudget b = internal::ComputeCpuBudget(in);
  static std::atomic<bool> warned_launcher{false};
  if (!launcher_warning.empty() && !warned_launcher.exchange(true, std::memory_order_relaxed)) {
    std::fprintf(stderr, "%s\n", launcher_warning.c_str());
  }
  // Once per process: pools are made many times, the environment does not change.
  static std::atomic<bool> warned{false};
  if (!b.warning.empty() && !warned.exchange(true, std::memory_order_relaxed)) {
    std::fprintf(stderr, "%s\n", b.warning.c_str());
  }
  return b;
}

int DefaultThreadCount() { return GetCpuBudget().cpus; }

}  // namespace forksafe::runtime
