// runtime/internal/nested_copy.h: NOT FOR USERS. The parts of the at-fork registry that deal with
// other copies of forksafe in the process (runtime/at_fork.h, "One registry per process, even
// with several copies of forksafe"; the ABI is runtime/internal/process_instance.h), shared by
// runtime/at_fork.cc and runtime/internal/nested_copy.cc. Everything here is hidden: each copy
// calls its own.
//
// Guarantees
//   - A primary accepts at most kMaxNestedCopies copies; slots are claimed with an atomic
//     fetch_add (two copies may nest at once), filled once and never emptied (copies pin their
//     objects). A reader skips a slot not filled yet.
//   - None of the functions below throws.
#ifndef FORKSAFE_RUNTIME_INTERNAL_NESTED_COPY_H_
#define FORKSAFE_RUNTIME_INTERNAL_NESTED_COPY_H_

#include <chrono>
#include <cstdint>
#include <functional>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/internal/process_instance.h"

#pragma GCC visibility push(hidden)
namespace forksafe::runtime::internal {

constexpr int kMaxNestedCopies = 16;

// ---- The primary's side (defined in nested_copy.cc) --------------------------------------------

/// The copies nested in this one when a fork starts: the same ones get `entering` and `entered`.
struct NestedCopies {
  const forksafe_nested_v1* copies[kMaxNestedCopies];
  int count = 0;
};
NestedCopies CurrentNestedCopies() noexcept;
void RunNestedEntering(const NestedCopies& nested) noexcept;
void RunNestedEntered(const NestedCopies& nested) noexcept;
/// After the primary took its own framework lock: each nested copy takes its own, waiting at most
/// until `deadline`.
void LockNestedFrameworks(std::chrono::steady_clock::time_point deadline) noexcept;
/// In the parent, after the primary released its registry.
void RunNestedParentDone() noexcept;

/// Joins the primary's registry (this copy's constructor); false when it cannot (this copy is
/// then marked SEPARATE and says so on stderr).
bool NestInPrimary(const forksafe_instance_v1& primary) noexcept;

// ---- This copy's registry internals (defined in at_fork.cc) ------------------------------------

/// This copy's registry (not AtForkRegistry::Get(), which another copy could interpose).
AtForkRegistry& ThisRegistry() noexcept;
/// Sets the thread's "running this copy's at-fork handlers" flag (InForkHandler()).
void SetInForkHandler(bool in) noexcept;
/// True while this copy's registry runs parent callbacks to undo a prepare.
bool RollingBack() noexcept;
/// This copy's own fork-entry hooks (runtime/internal/fork_entry.h).
void RunThisCopysEntering() noexcept;
void RunThisCopysEntered() noexcept;
/// Calls `listener` with `report` unless either is empty or the report is clean; swallows what
/// it throws.
void CallListener(const std::function<void(const ForkReport&)>& listener,
                  const ForkReport& report) noexcept;

inline int64_t ToNs(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
inline std::chrono::steady_clock::time_point FromNs(int64_t ns) {
  return std::chrono::steady_clock::time_point(
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::nanoseconds(ns)));
}

}  // namespace forksafe::runtime::internal
#pragma GCC visibility pop

#endif  // FORKSAFE_RUNTIME_INTERNAL_NESTED_COPY_H_
