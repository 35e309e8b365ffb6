#include "forksafe/runtime/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/cpu_budget.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/fork_entry.h"
#include "forksafe/runtime/internal/openmp_order.h"
#include "forksafe/runtime/tbb_fork.h"

namespace forksafe::runtime {
namespace internal {

// Everything a pool's workers touch. Abandoned (never destroyed) in a forked child.
struct PoolState {
  Mutex mu;
  CondVar work_cv;   // workers wait for tasks, and parked threads for the end of a pause
  CondVar drain_cv;  // prepare waits for workers to park
  CondVar idle_cv;   // Wait() waits for an empty, idle pool
  std::deque<std::function<void()>> queue FORKSAFE_GUARDED_BY(mu);
  std::vector<std::thread> workers FORKSAFE_GUARDED_BY(mu);
  int live FORKSAFE_GUARDED_BY(mu) = 0;     // workers inside WorkerLoop
  int running FORKSAFE_GUARDED_BY(mu) = 0;  // tasks in flight (on workers and on threads that help)
  // Workers that hold no task and no lock but mu: waiting for work or for the end of a pause,
  // or parked between two chunks of a ParallelFor helper task (helpers_parked of them). A fork
  // does not wait for them.
  int parked FORKSAFE_GUARDED_BY(mu) = 0;
  int helpers_parked FORKSAFE_GUARDED_BY(mu) = 0;
  // Parked workers that still hold oneTBB thread state (ThreadHoldsTbbState): a fork waits until
  // they dropped it.
  int parked_with_tbb FORKSAFE_GUARDED_BY(mu) = 0;
  // Workers inside fork(), waiting for another thread's fork.
  int forking_workers FORKSAFE_GUARDED_BY(mu) = 0;
  bool paused FORKSAFE_GUARDED_BY(mu) = false;
  // `paused`, readable without mu: a ParallelFor helper polls it between chunks.
  std::atomic<bool> pausing{false};
  bool stopping FORKSAFE_GUARDED_BY(mu) = false;
  const uint64_t generation = ForkGeneration();  // set once: read without mu
  uint64_t tasks_completed FORKSAFE_GUARDED_BY(mu) = 0;
  uint64_t task_exceptions FORKSAFE_GUARDED_BY(mu) = 0;
};

}  // namespace internal

namespace {

using internal::CondVar;
using internal::MutexLock;
using internal::PoolState;

thread_local PoolState* t_worker_state = nullptr;
// How many tasks this thread is running, one inside the other (RunTask): 1 for a worker's own
// task, more where a task helps run queued ones (TaskGroup::Wait, ParallelFor, TryRunOne).
thread_local int t_task_depth = 0;

// Runs one task on this thread; returns whether it threw. The task (and what it captured) is
// destroyed before returning.
bool RunTask(std::function<void()> task) {
  // Keeps the at-fork registry prepared before OpenMP runtimes that a task may use
  // (runtime/openmp_fork.h, "LLVM libomp and Intel libiomp5"); a clock read most of the time.
  internal::OrderForkHandlersAfterOpenMpFromPool();
  struct Depth {
    Depth() { ++t_task_depth; }
    ~Depth() { --t_task_depth; }
  } depth;
  try {
    task();
  } catch (...) {
    return true;
  }
  return false;
}

// Sets or clears the pause for a fork. Clearing wakes the threads parked by it: the workers that
// wait for it with tasks queued, and ParallelFor helpers parked between two chunks (idle workers
// with nothing queued need no wake-up).
void SetPausedLocked(PoolState* s, bool paused) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  s->paused = paused;
  s->pausing.store(paused, std::memory_order_relaxed);
  if (!paused && (!s->queue.empty() || s->helpers_parked > 0)) s->work_cv.NotifyAll();
}

void WorkerLoop(PoolState* s) {
  t_worker_state = s;
  MutexLock lk(&s->mu);
  for (;;) {
    if (s->paused || (!s->stopping && s->queue.empty())) {
      // Parked: no task, no lock but this one (which the wait releases). A fork needs nothing
      // more from this thread, so prepare does not wait for it to end (nor wakes it), unless it
      // holds oneTBB thread state: then a fork wakes it to drop that first.
      bool tbb = ThreadHoldsTbbState();
      ++s->parked;
      if (tbb) ++s->parked_with_tbb;
      if (s->paused) s->drain_cv.NotifyAll();
      while (s->paused || (!s->stopping && s->queue.empty())) {
        if (tbb && s->paused) {
          --s->parked_with_tbb;
          --s->parked;  // busy with oneTBB's locks meanwhile
          lk.Unlock();
          ReleaseTbbThreadState();
          lk.Lock();
          tbb = false;
          ++s->parked;
          s->drain_cv.NotifyAll();
          continue;
        }
        s->work_cv.Wait(&lk);
      }
      if (tbb) --s->parked_with_tbb;
      --s->parked;
    }
    if (s->queue.empty()) break;  // stopping with no work left
    std::function<void()> task = std::move(s->queue.front());
    s->queue.pop_front();
    ++s->running;
    lk.Unlock();
    const bool threw = RunTask(std::move(task));
    if (ForkGeneration() != s->generation) {
      // This thread forked from inside the task and is now the only thread of a child: the
      // state belongs to the parent. Touch nothing; ending the thread is all that is left.
      t_worker_state = nullptr;
      return;
    }
    lk.Lock();
    --s->running;
    ++s->tasks_completed;
    if (threw) ++s->task_exceptions;
    if (s->running == 0 && s->queue.empty()) s->idle_cv.NotifyAll();
  }
  --s->live;
  t_worker_state = nullptr;
}

// Parks a ParallelFor helper task between two chunks while its pool is paused for a fork
// (ThreadPool::ParallelFor). Only a worker's outermost task parks: it holds no lock here.
void ParkHelperWhilePaused(PoolState* s) {
  if (ForkGeneration() != s->generation) return;  // a child forked by this task: not ours
  ReleaseTbbThreadState();                        // as a parking worker does (WorkerLoop)
  MutexLock lk(&s->mu);
  if (!s->paused) return;
  ++s->parked;
  ++s->helpers_parked;
  s->drain_cv.NotifyAll();
  while (s->paused) s->work_cv.Wait(&lk);
  --s->helpers_parked;
  --s->parked;
}

// Starts workers up to `target`. Keeps s->mu held (never unlocks).
void EnsureWorkersLocked(PoolState* s, int target) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  if (s->paused || s->stopping) return;
  while (s->live < target) {
    try {
      s->workers.emplace_back(WorkerLoop, s);  // it starts by waiting for s->mu, held here
      ++s->live;
    } catch (const std::system_error& e) {
      if (s->live > 0) return;  // run with fewer workers
      throw Error(ErrorCode::kResourceExhausted,
                  absl::StrCat("could not start a pool worker thread: ", e.what(),
                               "; lower the number of threads or raise the process limit"));
    }
  }
}

