// runtime/internal/fork_entry.h: NOT FOR USERS. Lets the thread pools know which of their workers
// are inside fork(), waiting for another thread's fork to finish.
//
// glibc runs pthread_atfork prepare callbacks of concurrent forks at the same time; the registry
// serializes them. A pool whose worker waits there cannot have that worker finish its task before
// the fork in progress: its drain must not wait for it (two tasks that fork at once would
// otherwise each wait the whole drain deadline for the other).
//
// Guarantees: `entering` runs on a forking thread before it may wait for another fork, `entered`
// once it owns the fork (with the registry lock held), in that order, once each per fork.
#ifndef FORKSAFE_RUNTIME_INTERNAL_FORK_ENTRY_H_
#define FORKSAFE_RUNTIME_INTERNAL_FORK_ENTRY_H_

namespace forksafe::runtime::internal {

/// Installs the two callbacks (plain functions: they must not throw). Called once, by the pools.
void SetForkEntryHooks(void (*entering)(), void (*entered)());

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_FORK_ENTRY_H_
