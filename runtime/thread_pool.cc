#include "forksafe/runtime/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <list>
#include <new>
#include <optional>
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
    bool exited = false;  // guarded by mu
  };

  std::mutex mu;
  std::condition_variable work_cv;   // workers wait for tasks
  std::condition_variable drain_cv;  // prepare waits for workers to leave
  std::condition_variable idle_cv;   // Wait() waits for an empty, idle pool
  std::deque<std::function<void()>> queue;
  std::list<Worker> workers;
  int live = 0;     // workers inside WorkerLoop
  int running = 0;  // tasks in flight (on workers and on threads that help)
  int forking_workers = 0;  // workers inside fork(), waiting for another thread's fork
  // Workers that left their loop and that some thread took off `workers` to join, not yet
  // joined: their threads may still be running thread_local destructors. A drain is complete only
  // when this is 0 too (a Post on another thread may be joining a worker the drain let go).
  int joining = 0;
  bool paused = false;
  bool stopping = false;
  uint64_t generation = ForkGeneration();
  uint64_t tasks_completed = 0;
  uint64_t task_exceptions = 0;
};

}  // namespace internal

namespace {

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
  std::unique_lock<std::mutex> lk(s->mu);
  for (;;) {
    s->work_cv.wait(lk, [s] { return s->paused || s->stopping || !s->queue.empty(); });
    if (s->paused || s->queue.empty()) break;  // paused for a fork, or stopping with no work
    std::function<void()> task = std::move(s->queue.front());
    s->queue.pop_front();
    ++s->running;
    lk.unlock();
    const bool threw = RunTask(std::move(task));
    if (ForkGeneration() != s->generation) {
      // This thread forked from inside the task and is now the only thread of a child: the
      // state belongs to the parent. Touch nothing; ending the thread is all that is left.
      t_worker_state = nullptr;
      return;
    }
    lk.lock();
    --s->running;
    ++s->tasks_completed;
    if (threw) ++s->task_exceptions;
    if (s->running == 0 && s->queue.empty()) s->idle_cv.notify_all();
    if (s->paused) s->drain_cv.notify_all();
  }
  --s->live;
  self->exited = true;
  s->drain_cv.notify_all();
  t_worker_state = nullptr;
}

// Starts workers up to `target`. Requires s->mu held, and keeps it held (never unlocks).
void EnsureWorkersLocked(PoolState* s, int target, std::unique_lock<std::mutex>& lk) {
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

// Joins and forgets workers that have left their loop. Requires lk held; releases it meanwhile.
// With `until` (inside a fork callback, the registry held) a worker whose thread has not ended by
// then is left for a later call: its thread_local destructors may be waiting for the registry
// (an AtForkRegistration, a thread_local pool), and an unbounded join would deadlock the fork.
// Returns how many such threads are still running.
int ReapExitedLocked(PoolState* s, std::unique_lock<std::mutex>& lk,
                     std::optional<std::chrono::steady_clock::time_point> until = std::nullopt) {
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
  s->joining += taken;
  lk.unlock();
  std::vector<std::thread> later;
  for (std::thread& t : done) {
    if (!t.joinable()) continue;
    if (!until.has_value()) {
      t.join();
    } else if (!JoinIfEndedBy(t, *until)) {
      later.push_back(std::move(t));
    }
  }
  lk.lock();
  s->joining -= taken;
  for (std::thread& t : later) {
    s->workers.emplace_back();
    s->workers.back().thread = std::move(t);
    s->workers.back().exited = true;
  }
  if (s->paused) s->drain_cv.notify_all();
  return static_cast<int>(later.size());
}

// Workers that left their loop and whose threads are not joined yet: listed, or being joined by
// another thread. Requires s->mu held.
int LeftNotJoinedLocked(const PoolState* s) {
  int n = s->joining;
  for (const PoolState::Worker& w : s->workers) n += w.exited ? 1 : 0;
  return n;
}

// The registry's fork-entry hooks (runtime/internal/fork_entry.h): a worker inside fork(), waiting
// for another thread's fork, is not waited for by that fork's drain.
void OnForkEntering() {
  PoolState* s = t_worker_state;
  if (s == nullptr || ForkGeneration() != s->generation) return;
  std::lock_guard<std::mutex> lk(s->mu);
  ++s->forking_workers;
  s->drain_cv.notify_all();
}

void OnForkEntered() {
  PoolState* s = t_worker_state;
  if (s == nullptr || ForkGeneration() != s->generation) return;
  std::lock_guard<std::mutex> lk(s->mu);
  --s->forking_workers;
}

}  // namespace

ThreadPool::ThreadPool(ThreadPoolOptions options) : options_(std::move(options)) {
  if (options_.num_threads < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ThreadPoolOptions::num_threads must be >= 0 (0 = one per CPU this process may use), got ",
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
    std::unique_lock<std::mutex> lk(s->mu);
    s->stopping = true;
    s->paused = false;
    // Make sure queued work still has a worker to run it.
    if (!s->queue.empty() && s->live == 0) {
      s->stopping = false;
      EnsureWorkersLocked(s, 1, lk);
      s->stopping = true;
    }
    s->work_cv.notify_all();
  }
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lk(s->mu);
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
  std::unique_lock<std::mutex> lk(s->mu);
  // Workers that left at a fork and could not be joined then: every listed worker is live or left.
  // Joined only if their threads have ended: a thread still in its thread_local destructors may
  // wait for a lock this caller holds, and an unbounded join here would deadlock. The others
  // stay listed for a later Post, a fork's drain or the destructor.
  if (s->workers.size() > static_cast<size_t>(s->live)) {
    ReapExitedLocked(s, lk, std::chrono::steady_clock::now());
  }
  if (s->stopping) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("pool \"", options_.name, "\" is being destroyed; no new tasks"));
  }
  s->queue.push_back(std::move(fn));
  try {
    EnsureWorkersLocked(s, num_threads_, lk);
  } catch (...) {
    // No worker could start and none runs: the task is refused, so it must not run later (its
    // caller may unwind and free what it refers to). EnsureWorkersLocked keeps the lock held.
    s->queue.pop_back();
    throw;
  }
  s->work_cv.notify_one();
}