// Ends a pause (a fork done, or a prepare rolled back).
void ResumeLocked(PoolState* s, int num_threads) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  // The workers parked across the fork go on: none was joined, none is started again. Only
  // where tasks were queued during the pause on a pool short of workers (they start lazily, or
  // one could not start before) are workers started now; otherwise on the next Post.
  SetPausedLocked(s, false);
  if (!s->queue.empty() && s->live < num_threads) {
    try {
      EnsureWorkersLocked(s, num_threads);
    } catch (...) {
      // Out of threads right now: the next Post() tries again.
    }
  }
}

#if defined(__SANITIZE_THREAD__)
// In a forked child. The parent's workers were parked, alive, at the fork; glibc hands their
// stacks, and so their pthread_t values, to this child's next threads. ThreadSanitizer (as shipped
// with GCC 12) still counts the parent's threads as running here, and dies ("dup thread with used
// id") when a thread of this child that got such an id is joined. Detaching the vanished workers'
// ids first takes them out of its books; glibc only marks their unused descriptors detached.
// Unlocked: the child is single-threaded here, and nothing changes `workers` while a pool is
// paused for a fork.
void ForgetVanishedWorkersForTsan(PoolState* s) FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  for (std::thread& t : s->workers) {
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) pthread_detach(t.native_handle());
  }
}
#endif

