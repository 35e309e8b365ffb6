// examples/tiny_pool.h: a framework's own thread pool (threads + a condition variable), made
// fork-safe with runtime/foreign_pool.h. The fork-specific part is the three callbacks at the
// bottom and the guard member; the rest is an ordinary pool.
//
//   park     pause intake, wait until no task runs, then stop the threads and join them; none
//            exists at the fork, so no condition variable has a waiter there. Every wait is
//            bounded by the attempt (PrepareAttempt::wait_until), as the at-fork protocol asks
//            of every prepare (runtime/at_fork.h), the join included: a thread is joined with
//            pthread_tryjoin_np until the deadline (std::thread has no timed join, which is why
//            this pool runs pthreads). When the deadline passes (a task still runs, or a thread
//            that was told to stop has not ended: its thread_local destructors may block, say)
//            park undoes what it did and says "not yet": the registry retries, and on its last
//            attempt lets the fork go ahead unparked, reports it (kPrepareGaveUp) and tells the
//            child (rebuild with parked == false). A thread told to stop is never asked back: it
//            is joined by a later park or the destructor, and fresh threads start on demand.
//            Park returns with the pool's mutex held, so that no other thread (a Submit) is
//            inside it at the fork (released at the end of park, a busy feeder's Submit took it
//            in the moment before the fork and children hung: TinyPoolForkedWhileBusy, first
//            version).
//   resume   the parent un-pauses and unlocks; threads start again (now if tasks are queued,
//            else on the next Submit).
//   rebuild  the child unlocks, drops the tasks queued in the parent (they stay the parent's),
//            and starts its own threads on its first Submit. If the fork went ahead unparked,
//            the old state may be locked by a thread that does not exist in the child: it is
//            abandoned, never touched, and a fresh one built.
//
// Not handled, to stay small: a task that forks (park would wait for its own thread until the
// registry's deadline; see "Hazards" in runtime/foreign_pool.h). The destructor joins without a
// bound, as any pool's does (it is not a fork callback).
#ifndef FORKSAFE_EXAMPLES_TINY_POOL_H_
#define FORKSAFE_EXAMPLES_TINY_POOL_H_

#include <errno.h>
#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
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
        std::move(name), [this](const forksafe::runtime::PrepareAttempt& a) { return Park(a); },
        [this] { Resume(); }, [this](bool parked) { RebuildInChild(parked); }});
  }

  ~TinyPool() {
    guard_.reset();  // unregister first: no fork may park a pool that is going away
    std::vector<pthread_t> threads;
    {
      std::lock_guard<std::mutex> lk(s_->mu);
      s_->exit = true;
      threads.swap(s_->threads);
      threads.insert(threads.end(), s_->leaving.begin(), s_->leaving.end());
      s_->leaving.clear();
    }
    s_->work_cv.notify_all();
    for (pthread_t t : threads) pthread_join(t, nullptr);
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
    std::condition_variable work_cv;  // a task was queued, intake resumed, retire or exit
    std::condition_variable idle_cv;  // a task finished
    std::deque<std::function<void()>> queue;
    std::vector<pthread_t> threads;  // running the loop
    std::vector<pthread_t> leaving;  // told to stop, not joined yet
    int running = 0;
    uint64_t generation = 0;  // of the threads started now; older ones leave their loop
    bool paused = false;      // from park until resume/rebuild: no task starts
    bool exit = false;        // the pool is going away: every thread leaves its loop
  };

  struct Start {
    State* s;
    uint64_t generation;
  };

  void StartThreadsLocked() {
    while (!s_->paused && !s_->exit && static_cast<int>(s_->threads.size()) < n_) {
      pthread_t t;
      auto* start = new Start{s_, s_->generation};
      const int rc = pthread_create(&t, nullptr, &ThreadMain, start);
      if (rc != 0) {
        delete start;
        if (s_->threads.empty()) throw std::system_error(rc, std::generic_category(), "TinyPool");
        return;  // fewer threads than asked: the ones there run the tasks
      }
      s_->threads.push_back(t);
    }
  }

  static void* ThreadMain(void* arg) {
    const Start start = *static_cast<Start*>(arg);
    delete static_cast<Start*>(arg);
    Loop(start.s, start.generation);
    return nullptr;
  }

  static void Loop(State* s, uint64_t generation) {
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
      s->work_cv.wait(lk, [&] {
        return s->exit || s->generation != generation || (!s->paused && !s->queue.empty());
      });
      if (s->exit || s->generation != generation) return;  // the pool stopped this thread
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

  // Joins the threads of `leaving` (told to stop), waiting at most until `until`; those that
  // have not ended by then stay in it.
  static void JoinUntil(std::vector<pthread_t>& leaving,
                        std::chrono::steady_clock::time_point until) {
    for (;;) {
      for (size_t i = 0; i < leaving.size();) {
        if (pthread_tryjoin_np(leaving[i], nullptr) == 0) {
          leaving.erase(leaving.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;  // EBUSY: still running (its task's end, its thread_local destructors)
        }
      }
      if (leaving.empty() || std::chrono::steady_clock::now() >= until) return;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // ---- the fork-specific part --------------------------------------------------------------

  bool Park(const forksafe::runtime::PrepareAttempt& attempt) {
    if (!forksafe::runtime::LockForFork(s_->mu, attempt)) return false;  // bounded, like all
    std::unique_lock<std::mutex> lk(s_->mu, std::adopt_lock);
    s_->paused = true;
    const auto undo = [&] {  // "not yet": the registry retries after a back-off
      s_->paused = false;
      if (!s_->queue.empty()) StartThreadsLocked();  // in place of those told to stop
      s_->work_cv.notify_all();
      return false;
    };
    if (!s_->idle_cv.wait_until(lk, attempt.wait_until, [this] { return s_->running == 0; })) {
      return undo();  // a task still runs
    }
    // Every thread is idle: tell them all to stop (each wakes, sees a newer generation and
    // returns), and join them, all by the same deadline.
    ++s_->generation;
    std::vector<pthread_t> leaving;
    leaving.swap(s_->leaving);  // stopped by an earlier attempt, not ended then
    leaving.insert(leaving.end(), s_->threads.begin(), s_->threads.end());
    s_->threads.clear();
    s_->work_cv.notify_all();
    lk.unlock();  // the stopping threads take it on their way out
    JoinUntil(leaving, attempt.wait_until);
    lk.lock();
    if (!leaving.empty()) {  // a thread has not ended by the deadline: a later park joins it
      s_->leaving.insert(s_->leaving.end(), leaving.begin(), leaving.end());
      return undo();
    }
    lk.release();  // held across the fork: no other thread (a Submit) is inside it there
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
