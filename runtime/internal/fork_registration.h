// runtime/internal/fork_registration.h: NOT FOR USERS. The pthread_atfork registrations that run
// the at-fork registry (runtime/at_fork.h), and how forksafe moves itself in front of a library
// that registered its own handlers after it (an OpenMP runtime: runtime/openmp_fork.h).
//
// Why it exists
//   glibc runs prepare handlers in reverse registration order: a library that registers its own
//   pthread_atfork handlers after forksafe (LLVM's libomp does at its first use) is prepared
//   BEFORE forksafe's registry. libomp's prepare takes its fork/join and init locks; a forksafe
//   pool drain that then waits for a task in an OpenMP region waited for a thread that waits for
//   those locks, until the fork's deadline (3 s per fork). The cure is a registration made after
//   the library's: RenewForkRegistration() registers the registry's callbacks once more, at the
//   end of glibc's list, so that forksafe is prepared first and finishes last around the fork.
//
// Guarantees
//   - Every registration calls the same registry, and exactly one of them acts per fork: the
//     newest registration whose prepare runs in that fork acts in prepare (glibc calls it first)
//     and in parent and child (glibc calls it last), the others return at once. So the registry
//     is prepared once and finished once per fork, outermost around every handler registered
//     before that registration, as one registration would be.
//   - A registration made while a fork runs (from its prepare, or on another thread) takes part
//     from the next fork on (glibc >= 2.36 skips it, in all three phases, for the fork running).
//   - Bounded: at most kMaxForkRegistrations registrations per process; a further renewal is
//     refused (returns 0). Forked children inherit the registrations.
//   - RenewForkRegistration may be called from inside a prepare callback only on glibc >= 2.36,
//     which releases its at-fork list lock while a handler runs; on an older glibc it refuses
//     there (returns 0) instead of deadlocking.
//
// Hazards
//   - Only the copy of forksafe that makes the process's registration (the primary, or a copy
//     that runs separately) has registrations; in a nested copy RenewForkRegistration returns 0.
#ifndef FORKSAFE_RUNTIME_INTERNAL_FORK_REGISTRATION_H_
#define FORKSAFE_RUNTIME_INTERNAL_FORK_REGISTRATION_H_

namespace forksafe::runtime::internal {

using ForkCallback = void (*)();

/// The most registrations one process makes (the first one and its renewals).
constexpr int kMaxForkRegistrations = 8;

/// Makes the first registration of the registry's callbacks (called once, by the registry's
/// constructor). Returns pthread_atfork's result (0, or an errno value).
int RegisterForkCallbacks(ForkCallback prepare, ForkCallback parent, ForkCallback child);

/// Registers the callbacks again, after every pthread_atfork handler registered so far. Returns
/// the new registration's number (1, 2, ...), or 0 when refused (see Guarantees). Thread-safe.
int RenewForkRegistration();

/// On the forking thread during a fork (in its prepare, parent or child phase): the number of
/// the registration that runs it (0: the first). -1 on other threads and outside forks.
int ActingForkRegistration();

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_FORK_REGISTRATION_H_
