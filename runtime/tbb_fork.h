// runtime/tbb_fork.h: keeps oneTBB usable across fork().
//
// What it offers
//   oneTBB registers no at-fork handlers of its own, and its worker threads do not exist in a
//   forked child, so a child that calls tbb::parallel_for after a fork may hang. forksafe installs
//   one at-fork handler that, after the runtime's own pools drained, joins oneTBB's workers with
//   `tbb::finalize(handle, std::nothrow)` on a `task_scheduler_handle` attached for that purpose.
//   oneTBB then starts fresh workers on next use, in both processes. (DESIGN.md suggested
//   re-attaching in parent and child; forksafe attaches lazily at the next prepare instead, which
//   keeps allocations out of the post-fork path, where each written page costs a copy-on-write
//   fault.)
//
// Guarantees
//   - Installed once per process; every ThreadPool installs it before registering itself, so the
//     pools are drained before oneTBB is finalized (prepare runs in reverse registration order).
//   - If finalize fails (another thread is inside a parallel algorithm, or the fork comes from
//     inside a oneTBB task), prepare says "not yet" and the registry retries with back-off. After
//     the last attempt the fork proceeds, ForkEventKind::kSubsystemUnusable is reported, and
//     TbbUsableInThisProcess() is false in that child: it must not call oneTBB.
//
// Hazard: threads outside forksafe that use oneTBB
//   oneTBB's finalize succeeds only when no other thread holds a reference to its scheduler, and
//   every thread that ran a oneTBB algorithm keeps one until it exits (measured with oneTBB
//   2021.8: a std::thread that loops over parallel_reduce made 299 of 300 forks give up). Run
//   oneTBB algorithms from forksafe pool workers (ThreadPool::Submit) or from the thread that
//   forks: the pool's drain joins its workers, which drops their references, so oneTBB is
//   quiesced on every fork (300 of 300 in tests/device/fork_storm_test).
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
// Hazard: a child hung in tbbmalloc (made rarer, not removed)
//   Rarely, a child forked while oneTBB was busy spins forever in its first parallel algorithm,
//   inside scalable_aligned_malloc (libtbbmalloc): a tbbmalloc lock was held at the fork. The
//   likeliest holder is a oneTBB worker that finalize() did not wait for (one still starting or
//   leaving, returning its caches to tbbmalloc). When the number of threads changed across
//   finalize, prepare waits until it has been still for 0.3 ms (at most 20 ms): in runs of 1,000
//   forks under busy pools (tests/soak/fork_soak_test) 2 of 9 hung before, 3 of 131 after. A fork
//   with oneTBB idle pays two reads of /proc/self/task (about 10 us).
#ifndef FORKSAFE_RUNTIME_TBB_FORK_H_
#define FORKSAFE_RUNTIME_TBB_FORK_H_

#include <cstdint>

namespace forksafe::runtime {

/// Registers the oneTBB at-fork handler if it is not yet registered. Idempotent, thread-safe.
void InstallTbbForkHandler();

/// False in a child forked while oneTBB's workers could not be joined.
bool TbbUsableInThisProcess();

/// Counters, for tests and diagnostics.
struct TbbForkStats {
  uint64_t finalized = 0;        ///< Forks before which oneTBB's workers were joined.
  uint64_t finalize_refused = 0; ///< Attempts at which finalize reported busy workers.
  uint64_t gave_up = 0;          ///< Forks that went ahead with oneTBB workers alive.
};
TbbForkStats GetTbbForkStats();

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_TBB_FORK_H_
