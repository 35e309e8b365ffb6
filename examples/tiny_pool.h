// examples/tiny_pool.h: a framework's own thread pool (std::thread + a condition variable), made
// fork-safe with runtime/foreign_pool.h. The fork-specific part is the three callbacks at the
// bottom and the guard member; the rest is an ordinary pool.
//
//   park     pause intake, wait (bounded) until no task runs, then stop and join the threads;
//            none exists at the fork, so no condition variable has a waiter there. It returns
//            with the pool's mutex held, so that no other thread (a Submit) is inside it at the
//            fork (released at the end of park, a busy feeder's Submit took it in the moment
//            before the fork and children hung: TinyPoolForkedWhileBusy, first version).
//   resume   the parent un-pauses and unlocks; threads start again (now if tasks are queued,
//            else on the next Submit).
//   rebuild  the child unlocks, drops the tasks queued in the parent (they stay the parent's),
//            and starts its own threads on its first Submit. If the fork went ahead unparked (a
//            task outlived the registry's deadline), the old state may be locked by a thread that
//            does not exist in the child: it is abandoned, never touched, and a fresh one built.
//
// Not handled, to stay small: a task that forks (park would wait for its own thread until the
// registry's deadline; see "Hazards" in runtime/foreign_pool.h).
#ifndef FORKSAFE_EXAMPLES_TINY_POOL_H_
#define FORKSAFE_EXAMPLES_TINY_POOL_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/foreign_pool.h"

namespace tiny {

class TinyPool {
 public:
  explicit TinyPool(int threads, std::string name = "tiny") : n_(threads) {
    guard_.emplace(forksafe::runtime::ForeignPoolCallbacks{
        std::move(name),
        [this](const forksafe::runtime::PrepareAttempt& a) { return Park(a); },
        [this] { Resume(); },
        [this](bool parked) { RebuildInChild(parked); }});
  }

  ~TinyPool() {
    guard_.reset();  // unregister first: no fork may park a pool that is going away
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lk(s_->mu);
      s_->exit = true;
      threads.swap(s_->threads);
    }
    s_->work_cv.notify_all();
    for (std::thread& t : threads) t.join();
    delete s_;  // queued tasks that never ran are dropped
  }

  TinyPool(const TinyPool&) = delete;
  TinyPool& operator=(const TinyPool&) = delete;

  void Submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->queue.push_back(std::move(task));
    StartThreadsLocked();
    s_->work_cv.notify_one();
  }

  /// Waits at most `limit` until no task is queued or running; returns whether that happened.
  bool WaitIdle(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lk(s_->mu);
    return s_->idle_cv.wait_for(lk, limit,
                                [this] { return s_->queue.empty() && s_->running == 0; });
  }

  int live_threads() const {
    std::lock_guard<std::mutex> lk(s_->mu);
    return static_cast<int>(s_->threads.size());
  }

  const forksafe::runtime::ForeignPoolGuard& fork_guard() const { return *guard_; }

 private:
  struct State {
    mutable std::mutex mu;
    std::condition_variable work_cv;  // a task was queued, intake resumed, or exit
    std::condition_variable idle_cv;  // a task finished
    std::deque<std::function<void()>> queue;
    std::vector<std::thread> threads;
    int running = 0;
    bool paused = false;  // from park until resume/rebuild: no task starts
    bool exit = false;    // the threads leave their loop
  };

  void StartThreadsLocked() {
    while (!s_->paused && !s_->exit && static_cast<int>(s_->threads.size()) < n_) {
      s_->threads.emplace_back([s = s_] { Loop(s); });
    }
  }

  static void Loop(State* s) {
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
      s->work_cv.wait(lk, [s] { return s->exit || (!s->paused && !s->queue.empty()); });
      if (s->exit) return;
      std::function<void()> task = std::move(s->queue.front());
      s->queue.pop_front();
      ++s->running;
      lk.unlock();
      task();
      task = nullptr;  // the task's captures go before the count says it is done
      lk.lock();
      --s->running;
      s->idle_cv.notify_all();
    }
  }

  // ---- the fork-specific part --------------------------------------------------------------

  bool Park(const forksafe::runtime::PrepareAttempt& attempt) {
    if (!forksafe::runtime::LockForFork(s_->mu, attempt)) return false;  // bounded, like all
    std::unique_lock<std::mutex> lk(s_->mu, std::adopt_lock);
    s_->paused = true;
    if (!s_->idle_cv.wait_until(lk, attempt.wait_until, [this] { return s_->running == 0; })) {
      s_->paused = false;  // "not yet": undo, the registry retries after a back-off
      s_->work_cv.notify_all();
      return false;
    }
    s_->exit = true;  // every thread is idle: each wakes, sees exit and returns at once
    std::vector<std::thread> threads;
    threads.swap(s_->threads);
    lk.unlock();
    s_->work_cv.notify_all();
    for (std::thread& t : threads) t.join();
    lk.lock();
    s_->exit = false;  // still paused until resume or rebuild
    lk.release();      // held across the fork: no other thread (a Submit) is inside it there
    return true;
  }

  void Resume() {  // on the forking thread, which holds the mutex since Park
    std::lock_guard<std::mutex> lk(s_->mu, std::adopt_lock);
    s_->paused = false;
    if (!s_->queue.empty()) StartThreadsLocked();  // else on the next Submit
  }

  void RebuildInChild(bool parked) {
    if (!parked) {
      s_ = new State();  // the old one may be locked by a vanished thread: abandoned, not freed
      return;
    }
    std::lock_guard<std::mutex> lk(s_->mu, std::adopt_lock);  // held since Park, by this thread
    s_->queue.clear();   // the parent's tasks stay in the parent
    s_->paused = false;  // no thread exists: they start on the first Submit
  }

  int n_;
  State* s_ = new State();
  std::optional<forksafe::runtime::ForeignPoolGuard> guard_;
};

}  // namespace tiny

#endif  // FORKSAFE_EXAMPLES_TINY_POOL_H_
