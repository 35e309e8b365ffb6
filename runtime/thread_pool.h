// runtime/thread_pool.h: the runtime's task pool, quiesced around every fork.
//
// What it offers
//   ThreadPool runs tasks on worker threads: Submit() returns a std::future, Post() is
//   fire-and-forget, TaskGroup waits for a set of tasks, ParallelFor splits a range. Workers start
//   lazily on first use. ThreadPool::Default() is a process-wide pool.
//
// Fork behaviour (each pool registers itself with the at-fork registry)
//   prepare: stop intake (queued tasks stay queued) and wait, within
//            ThreadPoolOptions::drain_deadline (and the fork's own prepare deadline), until every
//            worker is PARKED: waiting on the pool's condition variable with no task and no lock
//            held. An idle worker is parked already (it is not even woken); a busy one parks when
//            its task ends; a ParallelFor helper that is a worker's outermost task parks between
//            two chunks, so a fork waits for at most one grain of a ParallelFor per worker (the
//            rest of the loop resumes after the fork; its calling thread goes on meanwhile).
//            Workers stay alive across the fork: none is joined or started again, so no thread
//            ends at a fork and no thread_local destructor (tbbmalloc's, which takes that
//            allocator's locks) can be cut in half by it. A worker that has run oneTBB drops its
//            oneTBB thread state before it counts as parked (an idle one is woken for that), as
//            its end used to: oneTBB's prepare, after the pools', can only finalize oneTBB when
//            no live thread holds such state (runtime/tbb_fork.h). Not waited
//            for: a fork issued from one of this pool's own workers (it does not wait for
//            itself), workers that are themselves inside fork() waiting for this fork (two tasks
//            that fork at once never wait for each other), and tasks that a thread other than a
//            worker runs for itself (TaskGroup::Wait, ParallelFor and TryRunOne run queued tasks
//            on the calling thread, also while the pool is paused: a thread that holds a lock a
//            prepare wants never waits for workers the fork has stopped; a ParallelFor's caller
//            does not wait for helpers parked by the fork either). If a worker's task
//            outlives the deadline the fork still proceeds and
//            ForkEventKind::kDrainDeadlineExceeded is reported (before the deadline, prepare
//            says "not yet" so the registry can roll back other subsystems that the task may be
//            waiting for; a rolled-back attempt lets the parked workers go on). Once drained,
//            the pool reports its parked workers to the registry (NoteThreadsParkedForFork):
//            when they and other such threads are all the process has besides the forking
//            thread, the fork is quiet and the handlers prepared after the pools skip their
//            locks and oneTBB's finalize (runtime/at_fork.h, PrepareAttempt::alone).
//   parent:  intake resumes; the parked workers (and parked ParallelFor helpers) go on.
//   child:   the inherited state (queue, mutexes, thread objects) is abandoned untouched; the pool
//            is rebuilt empty on first use. Tasks queued in the parent never run in the child.
//            A pool that lives on the stack of a thread other than the forking one is forgotten
//            by the child's registry after this callback (its memory is reused there).

// Guarantees
//   - All methods are thread-safe. Tasks run at most once, in FIFO order of submission per pool.
//   - An exception thrown by a Submit() task reaches its future; one thrown by a Post() task is
//     counted in stats().task_exceptions and otherwise dropped.
//   - TaskGroup::Wait and ParallelFor called from a worker help run queued tasks instead of
//     blocking, so nested parallelism does not deadlock.
//   - A ParallelFor helper parks for a fork only between two chunks (never inside the body) and
//     only when it is a worker's outermost task. A helper that runs nested inside another task
//     (picked up by TaskGroup::Wait, ParallelFor or TryRunOne on a worker) never parks mid-loop:
//     the frames below it may hold the caller's locks, so the fork waits for that whole outer
//     task, as for any other task.
//
// Hazards
//   - Wait() from one of the pool's own workers would wait for itself: it throws
//     kFailedPrecondition. Destroying a pool from one of its own workers is undefined.
//   - A fork waits for a whole task, not one grain, when the task is not a ParallelFor helper or
//     runs one nested (Guarantees): a long task, or a long ParallelFor run from inside a task,
//     makes every fork wait for it (up to drain_deadline).
//   - A child forked from inside a task keeps running that task; when the task returns, its
//     thread ends (and with it the child, if no other thread was started). Call _exit() or exec
//     from the task instead of returning. A TaskGroup or ParallelFor of the parent cannot be
//     waited for in such a child (its other tasks stayed in the parent): Wait throws
//     kFailedPrecondition there instead of waiting for ever.
//   - Post (and so TaskGroup::Run) throws kResourceExhausted when no worker can start and none
//     runs (a thread limit); the task is then not queued. ParallelFor goes on with fewer
//     helpers, down to the calling thread alone.
#ifndef FORKSAFE_RUNTIME_THREAD_POOL_H_
#define FORKSAFE_RUNTIME_THREAD_POOL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::runtime {

struct PrepareAttempt;  // runtime/at_fork.h

/// Configuration of a ThreadPool.
struct ThreadPoolOptions {
  /// 0 means DefaultThreadCount() (runtime/cpu_budget.h): FORKSAFE_NUM_THREADS, else the first
  /// number of OMP_NUM_THREADS, else the CPUs of the affinity mask and cgroup quota (at least 1).
  int num_threads = 0;
  std::string name = "pool";
  /// How long prepare waits for in-flight tasks before letting the fork go ahead regardless
  /// (at most 24 h; never past the fork's own AtForkOptions::prepare_deadline).
  std::chrono::milliseconds drain_deadline{2000};
};

