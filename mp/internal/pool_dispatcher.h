// mp/internal/pool_dispatcher.h: NOT FOR USERS. The parent side of a Pool (mp/pool.h): the state
// its callers' threads share (the queue of chunks, the pool's phase, the local callables of
// "fork"), under one mutex, and the dispatcher thread that owns the workers.
//
// What it offers
//   PoolDispatcher: configured by Pool's constructor (mp/pool.cc), then Start() starts the first
//   workers and the dispatcher thread. Callers queue PoolChunks in `pending` (under `mu`) and
//   Wake() it. The dispatcher starts workers (forked with a WorkerSetup, or the registered entry
//   point of mp/internal/pool_worker.h), hands a chunk to a worker only when that worker is idle,
//   reads the replies, notices deaths (end-of-file at once, exit status every 50 ms while work is
//   out), starts replacements, and at close() stops the workers once nothing is left to run, at
//   terminate() kills them. Chunk outcomes go to their JobState (mp/internal/pool_job.h), and a
//   finished job's callback to the CallbackRunner.
//
// Guarantees
//   - `workers` and the rest of "the dispatcher's own" are touched by the dispatcher thread only
//     (and by the constructor's thread before Start() returns).
//   - mu is never held while a worker is forked or started, nor while a chunk is settled (a
//     job's lock, callbacks): outcomes are recorded after mu is released.
//   - Lock order: Intake::mu, then mu, then a JobState's own lock.
//   - A pool broken (initializer failure, repeated startup deaths) fails what is queued and
//     whatever is queued later with the same error (`broken`).
//
// Hazards
//   - Finish, FailChunk, CompleteChunk, Break, WaitDone take mu: never call them with it held.
//   - In a forked child nothing of this object is usable (its thread and workers are the
//     parent's): Pool checks the owner pid before every call.
#ifndef FORKSAFE_MP_INTERNAL_POOL_DISPATCHER_H_
#define FORKSAFE_MP_INTERNAL_POOL_DISPATCHER_H_

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/pool_call.h"
#include "forksafe/mp/internal/pool_job.h"
#include "forksafe/mp/internal/pool_messages.h"
#include "forksafe/mp/internal/shm_sync.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/start_method.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/thread_annotations.h"

namespace forksafe::mp::internal {

/// One chunk of a job, queued or held by a worker.
struct PoolChunk {
  std::shared_ptr<JobState> job;
  size_t index = 0;
  Message payload;
  std::shared_ptr<const TaskFn> fn;
  uint64_t min_generation = 0;  // fork: workers forked before this local callable cannot run it
  uint64_t task_id = 0;
  bool delivered = false;

  /// "map chunk 2 of 8 (items 10..19)".
  std::string Describe() const;
};

/// One worker process, as the dispatcher sees it.
struct PoolWorker {
  enum class State { kStarting, kIdle, kBusy, kRetiring };
  std::string name;
  std::unique_ptr<Process> proc;
  Connection conn;
  pid_t pid = 0;
  uint64_t generation = 0;
  State state = State::kStarting;
  std::optional<PoolChunk> held;
  int tasks_done = 0;
  bool eof = false;
  bool init_failed = false;
  Clock::time_point retire_deadline{};
  Clock::time_point ready_deadline{};
};

/// What a job's chunks run: its TaskFn, and the worker generation that can run it (fork: workers
/// forked before a local callable was registered cannot).
struct PoolTaskSpec {
  std::shared_ptr<const TaskFn> task;
  uint64_t min_generation = 0;
};

/// The parent side of a Pool. See the file comment.
class PoolDispatcher {
 public:
  enum class Phase { kRunning, kClosed, kTerminating };

  /// What open imap jobs submit through; `impl` is cleared when the Pool is destroyed, so that
  /// an iterator outliving its pool submits nothing more.
  struct Intake {
    runtime::internal::Mutex mu;
    PoolDispatcher* impl FORKSAFE_GUARDED_BY(mu) = nullptr;
  };

  PoolDispatcher() = default;
  PoolDispatcher(const PoolDispatcher&) = delete;
  PoolDispatcher& operator=(const PoolDispatcher&) = delete;

  // ---- set by Pool's constructor before Start(), constant after ----
  PoolOptions options;
  StartMethod method;  // resolved: never kDefault
  std::string name;
  int nproc = 1;
  pid_t owner = 0;
  std::string init_entry;  // spawn/forkserver initializer
  // Runs the jobs' callbacks (mp/internal/pool_job.h); shared with its thread.
  std::shared_ptr<CallbackRunner> callbacks;
  std::shared_ptr<Intake> intake = std::make_shared<Intake>();

