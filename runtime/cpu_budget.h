// runtime/cpu_budget.h: how many CPUs this process may really use (the default size of pools).
//
// What it offers
//   GetCpuBudget() answers "how many threads should a pool that was given no size start?", and
//   says why. ThreadPoolOptions::num_threads = 0 (runtime/thread_pool.h) and
//   mp::PoolOptions::processes = 0 (mp/pool.h) both use DefaultThreadCount(). In order:
//     1. FORKSAFE_NUM_THREADS, when set and not empty: that number, whatever the CPUs (it wins;
//        OMP_NUM_THREADS is then not read at all).
//     2. OMP_NUM_THREADS, when set and not empty: the first number of its list ("8,2" -> 8), the
//        variable most launchers (torchrun, srun scripts, MPI wrappers) already set per process.
//        It belongs to the OpenMP runtime: a malformed value is ignored (as if unset) with one
//        warning on stderr per process, saying what was wrong and which count is used instead.
//     3. Otherwise the smaller of
//        - the CPUs of the process's affinity mask, read from its main thread
//          (sched_getaffinity(getpid()), sized for any number of CPUs): taskset, numactl,
//          srun --cpu-bind, mpirun --bind-to, docker --cpuset-cpus. Linux keeps one mask per
//          thread; launchers set it before the program starts and every thread inherits it, but
//          OpenMP and many frameworks then pin each of their worker threads to one CPU. The
//          calling thread's mask (sched_getaffinity(0)) made a pool created from such a worker
//          one thread wide; the main thread's is the one the launcher set. (In a forked child the
//          thread that forked is the main thread: its mask is the child's whole mask.)
//        - the cgroup CPU quota, rounded up to whole CPUs: cgroup v2 cpu.max or v1
//          cpu.cfs_quota_us / cpu.cfs_period_us of the process's cgroup and of every ancestor
//          (the most restrictive wins): docker --cpus, Kubernetes CPU limits, systemd CPUQuota.
//          Where the hierarchies are mounted is read from /proc/self/mountinfo.
//        and never less than 1. std::thread::hardware_concurrency() counts the machine's CPUs and
//        oversubscribes a process pinned to a few of them (the default before issue 14).
//     4. Under a launcher (runtime/launch_info.h) with several ranks on this node: at most this
//        rank's share of the node, max(1, node CPUs / ranks on the node), where the node's CPUs
//        are the machine's (or the cgroup quota, when smaller). Four ranks of mpirun -np 4 on
//        16 CPUs get 4 each, not 16 each, also when Open MPI bound each to a whole 8-CPU socket.
//        A rank that the launcher bound to fewer CPUs (srun --cpu-bind, mpirun --bind-to core)
//        keeps its mask's count. Not seen: a container cpuset narrower than the machine that all
//        the node's ranks share (it is counted as the machine): set FORKSAFE_NUM_THREADS there.
//        Launcher variables that GetLaunchInfo() refuses are ignored here, with one warning (a
//        pool must not fail over them; GetLaunchInfo() itself throws).
//
// Guarantees
//   - An override is a whole decimal number in [1, kMaxThreadOverride], blanks around it allowed;
//     OMP_NUM_THREADS is a comma-separated list of such numbers. A malformed FORKSAFE_NUM_THREADS
//     (0, "-2", "4x", "auto", a number past the bound) is an Error(kInvalidArgument) that names
//     the variable and its value and says what to set: a typo in our own variable never silently
//     becomes "one per CPU". A malformed OMP_NUM_THREADS is a warning, never an error: it is set
//     for another library, which may accept forms we do not, and a pool must not fail over it.
//     An empty value is the same as an unset variable.
//   - Computed anew on each call (one system call and a few small reads of /proc and /sys): the
//     pools call it once, when they are created, never per task; a mask changed later (by
//     sched_setaffinity, taskset -p) applies to pools created after the change.
//   - A cgroup file that is missing or malformed is skipped, never guessed; an affinity mask that
//     cannot be read falls back to hardware_concurrency().
//   - Thread-safe, except that reading the environment races with a setenv() on another thread
//     (the C library's rule for getenv).
//
// Hazards
//   - The quota is a rate, not a set of CPUs: 1.5 CPUs of quota count as 2 threads, which run
//     throttled 25% of each period when both are busy.
//   - A pool created before the process is pinned (a default pool made at start-up, then
//     taskset -p) keeps its size; size it explicitly or create it after pinning.
//   - A main thread that pinned itself (OMP_PROC_BIND / OMP_PLACES may bind OpenMP's initial
//     thread; `taskset -p` without -a changes only the thread it names) makes its own mask the
//     process's: set FORKSAFE_NUM_THREADS or size the pools explicitly.
#ifndef FORKSAFE_RUNTIME_CPU_BUDGET_H_
#define FORKSAFE_RUNTIME_CPU_BUDGET_H_

