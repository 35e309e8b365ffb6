#include "forksafe/runtime/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <list>
#include <mutex>
#include <new>
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
  struct Worker {
    std::thread thread;
    bool exited = false;  // guarded by mu (reached only through `workers`, which is)
  };

  Mutex mu;
  CondVar work_cv;   // workers wait for tasks
  CondVar drain_cv;  // prepare waits for workers to leave
  CondVar idle_cv;   // Wait() waits for an empty, idle pool
  std::deque<std::function<void()>> queue FORKSAFE_GUARDED_BY(mu);
  std::list<Worker> workers FORKSAFE_GUARDED_BY(mu);
  int live FORKSAFE_GUARDED_BY(mu) = 0;     // workers inside WorkerLoop
  int running FORKSAFE_GUARDED_BY(mu) = 0;  // tasks in flight (on workers and on threads that help)
  // Workers inside fork(), waiting for another thread's fork.
  int forking_workers FORKSAFE_GUARDED_BY(mu) = 0;
  // Workers that left their loop and that some thread took off `workers` to join, not yet
  // joined: their threads may still be running thread_local destructors. A drain is complete only
  // when this is 0 too (a Post on another thread may be joining a worker the drain let go).
  int joining FORKSAFE_GUARDED_BY(mu) = 0;
  bool paused FORKSAFE_GUARDED_BY(mu) = false;
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
// Runs one task on this thread; returns whether it threw. The task (and what it captured) is
// destroyed before returning.
bool RunTask(std::function<void()> task) {
  // Keeps the at-fork registry prepared before OpenMP runtimes that a task may use
  // (runtime/openmp_fork.h, "LLVM libomp and Intel libiomp5"); a clock read most of the time.
  internal::OrderForkHandlersAfterOpenMpFromPool();
  try {
    task();
  } catch (...) {
    return true;
  }
  return false;
}

void WorkerLoop(PoolState* s, PoolState::Worker* self) {
  t_worker_state = s;
  MutexLock lk(&s->mu);
  for (;;) {
    while (!s->paused && !s->stopping && s->queue.empty()) s->work_cv.Wait(&lk);
    if (s->paused || s->queue.empty()) break;  // paused for a fork, or stopping with no work
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
    if (s->paused) s->drain_cv.NotifyAll();
  }
  --s->live;
  self->exited = true;
  s->drain_cv.NotifyAll();
  t_worker_state = nullptr;
}

// Starts workers up to `target`. Keeps s->mu held (never unlocks).
void EnsureWorkersLocked(PoolState* s, int target) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  if (s->paused || s->stopping) return;
  while (s->live < target) {
    s->workers.emplace_back();
    PoolState::Worker* w = &s->workers.back();
    ++s->live;
    try {
      w->thread = std::thread(WorkerLoop, s, w);
    } catch (const std::system_error& e) {
      --s->live;
      s->workers.pop_back();
      if (s->live > 0) return;  // run with fewer workers
      throw Error(ErrorCode::kResourceExhausted,
                  absl::StrCat("could not start a pool worker thread: ", e.what(),
                               "; lower the number of threads or raise the process limit"));
    }
  }
}