  // ---- shared with the callers' threads, under mu ----
  mutable runtime::internal::Mutex mu;
  Phase phase FORKSAFE_GUARDED_BY(mu) = Phase::kRunning;
  bool dispatcher_done FORKSAFE_GUARDED_BY(mu) = false;
  std::deque<PoolChunk> pending FORKSAFE_GUARDED_BY(mu);
  std::map<uint64_t, std::shared_ptr<const LocalRunner>> locals FORKSAFE_GUARDED_BY(mu);
  uint64_t next_local_id FORKSAFE_GUARDED_BY(mu) = 0;
  std::exception_ptr broken FORKSAFE_GUARDED_BY(mu);  // set once: queued and later work fails
  std::vector<pid_t> pid_snapshot FORKSAFE_GUARDED_BY(mu);

  /// Opens the wake-up descriptor, starts `nproc` workers (killing those started when one
  /// fails, then rethrowing) and the dispatcher thread.
  void Start() FORKSAFE_LOCKS_EXCLUDED(mu);

  // ---- usable from any thread of the owner ----
  /// Throws kFailedPrecondition in a process other than the owner, naming `call`.
  void CheckOwner(const char* call) const;
  /// Wakes the dispatcher (new work, a phase change).
  void Wake();
  /// Throws kFailedPrecondition when the pool takes no new work, naming `what`.
  void CheckIntakeLocked(const char* what) const FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu);
  /// What a job's chunks run; registers the job's local callable (fork).
  PoolTaskSpec PrepareTaskLocked(FnSpec& fn, JobState& job) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu);
  /// Remembers a job for StartWorker (fork: the descriptors its results hold).
  void TrackJobLocked(const std::shared_ptr<JobState>& job) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu);
  /// A chunk's outcome was recorded; `last`: it was the job's last outstanding one. Forgets the
  /// job's local callable once it is finished and posts its callback.
  void Finish(const std::shared_ptr<JobState>& job, bool last) FORKSAFE_LOCKS_EXCLUDED(mu);
  /// Posts the job's callback if the job is finished (once).
  void PostCallbackIfFinished(const std::shared_ptr<JobState>& job) FORKSAFE_LOCKS_EXCLUDED(mu);
  void FailChunk(PoolChunk& c, std::exception_ptr e) FORKSAFE_LOCKS_EXCLUDED(mu);
  void CompleteChunk(PoolChunk& c, Message m) FORKSAFE_LOCKS_EXCLUDED(mu);
  /// Waits at most until `deadline` for the dispatcher thread to end, and joins it.
  bool WaitDone(Deadline deadline) FORKSAFE_LOCKS_EXCLUDED(mu);

 private:
  void PruneJobsLocked() FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Marks the pool broken (first error wins) and fails everything queued.
  void Break(std::exception_ptr e) FORKSAFE_LOCKS_EXCLUDED(mu);
  bool HasPending() FORKSAFE_LOCKS_EXCLUDED(mu);
  void UpdatePids() FORKSAFE_LOCKS_EXCLUDED(mu);

  // ---- the dispatcher thread ----
  void Loop();
  void StartWorker() FORKSAFE_LOCKS_EXCLUDED(mu);
  static void KillAndReap(PoolWorker& w, std::chrono::duration<double> grace, int sig);
  void Drain(PoolWorker& w);
  void Handle(PoolWorker& w, Message& m);
  void Settle(PoolWorker& w);
  void CheckWorkers();
  void StartWorkers(Phase ph);
  void AssignWork() FORKSAFE_LOCKS_EXCLUDED(mu);
  bool Drained();
  void Poll();
  void KillAll(const std::string& why);
  void StopAll();
  void FailQueuedIfBroken() FORKSAFE_LOCKS_EXCLUDED(mu);

  runtime::internal::CondVar done_cv_;  // dispatcher_done became true
  uint64_t next_task_id_ FORKSAFE_GUARDED_BY(mu) = 0;
  // Jobs whose results may hold descriptors a forked worker must not inherit (pruned as they go).
  std::vector<std::weak_ptr<JobState>> live_jobs_ FORKSAFE_GUARDED_BY(mu);  // "fork" only
  size_t prune_jobs_at_ FORKSAFE_GUARDED_BY(mu) = 64;

  runtime::internal::Mutex join_mu_;  // serializes joining the dispatcher thread
  std::thread dispatcher_ FORKSAFE_GUARDED_BY(join_mu_);
  FileDescriptor wake_fd_;  // set by Start(), before any other thread sees it

  // The dispatcher's own (and Start()'s, before the dispatcher thread starts).
  std::list<PoolWorker> workers_;
  int startup_failures_ = 0;
  int start_errors_ = 0;
  Clock::time_point next_start_attempt_{};
  Clock::time_point next_liveness_{};
};

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_POOL_DISPATCHER_H_