// The registry's fork-entry hooks (runtime/internal/fork_entry.h): a worker inside fork(), waiting
// for another thread's fork, is not waited for by that fork's drain.
void OnForkEntering() {
  PoolState* s = t_worker_state;
  if (s == nullptr || ForkGeneration() != s->generation) return;
  MutexLock lk(&s->mu);
  ++s->forking_workers;
  s->drain_cv.NotifyAll();
}

void OnForkEntered() {
  PoolState* s = t_worker_state;
  if (s == nullptr || ForkGeneration() != s->generation) return;
  MutexLock lk(&s->mu);
  --s->forking_workers;
}

}  // namespace

ThreadPool::ThreadPool(ThreadPoolOptions options) : options_(std::move(options)) {
  if (options_.num_threads < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ThreadPoolOptions::num_threads must be >= 0 (0 = one per CPU this "
                             "process may use), got ",
                             options_.num_threads));
  }
  if (options_.drain_deadline.count() < 0 || options_.drain_deadline > std::chrono::hours(24)) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ThreadPoolOptions::drain_deadline must lie in [0 ms, 24 h], got ",
                             options_.drain_deadline.count(),
                             " ms; a fork is bounded by the registry's prepare deadline anyway "
                             "(AtForkOptions::prepare_deadline)"));
  }
  // 0: the CPUs this process may use (affinity, cgroup quota, FORKSAFE_NUM_THREADS /
  // OMP_NUM_THREADS: runtime/cpu_budget.h), read once here, never per task.
  num_threads_ = options_.num_threads > 0 ? options_.num_threads : DefaultThreadCount();
  // oneTBB's handler must be registered before any pool: prepare runs in reverse order, so the
  // pools drain first and oneTBB is finalized after them.
  InstallTbbForkHandler();
  static std::once_flag hooks_once;
  std::call_once(hooks_once, [] { internal::SetForkEntryHooks(&OnForkEntering, &OnForkEntered); });
  state_.store(new PoolState());
  AtForkHandler h;
  h.name = "thread_pool:" + options_.name;
  h.prepare = [this](const PrepareAttempt& a) { return PrepareFork(a); };
  h.parent = [this](bool) { ParentAfterFork(); };
  h.child = [this](bool) { ChildAfterFork(); };
  AtForkRegistry::Get().Register(this, std::move(h));
}

ThreadPool::~ThreadPool() {
  try {
    AtForkRegistry::Get().Unregister(this);
  } catch (...) {
  }
  PoolState* s = state_.load();
  if (s == nullptr) return;
  {
    MutexLock lk(&s->mu);
    s->stopping = true;
    SetPausedLocked(s, false);
    // Make sure queued work still has a worker to run it.
    if (!s->queue.empty() && s->live == 0) {
      s->stopping = false;
      EnsureWorkersLocked(s, 1);
      s->stopping = true;
    }
    s->work_cv.NotifyAll();
  }
  std::vector<std::thread> threads;
  {
    MutexLock lk(&s->mu);
    threads.swap(s->workers);
  }
  for (std::thread& t : threads) {
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
  }
  delete s;
}

ThreadPool& ThreadPool::Default() {
  static ThreadPool* pool = [] {
    ThreadPoolOptions o;  // default deadline, DefaultThreadCount() workers
    o.name = "default";
    return new ThreadPool(o);
  }();
  return *pool;
}