/// Counters, for tests and diagnostics.
struct ThreadPoolStats {
  uint64_t tasks_completed = 0;
  uint64_t task_exceptions = 0;  ///< Exceptions thrown by Post() tasks.
  uint64_t forks_drained = 0;    ///< Forks for which the pool was fully quiesced.
  uint64_t drain_timeouts = 0;   ///< Forks that went ahead with tasks still running.
  /// Always 0: prepare attempts once rolled back because a worker let go at the fork was still
  /// ending (running its thread_local destructors). Workers now stay parked across a fork and no
  /// thread ends there; the field stays for the readers of these counters.
  uint64_t exit_waits = 0;
  uint64_t rebuilt_in_child = 0;  ///< 1 when this pool was rebuilt after a fork in this process.
};

namespace internal {
struct PoolState;
}  // namespace internal

/// A fork-safe pool of worker threads.
class ThreadPool {
 public:
  /// Creates the pool (no thread starts until the first task). Throws kInvalidArgument for a
  /// negative thread count or deadline, and, with num_threads == 0, for a malformed
  /// FORKSAFE_NUM_THREADS (runtime/cpu_budget.h); a malformed OMP_NUM_THREADS never throws (it
  /// is ignored, with a warning on stderr).
  explicit ThreadPool(ThreadPoolOptions options = {});
  /// Runs every queued task, then joins the workers.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// The process-wide pool (created on first use, never destroyed), of DefaultThreadCount()
  /// threads. The call that creates it throws kInvalidArgument when FORKSAFE_NUM_THREADS is
  /// malformed (a later call tries again); nothing else throws.
  static ThreadPool& Default();

  /// Queues `fn`; the returned future holds its result or exception.
  template <typename Fn>
  auto Submit(Fn&& fn) -> std::future<std::invoke_result_t<std::decay_t<Fn>>> {
    using R = std::invoke_result_t<std::decay_t<Fn>>;
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<Fn>(fn));
    std::future<R> result = task->get_future();
    Post([task] { (*task)(); });
    return result;
  }

  /// Queues `fn` without a result.
  void Post(std::function<void()> fn);

  /// Blocks until the queue is empty and no task runs. Throws kFailedPrecondition from a worker.
  void Wait();

  /// Runs body(lo, hi) over [begin, end) in chunks of at most `grain` (>= 1), on the workers and
  /// the calling thread; rethrows the first exception after all chunks finished. Memory does not
  /// grow with the number of chunks (they are handed out from one counter to at most
  /// num_threads() helper tasks and the caller), and the caller runs chunks itself, so a
  /// ParallelFor finishes even while the pool is paused for a fork or all its workers are busy.
  /// Throws kInvalidArgument for grain < 1, an empty body, or more than kParallelForMaxChunks
  /// chunks (the message names the smallest grain that fits). Any int64_t range is handled
  /// without overflow.
  void ParallelFor(int64_t begin, int64_t end, int64_t grain,
                   const std::function<void(int64_t, int64_t)>& body);

  /// The most chunks one ParallelFor makes: 2^32 calls of the body (about a minute of calls that
  /// do nothing); a range that needs more is a mistake in the grain, not work.
  static constexpr uint64_t kParallelForMaxChunks = uint64_t{1} << 32;

  /// Runs one queued task on the calling thread, if there is one. Returns whether it did.
  bool TryRunOne();

  /// The configured number of workers.
  int num_threads() const { return num_threads_; }
  /// Worker threads alive right now (0 before first use and in a forked child until first use;
  /// a fork leaves the parent's workers alive, parked).
  int live_workers() const;
  /// Tasks queued and not yet started.
  size_t queued() const;
  const std::string& name() const { return options_.name; }
  ThreadPoolStats stats() const;

  /// True when the calling thread is a worker of any forksafe pool.
  static bool OnWorkerThread();
  /// True when the calling thread is a worker of this pool.
  bool OnThisPoolsWorker() const;

 private:
  internal::PoolState* State();  // creates the state lazily (after a fork in the child)
  bool PrepareFork(const PrepareAttempt& attempt);
  void ParentAfterFork();
  void ChildAfterFork();

  ThreadPoolOptions options_;
  int num_threads_;
  std::atomic<internal::PoolState*> state_{nullptr};
  std::chrono::steady_clock::time_point drain_started_{};
  uint64_t drain_fork_ = 0;  // the fork drain_started_ belongs to (forks are serialized)
  bool drained_this_fork_ = false;
  std::atomic<uint64_t> forks_drained_{0};
  std::atomic<uint64_t> drain_timeouts_{0};
  std::atomic<uint64_t> rebuilt_in_child_{0};
};

/// A set of tasks on one pool that can be waited for together.
class TaskGroup {
 public:
  explicit TaskGroup(ThreadPool& pool = ThreadPool::Default());
  /// Waits for the group's tasks (exceptions are dropped: call Wait() to see them).
  ~TaskGroup();
  TaskGroup(const TaskGroup&) = delete;
  TaskGroup& operator=(const TaskGroup&) = delete;

  /// Queues `fn` as part of the group.
  void Run(std::function<void()> fn);
  /// Waits until every task of the group finished, helping run queued tasks meanwhile, then
  /// rethrows the first exception a task threw (once).
  void Wait();

 private:
  ThreadPool& pool_;
  internal::Mutex mu_;
  internal::CondVar cv_;
  int pending_ FORKSAFE_GUARDED_BY(mu_) = 0;
  std::exception_ptr error_ FORKSAFE_GUARDED_BY(mu_);
  uint64_t generation_;  // ForkGeneration() at construction: Wait in a forked child refuses
};

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_THREAD_POOL_H_
