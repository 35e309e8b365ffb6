// runtime/internal/at_fork_bypass.h: NOT FOR USERS. Lets a benchmark measure a bare fork() in
// the same process, by making the registry's pthread_atfork callbacks return at once.
//
// Hazard: while bypassed, no subsystem is quiesced; a fork then is exactly as unsafe as without
// forksafe. Toggle it only when no other thread can fork.
#ifndef FORKSAFE_RUNTIME_INTERNAL_AT_FORK_BYPASS_H_
#define FORKSAFE_RUNTIME_INTERNAL_AT_FORK_BYPASS_H_

namespace forksafe::runtime::internal {

/// Turns the bypass on or off.
void SetAtForkBypassForBenchmark(bool bypass);

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_AT_FORK_BYPASS_H_