PoolState* ThreadPool::State() {
  PoolState* s = state_.load(std::memory_order_acquire);
  if (s != nullptr) return s;
  // Only after a fork, in the child: build a fresh state; the first thread to install it wins.
  auto* fresh = new PoolState();
  if (state_.compare_exchange_strong(s, fresh)) return fresh;
  delete fresh;
  return s;
}

void ThreadPool::Post(std::function<void()> fn) {
  if (!fn) throw Error(ErrorCode::kInvalidArgument, "ThreadPool::Post was given an empty task");
  PoolState* s = State();
  MutexLock lk(&s->mu);
  if (s->stopping) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("pool \"", options_.name, "\" is being destroyed; no new tasks"));
  }
  s->queue.push_back(std::move(fn));
  try {
    EnsureWorkersLocked(s, num_threads_);
  } catch (...) {
    // No worker could start and none runs: the task is refused, so it must not run later (its
    // caller may unwind and free what it refers to). EnsureWorkersLocked keeps the lock held.
    s->queue.pop_back();
    throw;
  }
  s->work_cv.NotifyOne();
}

bool ThreadPool::TryRunOne() {
  PoolState* s = State();
  std::function<void()> task;
  {
    MutexLock lk(&s->mu);
    // Also while paused for a fork: a thread that waits for its own tasks (a TaskGroup, a
    // ParallelFor) runs them itself, so it never waits for workers that the fork keeps stopped
    // (while holding a lock that a prepare wants, say). Such a thread is not one of the pool's
    // workers, and the drain does not wait for it: it is the caller's own work.
    if (s->queue.empty()) return false;
    task = std::move(s->queue.front());
    s->queue.pop_front();
    ++s->running;
  }
  const bool threw = RunTask(std::move(task));
  if (ForkGeneration() != s->generation) return true;  // forked inside the task: state is gone
  MutexLock lk(&s->mu);
  --s->running;
  ++s->tasks_completed;
  if (threw) ++s->task_exceptions;
  if (s->running == 0 && s->queue.empty()) s->idle_cv.NotifyAll();
  return true;
}

void ThreadPool::Wait() {
  if (OnThisPoolsWorker()) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("ThreadPool::Wait called from a worker of pool \"", options_.name,
                             "\" would wait for itself; use a TaskGroup instead"));
  }
  PoolState* s = State();
  MutexLock lk(&s->mu);
  while (!s->queue.empty() || s->running != 0) s->idle_cv.Wait(&lk);
}