bool ThreadPool::TryRunOne() {
  PoolState* s = State();
  std::function<void()> task;
  {
    std::lock_guard<std::mutex> lk(s->mu);
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
  std::lock_guard<std::mutex> lk(s->mu);
  --s->running;
  ++s->tasks_completed;
  if (threw) ++s->task_exceptions;
  if (s->running == 0 && s->queue.empty()) s->idle_cv.notify_all();
  if (s->paused) s->drain_cv.notify_all();
  return true;
}

void ThreadPool::Wait() {
  if (OnThisPoolsWorker()) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("ThreadPool::Wait called from a worker of pool \"", options_.name,
                             "\" would wait for itself; use a TaskGroup instead"));
  }
  PoolState* s = State();
  std::unique_lock<std::mutex> lk(s->mu);
  s->idle_cv.wait(lk, [s] { return s->queue.empty() && s->running == 0; });
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
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ParallelFor over [", begin, ", ", end, ") in chunks of ", grain,
                             " would make ", chunks, " chunks, more than the limit of ",
                             kParallelForMaxChunks,
                             " (one call of the body each); raise the grain to at least ",
                             span / kParallelForMaxChunks +
                                 (span % kParallelForMaxChunks != 0 ? 1 : 0)));
  }
  // Chunks are handed out from one counter, so memory does not grow with their number: the
  // calling thread and up to num_threads() helper tasks take the next chunk until none is left.
  struct Shared {
    std::atomic<uint64_t> next{0};
    std::mutex mu;
    std::exception_ptr error;  // the first one, guarded by mu
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
        std::lock_guard<std::mutex> lk(shared.mu);
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
  if (shared.error) std::rethrow_exception(shared.error);
}

int ThreadPool::live_workers() const {
  PoolState* s = state_.load();
  if (s == nullptr) return 0;
  std::lock_guard<std::mutex> lk(s->mu);
  return s->live;
}

size_t ThreadPool::queued() const {
  PoolState* s = state_.load();
  if (s == nullptr) return 0;
  std::lock_guard<std::mutex> lk(s->mu);
  return s->queue.size();
}

ThreadPoolStats ThreadPool::stats() const {
  ThreadPoolStats out;
  PoolState* s = state_.load();
  if (s != nullptr) {
    std::lock_guard<std::mutex> lk(s->mu);
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

  std::unique_lock<std::mutex> lk(s->mu);
  s->paused = true;
  s->work_cv.notify_all();
  // Workers leave their loop when their task ends. Not waited for: this thread (a fork from one
  // of our tasks), workers that are themselves inside fork() waiting for this one (they cannot
  // finish first), and tasks that threads other than workers run for themselves (TryRunOne).
  const bool drained = s->drain_cv.wait_until(
      lk, wait_until, [s, self] { return s->live <= self + s->forking_workers; });
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
  ReapExitedLocked(s, lk, join_until);
  while (s->joining > 0 &&
         s->drain_cv.wait_until(lk, join_until, [s] { return s->joining == 0; })) {
    ReapExitedLocked(s, lk, join_until);
  }
  const int still_exiting = LeftNotJoinedLocked(s);
  if (drained && still_exiting == 0) {
    drained_this_fork_ = true;
    return true;
  }
  if (still_exiting > 0) exit_waits_.fetch_add(1, std::memory_order_relaxed);
  if (!last && std::chrono::steady_clock::now() < hard_deadline) {
    s->paused = false;  // roll back: let the workers go on until the next attempt
    s->work_cv.notify_all();
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
  std::unique_lock<std::mutex> lk(s->mu);
  s->paused = false;
  ReapExitedLocked(s, lk, std::chrono::steady_clock::now() + std::chrono::milliseconds(10));
  // Workers come back at once only where queued tasks wait for them; otherwise on next Post.
  if (!s->queue.empty()) {
    try {
      EnsureWorkersLocked(s, num_threads_, lk);
    } catch (...) {
      // Out of threads right now: the next Post() tries again.
    }
  }
  s->work_cv.notify_all();
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
    std::lock_guard<std::mutex> lk(mu_);
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
      std::lock_guard<std::mutex> lk(mu_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) cv_.notify_all();
    });
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    --pending_;
    throw;
  }
}

void TaskGroup::Wait() {
  if (ForkGeneration() != generation_) {
    // Forked from inside one of this group's tasks (or while it ran): its other tasks stayed in
    // the parent and will never finish here.
    throw Error(ErrorCode::kFailedPrecondition,
                "a TaskGroup (or ParallelFor) of the parent cannot be waited for in a forked child: "
                "its tasks run in the parent; call _exit() or exec from the task that forked");
  }
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (pending_ == 0) break;
    }
    if (pool_.TryRunOne()) continue;
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, std::chrono::milliseconds(1), [this] { return pending_ == 0; });
  }
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lk(mu_);
    err = std::exchange(error_, nullptr);
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace forksafe::runtime
