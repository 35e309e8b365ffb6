// runtime/internal/openmp_fork_bypass.h: NOT FOR USERS. Lets a test show what a fork does to
// OpenMP without forksafe, in the same process: while bypassed, the "openmp" handler's prepare
// does nothing (no pause, no check), so a libgomp child hangs in its first region.
//
// Hazard: toggle it only when no other thread can fork.
#ifndef FORKSAFE_RUNTIME_INTERNAL_OPENMP_FORK_BYPASS_H_
#define FORKSAFE_RUNTIME_INTERNAL_OPENMP_FORK_BYPASS_H_

namespace forksafe::runtime::internal {

/// Turns the bypass on or off.
void SetOpenMpForkBypassForTest(bool bypass);

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_OPENMP_FORK_BYPASS_H_
