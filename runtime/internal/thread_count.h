// runtime/internal/thread_count.h: NOT FOR USERS. How many threads this process has, read from
// /proc/self/task: the one counter of threads for the fork handlers (the "alone" and "quiet" rules
// of runtime/at_fork.h, oneTBB's wait for detached workers in runtime/tbb_fork.cc).
//
// What it offers
//   - ListedThreads(): the entries of /proc/self/task, read with getdents64 into a stack buffer.
//   - ThreadCountIs(n): whether the process has exactly `n` threads, from one stat() of
//     /proc/self/task (Linux gives it a link count of 2 + the number of threads).
//
// Guarantees
//   - No allocation, no lock: callable from at-fork handlers.
//   - ThreadCountIs trusts the link count only after it agreed once with a listing of the
//     directory; a procfs whose link count disagrees three times (an emulation that does not
//     count threads there) makes ThreadCountIs false for the rest of the process (callers then
//     take their full protocol), and so does a process without /proc.
//
// Hazards
//   - A count is a snapshot: it stays true only while no thread that could start or end one
//     runs. The callers' rules (runtime/at_fork.h, PrepareAttempt::alone) say when that holds.
#ifndef FORKSAFE_RUNTIME_INTERNAL_THREAD_COUNT_H_
#define FORKSAFE_RUNTIME_INTERNAL_THREAD_COUNT_H_

namespace forksafe::runtime::internal {

/// Threads of this process, by listing /proc/self/task; stops counting once it reaches `limit`
/// (0: no limit). -1 when /proc cannot be read.
int ListedThreads(int limit = 0);

/// Whether this process has exactly `n` threads (n >= 1), from the link count of /proc/self/task
/// (see Guarantees). About 2 us.
bool ThreadCountIs(int n);

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_THREAD_COUNT_H_