#include <string>

namespace forksafe::runtime {

/// The override that wins over everything else.
inline constexpr char kForksafeNumThreadsEnv[] = "FORKSAFE_NUM_THREADS";
/// OpenMP's variable; its first number is used when FORKSAFE_NUM_THREADS is not set (a malformed
/// one is ignored with a warning).
inline constexpr char kOmpNumThreadsEnv[] = "OMP_NUM_THREADS";
/// The largest thread count an override may ask for.
inline constexpr int kMaxThreadOverride = 65536;

/// What decided CpuBudget::cpus.
enum class CpuBudgetSource {
  kForksafeNumThreads,  ///< The FORKSAFE_NUM_THREADS variable.
  kOmpNumThreads,       ///< The first number of OMP_NUM_THREADS.
  kCgroupQuota,         ///< A cgroup CPU quota smaller than the affinity mask.
  kAffinity,            ///< The affinity mask (no quota, or a larger one).
  kHardware,            ///< hardware_concurrency(): the mask could not be read.
  kLauncherShare,       ///< This rank's share of the machine: the count / ranks on the node.
};

/// A stable name for `source` ("FORKSAFE_NUM_THREADS", "cgroup_quota", "affinity", ...).
const char* CpuBudgetSourceName(CpuBudgetSource source);

/// The answer of GetCpuBudget, with what it was made of.
struct CpuBudget {
  int cpus = 1;  ///< The thread count to use by default: >= 1.
  CpuBudgetSource source = CpuBudgetSource::kHardware;
  int affinity_cpus = 0;   ///< CPUs in the affinity mask; 0 when it could not be read.
  int quota_cpus = 0;      ///< The cgroup quota rounded up; 0 when there is none.
  std::string quota_file;  ///< The cgroup file that set quota_cpus ("" when none).
  int hardware_cpus = 0;   ///< std::thread::hardware_concurrency() (0 when unknown).
  int ranks_on_node = 1;   ///< The launcher's ranks on this node (1 without a launcher).
  /// Why a set OMP_NUM_THREADS was ignored ("" when it was not): the warning GetCpuBudget
  /// prints on stderr, once per process.
  std::string warning;
  /// "2 CPUs (affinity; mask 2, cgroup quota none, machine 64)", for logs.
  std::string ToString() const;
};

/// How many CPUs this process may use now, and why (see the banner). Throws
/// Error(kInvalidArgument) for a malformed FORKSAFE_NUM_THREADS, and only for that: a malformed
/// OMP_NUM_THREADS is ignored with a warning on stderr (once per process; also in
/// CpuBudget::warning).
CpuBudget GetCpuBudget();

/// GetCpuBudget().cpus: the default size of ThreadPool and mp::Pool. Throws
/// Error(kInvalidArgument) when FORKSAFE_NUM_THREADS is set to something other than a whole
/// number in [1, kMaxThreadOverride] (nothing else throws; OMP_NUM_THREADS never does).
int DefaultThreadCount();

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_CPU_BUDGET_H_
