// runtime/internal/cpu_budget_parts.h: NOT FOR USERS. The pieces of GetCpuBudget
// (runtime/cpu_budget.h), separated so that tests can feed them made-up inputs.
#ifndef FORKSAFE_RUNTIME_INTERNAL_CPU_BUDGET_PARTS_H_
#define FORKSAFE_RUNTIME_INTERNAL_CPU_BUDGET_PARTS_H_

#include "forksafe/runtime/cpu_budget.h"
#include "forksafe/runtime/internal/cgroup.h"

namespace forksafe::runtime::internal {

/// The thread count an override variable asks for: 0 when `value` is null, empty or blank;
/// otherwise a number in [1, kMaxThreadOverride] (for `list` variables, the first of a
/// comma-separated list, each of whose items must be such a number). Throws
/// Error(kInvalidArgument) naming `name` and `value` for anything else.
int ParseThreadOverride(const char* name, const char* value, bool list);

/// The CPUs of the calling thread's affinity mask (a CPU_ALLOC'ed set, grown until the kernel's
/// mask fits); 0 when it cannot be read.
int AffinityCpuCount();

/// What GetCpuBudget reads, for tests.
struct CpuBudgetInputs {
  const char* forksafe_num_threads = nullptr;  ///< The variable's value (null: unset).
  const char* omp_num_threads = nullptr;
  int affinity_cpus = 0;  ///< 0: unknown.
  CpuQuota quota;
  int hardware_cpus = 0;  ///< 0: unknown.
};

/// GetCpuBudget's rules applied to `in`. Throws as GetCpuBudget.
CpuBudget ComputeCpuBudget(const CpuBudgetInputs& in);

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_CPU_BUDGET_PARTS_H_