// Joins `t` if its thread has ended by `until`, polling pthread_tryjoin_np on the steady clock (a
// step of the wall clock cannot stretch it); false, with `t` still joinable, when it has not.
bool JoinIfEndedBy(std::thread& t, std::chrono::steady_clock::time_point until) {
  for (;;) {
    const int rc = pthread_tryjoin_np(t.native_handle(), nullptr);
    if (rc == 0) {
      // Joined behind std::thread's back: make the object empty without running its destructor
      // (which terminates on a joinable thread); it holds nothing but the id.
      new (&t) std::thread();
      return true;
    }
    if (rc != EBUSY || std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Joins and forgets workers that have left their loop. Requires s->mu held (by the caller's
// MutexLock); releases it meanwhile and takes it again before returning. A worker whose thread has
// not ended by `until` is left for a later call: its thread_local destructors may be waiting for
// the registry (an AtForkRegistration, a thread_local pool) or a lock the caller holds, and an
// unbounded join would deadlock. Returns how many such threads are still running.
// Nothing throws while s->mu is released (`later` is reserved first), so the caller's guard
// always finds the mutex held again.
int ReapExitedLocked(PoolState* s, std::chrono::steady_clock::time_point until)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  std::vector<std::thread> done;
  for (auto it = s->workers.begin(); it != s->workers.end();) {
    if (it->exited) {
      done.push_back(std::move(it->thread));
      it = s->workers.erase(it);
    } else {
      ++it;
    }
  }
  if (done.empty()) return 0;
  const int taken = static_cast<int>(done.size());
  std::vector<std::thread> later;
  later.reserve(done.size());
  s->joining += taken;
  s->mu.Unlock();
  for (std::thread& t : done) {
    if (t.joinable() && !JoinIfEndedBy(t, until)) later.push_back(std::move(t));
  }
  s->mu.Lock();
  s->joining -= taken;
  for (std::thread& t : later) {
    s->workers.emplace_back();
    s->workers.back().thread = std::move(t);
    s->workers.back().exited = true;
  }
  if (s->paused) s->drain_cv.NotifyAll();
  return static_cast<int>(later.size());
}

// Workers that left their loop and whose threads are not joined yet: listed, or being joined by
// another thread.
int LeftNotJoinedLocked(const PoolState* s) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  int n = s->joining;
  for (const PoolState::Worker& w : s->workers) n += w.exited ? 1 : 0;
  return n;
}

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
    s->paused = false;
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
    for (auto& w : s->workers) threads.push_back(std::move(w.thread));
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
  // Workers that left at a fork and could not be joined then: every listed worker is live or left.
  // Joined only if their threads have ended: a thread still in its thread_local destructors may
  // wait for a lock this caller holds, and an unbounded join here would deadlock. The others
  // stay listed for a later Post, a fork's drain or the destructor.
  if (s->workers.size() > static_cast<size_t>(s->live)) {
    ReapExitedLocked(s, std::chrono::steady_clock::now());
  }
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
  if (s->paused) s->drain_cv.NotifyAll();
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
  struct Shared {
    std::atomic<uint64_t> next{0};
    internal::Mutex mu;
    std::exception_ptr error FORKSAFE_GUARDED_BY(mu);  // the first one
  } shared;
  auto run_chunks = [&shared, &body, begin, end, span, step, chunks] {
    for (;;) {
      const uint64_t c = shared.next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      const uint64_t offset = c * step;  // < span
      const auto lo = static_cast<int64_t>(static_cast<uint64_t>(begin) + offset);
      // lo + step < end here unless this is the last chunk: no overflow.
      const int64_t hi = span - offset <= step ? end : lo + static_cast<int64_t>(step);
      try {
        body(lo, hi);
      } catch (...) {
        MutexLock lk(&shared.mu);
        if (!shared.error) shared.error = std::current_exception();
      }
    }
  };
  {
    TaskGroup group(*this);
    const uint64_t helpers = std::min<uint64_t>(static_cast<uint64_t>(num_threads_), chunks - 1);
    for (uint64_t i = 0; i < helpers; ++i) {
      try {
        group.Run(run_chunks);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kResourceExhausted) throw;
        break;  // no worker can start (a thread limit): the caller runs the chunks alone
      }
    }
    run_chunks();  // the caller works too: it never waits for workers that cannot come
    group.Wait();  // helpers not started yet find no chunk left (or run here if the pool paused)
  }
  // Every helper has finished (group.Wait above): no other thread touches `shared` now.
  std::exception_ptr error;
  {
    MutexLock lk(&shared.mu);
    error = shared.error;
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
  out.exit_waits = exit_waits_.load();
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
  s->paused = true;
  s->work_cv.NotifyAll();
  // Workers leave their loop when their task ends. Not waited for: this thread (a fork from one
  // of our tasks), workers that are themselves inside fork() waiting for this one (they cannot
  // finish first), and tasks that threads other than workers run for themselves (TryRunOne).
  bool drained = true;
  while (s->live > self + s->forking_workers) {
    if (!s->drain_cv.WaitUntil(&lk, wait_until)) {
      drained = s->live <= self + s->forking_workers;
      break;
    }
  }
  // Workers that left their loop are joined if their threads end in time. A thread that has not
  // ended is still running its thread_local destructors, and they take other libraries' locks
  // (tbbmalloc returns a thread's caches under its own: a fork in that moment handed the child a
  // held lock, and its first oneTBB algorithm spun for ever; tests/soak/fork_soak_test, about 1
  // fork in 25,000 under load). So the pool is drained only when every such thread has ended;
  // otherwise this attempt is rolled back like an unfinished task. The wait is bounded: those
  // destructors may themselves wait for the registry this fork holds (a thread_local pool or
  // AtForkRegistration), which the registry releases between attempts. The next Post, or the
  // destructor, joins what is left.
  // The same holds for workers that another thread is joining at this moment (a Post reaps the
  // workers a drain let go, and can win the pool's lock before this prepare does): wait for
  // those joins as well, with the same bound.
  const auto join_until =
      std::max(wait_until, std::chrono::steady_clock::now() + std::chrono::milliseconds(10));
  // A Post joins with a poll only and lists again the threads that have not ended: reap those
  // too once its join is over, or this drain would count them as gone.
  ReapExitedLocked(s, join_until);
  while (s->joining > 0) {
    bool joined = true;  // joining reached 0 before join_until
    while (s->joining != 0) {
      if (!s->drain_cv.WaitUntil(&lk, join_until)) {
        joined = s->joining == 0;
        break;
      }
    }
    if (!joined) break;
    ReapExitedLocked(s, join_until);
  }
  const int still_exiting = LeftNotJoinedLocked(s);
  if (drained && still_exiting == 0) {
    drained_this_fork_ = true;
    return true;
  }
  if (still_exiting > 0) exit_waits_.fetch_add(1, std::memory_order_relaxed);
  if (!last && std::chrono::steady_clock::now() < hard_deadline) {
    s->paused = false;  // roll back: let the workers go on until the next attempt
    s->work_cv.NotifyAll();
    return false;
  }
  drain_timeouts_.fetch_add(1, std::memory_order_relaxed);
  if (drained) {
    AtForkRegistry::ReportEvent(
        ForkEventKind::kDrainDeadlineExceeded, "thread_pool:" + options_.name,
        absl::StrCat(still_exiting,
                     " worker thread(s) still running their thread_local destructors after the "
                     "drain deadline of ",
                     options_.drain_deadline.count(),
                     " ms; the fork proceeds, and a lock those destructors hold (an allocator's, "
                     "say) may stay held in the child"));
    return true;
  }
  AtForkRegistry::ReportEvent(
      ForkEventKind::kDrainDeadlineExceeded, "thread_pool:" + options_.name,
      absl::StrCat(s->live - self - s->forking_workers,
                   " worker(s) still running a task after the drain deadline of ",
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
  s->paused = false;
  ReapExitedLocked(s, std::chrono::steady_clock::now() + std::chrono::milliseconds(10));
  // Workers come back at once only where queued tasks wait for them; otherwise on next Post.
  if (!s->queue.empty()) {
    try {
      EnsureWorkersLocked(s, num_threads_);
    } catch (...) {
      // Out of threads right now: the next Post() tries again.
    }
  }
  s->work_cv.NotifyAll();
}

void ThreadPool::ChildAfterFork() {
  // Abandon the parent's state: its mutexes may be held by threads that do not exist here and its
  // std::thread objects are joinable. Leaking it is the only safe choice (PyTorch's pthreadpool
  // does the same). A fresh state is built on first use.
  // Forked from a worker: the task keeps running on this thread and its loop then exits without
  // touching the abandoned state (it compares ForkGeneration()).
  state_.store(nullptr);
  drain_fork_ = 0;  // the child numbers its forks from 1 again (AtForkRegistry::fork_count)
  rebuilt_in_child_.store(1);
  forks_drained_.store(0);
  drain_timeouts_.store(0);
  exit_waits_.store(0);
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
