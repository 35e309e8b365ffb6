// runtime/internal/process_liveness.h: NOT FOR USERS. The one answer to "has this process
// exited?", for every place that holds something on behalf of another process (device memory and
// IPC handles, /dev/shm segments, servers that watch their clients).
//
// What it offers
//   - ProcessExited(pid): true once `pid` has exited.
//
// Guarantees (the rule, the same everywhere)
//   - ESRCH from kill(pid, 0): exited (gone and reaped).
//   - A zombie (state Z or X in /proc/<pid>/stat): exited. It runs no more code and has already
//     released its memory, mappings and descriptors; its pid cannot be reused until its parent
//     reaps it, so the answer cannot be about another process.
//   - EPERM from kill(pid, 0): the process exists but belongs to another user; it is alive unless
//     /proc shows it a zombie.
//   - pid <= 0: never a process; ProcessExited returns false (callers treat 0 as "no owner").
//   - Thread safety: may be called from any thread; one system call plus one small /proc read.
#ifndef FORKSAFE_RUNTIME_INTERNAL_PROCESS_LIVENESS_H_
#define FORKSAFE_RUNTIME_INTERNAL_PROCESS_LIVENESS_H_

#include <sys/types.h>

namespace forksafe::runtime::internal {

/// True once `pid` has exited, by the rule in the banner (zombies have exited; EPERM is alive).
bool ProcessExited(pid_t pid);

/// !ProcessExited(pid) for pid > 0; false for pid <= 0.
inline bool ProcessAlive(pid_t pid) { return pid > 0 && !ProcessExited(pid); }

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_PROCESS_LIVENESS_H_
