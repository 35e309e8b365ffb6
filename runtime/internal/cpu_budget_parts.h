// runtime/internal/cpu_budget_parts.h: NOT FOR USERS. The pieces of GetCpuBudget
// (runtime/cpu_budget.h), separated so that tests can feed them made-up inputs.
#ifndef FORKSAFE_RUNTIME_INTERNAL_CPU_BUDGET_PARTS_H_
#define FORKSAFE_RUNTIME_INTERNAL_CPU_BUDGET_PARTS_H_

#include "forksafe/runtime/cpu_budget.h"
#include "forksafe/runtime/internal/cgroup.h"

namespace forksafe::runtime::internal {

/// The thread count `value` asks for: 0 when it is null, empty or blank; -1 when it is malformed;
/// otherwise a number in [1, kMaxThreadOverride] (for a `list`, the first of a comma-separated
/// list, each of whose items must be such a number). Never throws.
int ParseThreadCountValue(const char* value, bool list);

/// ParseThreadCountValue, but a malformed value throws Error(kInvalidArgument) naming `name` and
/// `value` and saying what to set (for FORKSAFE_NUM_THREADS, ours).
int ParseThreadOverride(const char* name, const char* value, bool list);

/// The CPUs of the process's affinity mask, read from its main thread (sched_getaffinity(getpid()),
/// a CPU_ALLOC'ed set grown until the kernel's mask fits), whichever thread calls; 0 when it cannot
/// be read. See runtime/cpu_budget.h for why the main thread's.
int AffinityCpuCount();

/// What GetCpuBudget reads, for tests.
struct CpuBudgetInputs {
  const char* forksafe_num_threads = nullptr;  ///< The variable's value (null: unset).
  const char* omp_num_threads = nullptr;
  int affinity_cpus = 0;  ///< 0: unknown.
  CpuQuota quota;
  int hardware_cpus = 0;  ///< 0: unknown.
  /// The job's ranks on this node (LaunchInfo::local_world_size; 1 without a launcher).
  int ranks_on_node = 1;
};

/// GetCpuBudget's rules applied to `in`: a malformed OMP_NUM_THREADS fills CpuBudget::warning
/// (printing it is GetCpuBudget's job). Throws as GetCpuBudget.
CpuBudget ComputeCpuBudget(const CpuBudgetInputs& in);

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_CPU_BUDGET_PARTS_H_
