// mp/internal/pool_worker.h: NOT FOR USERS. The worker side of a Pool (mp/pool.h): the loop a
// worker process runs, forked (its setup copied from the parent) or spawned (the registered entry
// point ForksafePoolWorkerMain).
//
// What it offers
//   RunWorker(conn, setup): runs the initializer, says "ready", then receives tasks on `conn`,
//   runs each chunk and replies with its results or its failure (the messages of
//   mp/internal/pool_messages.h), until "exit", end-of-stream, or maxtasks tasks.
//   WorkerSetup: what a worker needs, copied in the parent before a fork (the local callables,
//   the descriptors to close). AddInherited(): records a descriptor to close in a forked worker.
//
// Guarantees
//   - A task's exception, a result that cannot be sent and a malformed message are reported to
//     the pool (kinds "error", "malformed"); the worker never throws out of RunWorker.
//   - A forked worker closes the parent's end of its channel and the descriptors recorded in
//     close_inherited that are still the same file (device and inode), so that it keeps no other
//     task's Connection, no other worker's channel, open.
//   - Address tasks (kAddress) and local callables run only in forked workers; spawned ones find
//     their function through the entry-point registry (mp/internal/pool_runners.h).
//
// Hazards
//   - RunWorker runs in a forked child: it must take no lock another thread of the parent may
//     have held at the fork (the setup is copied before the fork for that reason).
#ifndef FORKSAFE_MP_INTERNAL_POOL_WORKER_H_
#define FORKSAFE_MP_INTERNAL_POOL_WORKER_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/pool_call.h"

namespace forksafe::mp::internal {

/// What a worker runs with. See the file comment.
struct WorkerSetup {
  bool forked = false;
  int maxtasks = 0;
  std::function<void()> initializer;  // fork
  std::string init_entry;             // spawn/forkserver: args arrive on the connection
  std::map<uint64_t, std::shared_ptr<const LocalRunner>> locals;  // fork
  int close_fd = -1;  // fork: the parent's end, inherited
  // fork: descriptors of other tasks' inputs that were waiting in the parent at the fork; the
  // worker closes each one that is still the same file (device and inode), so that it does not
  // keep a task's Connection open (its reader would never see end-of-file).
  struct InheritedFd {
    int fd;
    dev_t dev;
    ino_t ino;
  };
  std::vector<InheritedFd> close_inherited;
};

/// Records `fd` (and the file it is) to be closed in a forked worker; ignores fd < 0 and
/// descriptors that cannot be inspected.
void AddInherited(std::vector<WorkerSetup::InheritedFd>* out, int fd);

/// The worker's loop (see the file comment). Returns when the worker should exit.
void RunWorker(Connection conn, const WorkerSetup& s);

/// The entry point of spawn/forkserver workers (registered with FORKSAFE_ENTRY_POINT).
void ForksafePoolWorkerMain(Connection conn, int32_t maxtasks, std::string init_entry);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_POOL_WORKER_H_