void ThreadPool::ParallelFor(int64_t begin, int64_t end, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& body) {
  if (grain < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ParallelFor grain must be >= 1, got ", grain));
  }
  if (!body) throw Error(ErrorCode::kInvalidArgument, "ParallelFor was given an empty body");
  if (end <= begin) return;
  // In unsigned arithmetic: end - begin and lo + grain may not fit in int64_t.
  const uint64_t span = static_cast<uint64_t>(end) - static_cast<uint64_t>(begin);
  const uint64_t step = static_cast<uint64_t>(grain);
  const uint64_t chunks = span / step + (span % step != 0 ? 1 : 0);
  if (chunks > kParallelForMaxChunks) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat("ParallelFor over [", begin, ", ", end, ") in chunks of ", grain,
                     " would make ", chunks, " chunks, more than the limit of ",
                     kParallelForMaxChunks,
                     " (one call of the body each); raise the grain to at least ",
                     span / kParallelForMaxChunks + (span % kParallelForMaxChunks != 0 ? 1 : 0)));
  }
  // Chunks are handed out from one counter, so memory does not grow with their number: the
  // calling thread and up to num_threads() helper tasks take the next chunk until none is left.
  // The state is shared with the helpers: one parked for a fork between two chunks may resume
  // (and find no chunk left) after this call has returned.
  struct Shared {
    std::atomic<uint64_t> next{0};
    internal::Mutex mu;
    internal::CondVar cv;
    // Helpers queued or running a chunk: all but those parked between chunks for a fork.
    int active FORKSAFE_GUARDED_BY(mu) = 0;
    std::exception_ptr error FORKSAFE_GUARDED_BY(mu);  // the first one
  };
  auto shared = std::make_shared<Shared>();
  // `body` is called only for a chunk taken from `next`, and this call returns only once every
  // chunk is done, so a helper that resumes later never reaches it.
  auto run_chunks = [&body, begin, end, span, step, chunks](Shared& sh, PoolState* park_in) {
    for (;;) {
      if (park_in != nullptr && park_in->pausing.load(std::memory_order_relaxed)) {
        {
          MutexLock lk(&sh.mu);
          if (--sh.active == 0) sh.cv.NotifyAll();
        }
        ParkHelperWhilePaused(park_in);
        MutexLock lk(&sh.mu);
        ++sh.active;
      }
      const uint64_t c = sh.next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      const uint64_t offset = c * step;  // < span
      const auto lo = static_cast<int64_t>(static_cast<uint64_t>(begin) + offset);
      // lo + step < end here unless this is the last chunk: no overflow.
      const int64_t hi = span - offset <= step ? end : lo + static_cast<int64_t>(step);
      try {
        body(lo, hi);
      } catch (...) {
        MutexLock lk(&sh.mu);
        if (!sh.error) sh.error = std::current_exception();
      }
    }
  };
  PoolState* const pool_state = State();
  // Waits until no helper is queued or inside a chunk, running queued tasks meanwhile (as
  // TaskGroup::Wait does: helpers not started yet find no chunk left, or run here while the
  // pool is paused). Helpers parked for a fork are not waited for.
  auto wait_for_helpers = [this, &shared] {
    for (;;) {
      {
        MutexLock lk(&shared->mu);
        if (shared->active == 0) return;
      }
      if (TryRunOne()) continue;
      MutexLock lk(&shared->mu);
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
      while (shared->active != 0 && shared->cv.WaitUntil(&lk, until)) {
      }
    }
  };
  const uint64_t generation = ForkGeneration();
  const uint64_t helpers = std::min<uint64_t>(static_cast<uint64_t>(num_threads_), chunks - 1);
  uint64_t posted = 0;
  for (uint64_t i = 0; i < helpers; ++i) {
    {
      MutexLock lk(&shared->mu);
      ++shared->active;
    }
    try {
      Post([shared, run_chunks, pool_state] {
        // Only a worker's outermost task may park mid-loop: a helper run nested inside another
        // task (TaskGroup::Wait, TryRunOne) may have frames below it that hold the caller's locks.
        PoolState* park_in =
            (t_worker_state == pool_state && t_task_depth == 1) ? pool_state : nullptr;
        run_chunks(*shared, park_in);
        // Forked from inside the body, this is a child's only thread: the parent's caller may
        // have held shared->mu at the fork. Touch nothing (TaskGroup::Wait refuses there).
        if (ForkGeneration() != pool_state->generation) return;
        MutexLock lk(&shared->mu);
        if (--shared->active == 0) shared->cv.NotifyAll();
      });
    } catch (...) {
      {
        MutexLock lk(&shared->mu);
        --shared->active;
      }
      bool thread_limit = false;
      try {
        throw;
      } catch (const Error& e) {
        thread_limit = e.code() == ErrorCode::kResourceExhausted;
      } catch (...) {
      }
      // No worker can start (a thread limit): the caller runs the chunks alone.
      if (thread_limit) break;
      shared->next.store(chunks);  // no new chunk starts; wait for those in flight
      wait_for_helpers();
      throw;
    }
    ++posted;
  }
  run_chunks(*shared, nullptr);  // the caller works too, and never parks
  if (posted > 0) {
    if (ForkGeneration() != generation) {
      // Forked from inside the body on this thread: the helpers run in the parent.
      throw Error(
          ErrorCode::kFailedPrecondition,
          "a TaskGroup (or ParallelFor) of the parent cannot be waited for in a forked child: "
          "its tasks run in the parent; call _exit() or exec from the task that forked");
    }
    wait_for_helpers();
  }
  std::exception_ptr error;
  {
    MutexLock lk(&shared->mu);
    error = shared->error;
  }
  if (error) std::rethrow_exception(error);
}

