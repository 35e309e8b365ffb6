// runtime/tbb_fork.h: keeps oneTBB usable across fork().
//
// What it offers
//   oneTBB registers no at-fork handlers of its own, and its worker threads do not exist in a
//   forked child, so a child that calls tbb::parallel_for after a fork may hang. forksafe installs
//   one at-fork handler that, after the runtime's own pools drained, joins oneTBB's workers with
//   `tbb::finalize(handle, std::nothrow)` on a `task_scheduler_handle` that it holds for that
//   purpose. oneTBB then starts fresh workers on next use, in both processes.
//
// Guarantees
//   - Installed once per process, at load time; every ThreadPool also installs it before
//     registering itself, so the pools are drained before oneTBB is finalized (prepare runs in
//     reverse registration order).
//   - The handle is held from load time on and attached again inside prepare right after
//     finalize, before the kernel's fork, so parent and child both hold it and no page is written
//     after the fork for it. Holding it means oneTBB's scheduler is only ever shut down by this
//     handler's blocking finalize, which joins every worker: oneTBB never shuts its workers down
//     detached (see "Hazard: detached workers" below).
//   - Skipped when idle: when the forking thread is the process's only thread, or the fork is
//     quiet (its other threads are pool workers and a device thread parked for it, which hold
//     no oneTBB state: PrepareAttempt::alone either way, and a oneTBB worker is a thread nobody
//     parks, so none exists), and it has not run a oneTBB algorithm since the last finalize,
//     prepare neither finalizes nor takes its lock: oneTBB then has no worker to join and nothing
//     inside it, and the child inherits it as the parent has it (attached, no workers). This keeps
//     a process that never used oneTBB from paying for it on every fork: finalize + attach wrote
//     about six pages of oneTBB and tbbmalloc, each a copy-on-write page fault per fork (issue
//     19; docs/performance.md, "Idle fork"). Any other thread (a pool worker, a oneTBB worker, a
//     thread of the program) or a forking thread that ran oneTBB (it may be inside a task) gives
//     the full protocol below. Not skipped while the handle is released (ReleaseTbbScheduler).
//   - If finalize fails (another thread is inside a parallel algorithm, or the fork comes from
//     inside a oneTBB task), prepare says "not yet" and the registry retries with back-off. After
//     the last attempt the fork proceeds, ForkEventKind::kSubsystemUnusable is reported, and
//     TbbUsableInThisProcess() is false in that child: it must not call oneTBB.
//
// Hazard: a prepare callback that starts a thread
//   "Alone" is counted as each prepare round begins. A thread started by a prepare callback that
//   runs before this one (one registered later) and that makes its first oneTBB call before the
//   fork would find oneTBB unquiesced. Prepare callbacks must not start threads
//   (runtime/at_fork.h).
//
// Hazard: threads outside forksafe that use oneTBB
//   oneTBB's finalize succeeds only when no other thread holds a reference to its scheduler, and
//   every thread that ran a oneTBB algorithm keeps one until it exits (measured with oneTBB
//   2021.8: a std::thread that loops over parallel_reduce made 299 of 300 forks give up). Run
//   oneTBB algorithms from forksafe pool workers (ThreadPool::Submit) or from the thread that
//   forks: the pool's drain parks its workers, and a parking worker that ran oneTBB first drops
//   its thread state (its reference), so oneTBB is quiesced on every fork (300 of 300 in
//   tests/device/fork_storm_test).
//
// Hazard: a thread outside forksafe that *starts* using oneTBB during a fork
//   finalize() runs in prepare; fork() happens a moment later. A foreign thread that makes its
//   first oneTBB call in that window initializes oneTBB's scheduler concurrently with the fork,
//   and the child can inherit oneTBB's internal spin locks held: its first parallel algorithm
//   then spins forever. forksafe cannot see that window (oneTBB has no fork hooks and no public
//   "is initializing" query). A foreign thread that is already inside oneTBB is safe: finalize
//   is refused and the child is told TbbUsableInThisProcess()==false. Found by CI: a test that
//   forked right after starting such a thread hung 14 times in 40 runs; it now waits until the
//   thread's first algorithm finished (tests/runtime/tbb_fork_test.cc).
//
// Hazard: detached workers (the cause of a child hung in tbbmalloc; fixed)
//   oneTBB joins its workers only when a blocking finalize drops the last reference to its
//   scheduler. When the last reference goes away with a thread that exits (a pool worker that ran
//   an algorithm and ended; until issue 19 the pool's drain ended its workers), oneTBB shuts its
//   workers down detached: they
//   exit by themselves a moment later, returning their caches to tbbmalloc under tbbmalloc's
//   locks. Until 2026-11-22 the handle was attached only inside prepare, after the pools had
//   drained, so that happened on most forks; a fork in that moment handed the child a held
//   tbbmalloc lock (about 1 fork in 40,000 in tests/soak/fork_soak_test hung in
//   scalable_aligned_malloc). Holding the handle removes the case.
//
// Hazard: your own tbb::finalize
//   oneTBB's finalize succeeds only for the last lifetime handle. While forksafe holds its own,
//   a program's tbb::finalize(handle) is refused (the throwing overload throws
//   tbb::unsafe_wait), and while a program holds one, forksafe's prepare is refused and the child
//   loses oneTBB. A program that wants to join oneTBB's workers itself (at exit, say) calls
//   ReleaseTbbScheduler() first and finalizes right after, with no fork in between.
#ifndef FORKSAFE_RUNTIME_TBB_FORK_H_
#define FORKSAFE_RUNTIME_TBB_FORK_H_

#include <cstdint>

namespace forksafe::runtime {

/// Registers the oneTBB at-fork handler if it is not yet registered. Idempotent, thread-safe.
void InstallTbbForkHandler();

/// Drops forksafe's hold on oneTBB's scheduler, so that the program's own
/// tbb::finalize(handle) can join oneTBB's workers. The next fork holds it again (and then waits
/// up to 20 ms for workers oneTBB may have shut down detached meanwhile). Thread-safe; must not
/// be called from an at-fork handler (prepare holds the lock it takes).
void ReleaseTbbScheduler();

/// False in a child forked while oneTBB's workers could not be joined.
bool TbbUsableInThisProcess();

/// Whether the calling thread has run a oneTBB algorithm and still holds oneTBB thread state (a
/// reference to oneTBB's scheduler that only the thread's end, or ReleaseTbbThreadState, drops).
/// A thread-local read; never starts oneTBB.
bool ThreadHoldsTbbState();

/// Drops the calling thread's oneTBB thread state, as the thread's end would, so that a fork's
/// finalize of oneTBB does not wait for it: for long-lived threads that park idle across forks
/// (pool workers, a device thread). The thread's next oneTBB algorithm sets it up again. Takes
/// oneTBB's and tbbmalloc's locks: call it holding no lock, never from an at-fork handler.
void ReleaseTbbThreadState();

/// Counters, for tests and diagnostics.
struct TbbForkStats {
  uint64_t finalized = 0;         ///< Forks before which oneTBB's workers were joined.
  uint64_t finalize_refused = 0;  ///< Attempts at which finalize reported busy workers.
  uint64_t gave_up = 0;           ///< Forks that went ahead with oneTBB workers alive.
};
TbbForkStats GetTbbForkStats();

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_TBB_FORK_H_