int ThreadPool::live_workers() const {
  PoolState* s = state_.load();
  if (s == nullptr) return 0;
  MutexLock lk(&s->mu);
  return s->live;
}

size_t ThreadPool::queued() const {
  PoolState* s = state_.load();
  if (s == nullptr) return 0;
  MutexLock lk(&s->mu);
  return s->queue.size();
}

ThreadPoolStats ThreadPool::stats() const {
  ThreadPoolStats out;
  PoolState* s = state_.load();
  if (s != nullptr) {
    MutexLock lk(&s->mu);
    out.tasks_completed = s->tasks_completed;
    out.task_exceptions = s->task_exceptions;
  }
  out.forks_drained = forks_drained_.load();
  out.drain_timeouts = drain_timeouts_.load();
  out.exit_waits = 0;  // no worker ends at a fork any more (ThreadPoolStats::exit_waits)
  out.rebuilt_in_child = rebuilt_in_child_.load();
  return out;
}

bool ThreadPool::OnWorkerThread() { return t_worker_state != nullptr; }

bool ThreadPool::OnThisPoolsWorker() const {
  return t_worker_state != nullptr && t_worker_state == state_.load();
}

bool ThreadPool::PrepareFork(const PrepareAttempt& attempt) {
  const bool last = attempt.last;
  drained_this_fork_ = false;
  PoolState* s = state_.load();
  if (s == nullptr) return true;  // never used since the last fork: nothing to quiesce
  const auto now = std::chrono::steady_clock::now();
  if (attempt.fork_number != drain_fork_) {  // our first call for this fork, whatever the attempt
    drain_fork_ = attempt.fork_number;
    drain_started_ = now;
  }
  // The pool's own deadline, and never past the fork's (the rule for handlers: at_fork.h).
  auto hard_deadline = drain_started_ + options_.drain_deadline;
  if (attempt.deadline != std::chrono::steady_clock::time_point{}) {
    hard_deadline = std::min(hard_deadline, attempt.deadline);
  }
  // Each attempt waits a slice, so that a task blocked on a lock another subsystem took in
  // prepare gets its chance after the registry rolls that subsystem back.
  const auto slice = std::max<std::chrono::steady_clock::duration>(options_.drain_deadline / 8,
                                                                   std::chrono::milliseconds(1));
  const auto wait_until = last ? hard_deadline : std::min(hard_deadline, now + slice);
  const int self = (t_worker_state == s) ? 1 : 0;  // a fork from our own worker

  MutexLock lk(&s->mu);
  SetPausedLocked(s, true);
  if (s->parked_with_tbb > 0) s->work_cv.NotifyAll();  // they drop their oneTBB state first
  // Every worker parks: when its task ends (it then waits for the end of the pause without
  // taking the next one), or, a ParallelFor helper that is its outermost task, between two
  // chunks. Idle workers are parked already and are not woken, unless they hold oneTBB thread
  // state, which they drop first (ReleaseTbbThreadState). Parked threads stay alive across
  // the fork: none ends, so no thread_local destructor (tbbmalloc's, say, which takes that
  // allocator's locks) runs while the fork goes ahead. Not waited for: this thread (a fork from
  // one of our tasks), workers that are themselves inside fork() waiting for this one (they
  // cannot finish first), and tasks that threads other than workers run for themselves
  // (TryRunOne, a ParallelFor's caller).
  auto unparked = [&]() FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
    return std::max(s->live - s->parked - self - s->forking_workers, 0) + s->parked_with_tbb;
  };
  while (unparked() > 0) {
    if (!s->drain_cv.WaitUntil(&lk, wait_until)) break;
  }
  const int busy = unparked();
  if (busy <= 0) {
    drained_this_fork_ = true;
    // Parked as NoteThreadsParkedForFork asks: no task, no lock (a spurious wake-up takes only
    // s->mu, which the child abandons), no oneTBB thread state, and waiting for the end of the
    // pause, which only ParentAfterFork (or a roll-back) brings.
    NoteThreadsParkedForFork(s->parked);
    return true;
  }
  if (!last && std::chrono::steady_clock::now() < hard_deadline) {
    ResumeLocked(s, num_threads_);  // roll back: let the workers go on until the next attempt
    return false;
  }
  drain_timeouts_.fetch_add(1, std::memory_order_relaxed);
  AtForkRegistry::ReportEvent(
      ForkEventKind::kDrainDeadlineExceeded, "thread_pool:" + options_.name,
      absl::StrCat(busy, " worker(s) still running a task after the drain deadline of ",
                   options_.drain_deadline.count(),
                   " ms; the fork proceeds, the child gets a fresh pool, and the parent's "
                   "tasks go on"));
  return true;
}

void ThreadPool::ParentAfterFork() {
  if (drained_this_fork_) forks_drained_.fetch_add(1, std::memory_order_relaxed);
  PoolState* s = state_.load();
  if (s == nullptr) return;
  MutexLock lk(&s->mu);
  ResumeLocked(s, num_threads_);
}

void ThreadPool::ChildAfterFork() {
  // Abandon the parent's state: its mutexes may be held by threads that do not exist here and its
  // std::thread objects are joinable. Leaking it is the only safe choice (PyTorch's pthreadpool
  // does the same). A fresh state is built on first use.
  // Forked from a worker: the task keeps running on this thread and its loop then exits without
  // touching the abandoned state (it compares ForkGeneration()).
#if defined(__SANITIZE_THREAD__)
  if (PoolState* s = state_.load(); s != nullptr) ForgetVanishedWorkersForTsan(s);
#endif
  state_.store(nullptr);
  drain_fork_ = 0;  // the child numbers its forks from 1 again (AtForkRegistry::fork_count)
  rebuilt_in_child_.store(1);
  forks_drained_.store(0);
  drain_timeouts_.store(0);
}

TaskGroup::TaskGroup(ThreadPool& pool) : pool_(pool), generation_(ForkGeneration()) {}

TaskGroup::~TaskGroup() {
  try {
    Wait();
  } catch (...) {
  }
}

void TaskGroup::Run(std::function<void()> fn) {
  {
    internal::MutexLock lk(&mu_);
    ++pending_;
  }
  try {
    pool_.Post([this, fn = std::move(fn)] {
      std::exception_ptr err;
      try {
        fn();
      } catch (...) {
        err = std::current_exception();
      }
      internal::MutexLock lk(&mu_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) cv_.NotifyAll();
    });
  } catch (...) {
    internal::MutexLock lk(&mu_);
    --pending_;
    throw;
  }
}

void TaskGroup::Wait() {
  if (ForkGeneration() != generation_) {
    // Forked from inside one of this group's tasks (or while it ran): its other tasks stayed in
    // the parent and will never finish here.
    throw Error(
        ErrorCode::kFailedPrecondition,
        "a TaskGroup (or ParallelFor) of the parent cannot be waited for in a forked child: "
        "its tasks run in the parent; call _exit() or exec from the task that forked");
  }
  for (;;) {
    {
      internal::MutexLock lk(&mu_);
      if (pending_ == 0) break;
    }
    if (pool_.TryRunOne()) continue;
    internal::MutexLock lk(&mu_);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
    while (pending_ != 0 && cv_.WaitUntil(&lk, until)) {
    }
  }
  std::exception_ptr err;
  {
    internal::MutexLock lk(&mu_);
    err = std::exchange(error_, nullptr);
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace forksafe::runtime
