// Tests of ThreadPool and TaskGroup, alone and across fork().
#include "forksafe/runtime/thread_pool.h"

#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::runtime {
namespace {

using forksafe::testing::RunInChild;
using namespace std::chrono_literals;

bool HasEvent(const ForkReport& r, ForkEventKind kind) {
  for (const ForkEvent& e : r.events) {
    if (e.kind == kind) return true;
  }
  return false;
}

// Whether the fork went ahead with everything prepared: no event but "not yet, retried" (an
// attempt rolled back because a task took longer than one slice, which a loaded machine may
// cause, is how the drain works, not a failure).
bool PreparedFully(const ForkReport& r) {
  for (const ForkEvent& e : r.events) {
    if (e.kind != ForkEventKind::kPrepareRetried) return false;
  }
  return true;
}

// A gate a task waits on, opened by the test; the wait is bounded (30 s) so that a test whose
// fork waited for the task fails instead of hanging.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  void Open() {
    std::lock_guard<std::mutex> lk(mu);
    open = true;
    cv.notify_all();
  }
  bool WaitOpen() {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, 30s, [this] { return open; });
  }
};

TEST(ThreadPoolTest, SubmitReturnsResultsAndExceptions) {
  ThreadPool pool(ThreadPoolOptions{2, "t", 2000ms});
  EXPECT_EQ(pool.live_workers(), 0) << "workers must start lazily";
  auto f = pool.Submit([] { return 6 * 7; });
  EXPECT_EQ(f.get(), 42);
  auto g = pool.Submit([]() -> int { throw std::runtime_error("task failed"); });
  EXPECT_THROW(g.get(), std::runtime_error);
  pool.Post([] { throw std::logic_error("dropped"); });
  pool.Wait();
  ThreadPoolStats s = pool.stats();
  EXPECT_EQ(s.tasks_completed, 3u);
  EXPECT_EQ(s.task_exceptions, 1u);
  EXPECT_EQ(pool.live_workers(), 2);
}

TEST(ThreadPoolTest, BadArgumentsAreClearErrors) {
  EXPECT_THROW(ThreadPool(ThreadPoolOptions{-1, "x", 10ms}), Error);
  EXPECT_THROW(ThreadPool(ThreadPoolOptions{1, "x", -1ms}), Error);
  ThreadPool pool(ThreadPoolOptions{1, "x", 10ms});
  EXPECT_THROW(pool.Post(nullptr), Error);
  try {
    pool.ParallelFor(0, 10, 0, [](int64_t, int64_t) {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("grain"), std::string::npos);
  }
}

TEST(ThreadPoolTest, ParallelForCoversTheRangeOnce) {
  ThreadPool pool(ThreadPoolOptions{3, "pf", 2000ms});
  std::vector<std::atomic<int>> hits(10007);
  pool.ParallelFor(0, 10007, 100, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) hits[i].fetch_add(1);
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

TEST(ThreadPoolTest, NestedParallelForFromWorkersDoesNotDeadlock) {
  ThreadPool pool(ThreadPoolOptions{2, "nested", 2000ms});
  std::atomic<int64_t> sum{0};
  pool.ParallelFor(0, 8, 1, [&](int64_t lo, int64_t hi) {
    pool.ParallelFor(0, 100, 10, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) sum += i;
    });
  });
  EXPECT_EQ(sum.load(), 8 * 4950);
}

TEST(ThreadPoolTest, WaitFromAWorkerIsAnError) {
  ThreadPool pool(ThreadPoolOptions{1, "w", 2000ms});
  auto f = pool.Submit([&] {
    try {
      pool.Wait();
    } catch (const Error& e) {
      return e.code() == ErrorCode::kFailedPrecondition;
    }
    return false;
  });
  EXPECT_TRUE(f.get());
}

TEST(ThreadPoolTest, TaskGroupRethrowsFirstError) {
  ThreadPool pool(ThreadPoolOptions{2, "g", 2000ms});
  TaskGroup group(pool);
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) {
    group.Run([&, i] {
      ++ran;
      if (i == 3) throw std::runtime_error("three");
    });
  }
  EXPECT_THROW(group.Wait(), std::runtime_error);
  EXPECT_EQ(ran.load(), 10);
  group.Wait();  // the error is reported once
}

TEST(ThreadPoolTest, DestructorRunsQueuedTasks) {
  std::atomic<int> ran{0};
  {
    ThreadPool pool(ThreadPoolOptions{1, "d", 2000ms});
    for (int i = 0; i < 50; ++i) pool.Post([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 50);
}

TEST(ThreadPoolTest, RegistersAndUnregistersItsForkHandler) {
  auto* pool = new ThreadPool(ThreadPoolOptions{1, "reg", 10ms});
  EXPECT_TRUE(AtForkRegistry::Get().IsRegistered(pool));
  delete pool;
  EXPECT_FALSE(AtForkRegistry::Get().IsRegistered(pool));
}

// In-flight tasks finish before the fork; queued tasks stay with the parent and run after it;
// the child gets an empty, working pool.
TEST(ThreadPoolTest, ForkWhileBusyDrainsInFlightAndKeepsQueue) {
  ThreadPool pool(ThreadPoolOptions{2, "busy", 5000ms});
  std::atomic<int> started{0}, finished{0};
  std::atomic<bool> in_flight_at_fork{false};
  for (int i = 0; i < 40; ++i) {
    pool.Post([&] {
      ++started;
      std::this_thread::sleep_for(2ms);
      ++finished;
    });
  }
  while (started < 2) std::this_thread::sleep_for(100us);
  auto child = RunInChild(
      [&] {
        // In the child: nothing inherited runs, the queue is gone, and the pool works afresh.
        if (pool.queued() != 0) return 1;
        if (pool.live_workers() != 0) return 2;
        const int f = finished.load();
        std::this_thread::sleep_for(20ms);
        if (finished.load() != f) return 3;  // no parent task ran here
        auto r = pool.Submit([] { return 7; });
        if (r.get() != 7) return 4;
        std::atomic<int64_t> s{0};
        pool.ParallelFor(0, 1000, 10, [&](int64_t a, int64_t b) {
          for (int64_t i = a; i < b; ++i) s += i;
        });
        if (s != 499500) return 5;
        return pool.stats().rebuilt_in_child == 1 ? 0 : 6;
      },
      30s);
  // At the instant of the fork no task was in flight: started == finished then. The registry ran
  // our prepare, so check the counters it left.
  EXPECT_TRUE(child.ok()) << child.Describe();
  pool.Wait();
  EXPECT_EQ(finished.load(), 40) << "queued tasks must run in the parent after the fork";
  EXPECT_GE(pool.stats().forks_drained, 1u);
  EXPECT_EQ(pool.stats().drain_timeouts, 0u);
  (void)in_flight_at_fork;
}

TEST(ThreadPoolTest, NoTaskIsInFlightAtTheForkInstant) {
  ThreadPool pool(ThreadPoolOptions{2, "instant", 5000ms});
  std::atomic<int> in_flight{0};
  std::atomic<bool> stop{false};
  std::thread feeder([&] {
    while (!stop) {
      pool.Post([&] {
        ++in_flight;
        std::this_thread::sleep_for(200us);
        --in_flight;
      });
      std::this_thread::sleep_for(100us);
    }
  });
  for (int i = 0; i < 20; ++i) {
    // The child's copy of the counter shows what was running when the fork happened.
    auto child = RunInChild([&] { return in_flight.load() == 0 ? 0 : 1; }, 20s);
    ASSERT_TRUE(child.ok()) << "fork " << i << ": a task was in flight: " << child.Describe();
  }
  stop = true;
  feeder.join();
  pool.Wait();
}

TEST(ThreadPoolTest, ForkFromAWorkerDoesNotWaitForItself) {
  ThreadPool pool(ThreadPoolOptions{2, "self", 5000ms});
  std::atomic<int> other_tasks{0};
  for (int i = 0; i < 4; ++i)
    pool.Post([&] {
      std::this_thread::sleep_for(1ms);
      ++other_tasks;
    });
  auto result = pool.Submit([&] {
    return RunInChild(
        [&] {
          // The child runs on the thread that forked; a fresh pool works here.
          ThreadPool fresh(ThreadPoolOptions{2, "child", 1000ms});
          return fresh.Submit([] { return 1; }).get() == 1 ? 0 : 1;
        },
        20s);
  });
  auto child = result.get();
  EXPECT_TRUE(child.ok()) << child.Describe();
  pool.Wait();
  EXPECT_EQ(other_tasks.load(), 4);
  // Had the drain waited for the forking worker, it would have run into its deadline.
  EXPECT_TRUE(PreparedFully(AtForkRegistry::Get().LastReport()))
      << AtForkRegistry::Get().LastReport().ToString();
}

TEST(ThreadPoolTest, DefaultPoolWaitsForInFlightTasks) {
  std::atomic<bool> started{false}, done{false};
  ThreadPool::Default().Post([&] {
    started = true;
    std::this_thread::sleep_for(50ms);
    done = true;
  });
  while (!started) std::this_thread::sleep_for(100us);
  auto child = RunInChild([&] { return done.load() ? 0 : 1; }, 20s);
  EXPECT_TRUE(child.ok()) << "the default pool forked with a task in flight: " << child.Describe();
  EXPECT_TRUE(PreparedFully(AtForkRegistry::Get().LastReport()))
      << AtForkRegistry::Get().LastReport().ToString();
}

// A handler registered after the pool (so prepared before it) refuses the first attempt: the
// pool is first asked on attempt 2 and must still measure its deadline from this fork.
TEST(ThreadPoolTest, DrainDeadlineCountsFromThisForkEvenOnALaterAttempt) {
  // A deadline far beyond the task's 50 ms: only a deadline measured from a stale start (the
  // pool's construction, or no fork at all) runs out here, however loaded the machine.
  ThreadPool pool(ThreadPoolOptions{1, "late", 20000ms});
  int handle;
  AtForkHandler h;
  h.name = "refuses_once";
  h.prepare = [](const PrepareAttempt& a) { return a.number > 1; };
  AtForkRegistration reg(&handle, std::move(h));
  std::atomic<bool> started{false}, done{false};
  pool.Post([&] {
    started = true;
    std::this_thread::sleep_for(50ms);
    done = true;
  });
  while (!started) std::this_thread::sleep_for(100us);
  auto child = RunInChild([&] { return done.load() ? 0 : 1; }, 20s);
  EXPECT_TRUE(child.ok()) << child.Describe();
  EXPECT_EQ(pool.stats().drain_timeouts, 0u);
}

// The task blocks until the test opens its gate, after the child has run: the fork cannot wait
// for it to finish and must go ahead at the pool's deadline, reporting it. No clock is read.
TEST(ThreadPoolTest, TaskOutlivingTheDeadlineIsReportedAndForkProceeds) {
  ThreadPool pool(ThreadPoolOptions{1, "slow", 50ms});
  Gate gate;
  std::atomic<bool> started{false}, done{false}, gate_opened{false};
  pool.Post([&] {
    started = true;
    gate_opened = gate.WaitOpen();
    done = true;
  });
  while (!started) std::this_thread::sleep_for(100us);
  auto child = RunInChild(
      [&] {
        if (done.load()) return 1;  // the task had finished at the fork: it was waited for
        return pool.Submit([] { return 3; }).get() == 3 ? 0 : 2;
      },
      20s);
  gate.Open();
  EXPECT_TRUE(child.ok()) << child.Describe();
  ForkReport r = AtForkRegistry::Get().LastReport();
  EXPECT_TRUE(HasEvent(r, ForkEventKind::kDrainDeadlineExceeded)) << r.ToString();
  EXPECT_EQ(pool.stats().drain_timeouts, 1u);
  pool.Wait();
  EXPECT_TRUE(done.load());
  EXPECT_TRUE(gate_opened.load()) << "the task's gate stayed shut for 30 s: the fork waited for it";
  // And the pool still works in the parent.
  EXPECT_EQ(pool.Submit([] { return 5; }).get(), 5);
}

// A lock that a worker's thread_local destructor holds while its thread ends, the way tbbmalloc
// returns a thread's caches under its own locks; the destructor holds it until the test opens
// g_exit_gate.
std::mutex g_exit_mu;
Gate g_exit_gate;
struct SlowThreadExit {
  ~SlowThreadExit() {
    std::lock_guard<std::mutex> lk(g_exit_mu);
    g_exit_gate.WaitOpen();
  }
};
void UseSlowThreadExit() {
  thread_local SlowThreadExit on_exit;
  (void)&on_exit;
}

// The drain's join of a leaving worker is bounded by the pool's slice of the drain deadline (here
// 1 s): the pool must not count as drained while that thread still runs, or the child inherits
// g_exit_mu held (as it inherited tbbmalloc's lock, tests/soak/fork_soak_test). The thread's
// destructor ends only once attempt 2 has begun (a handler prepared before the pool opens the
// gate then), so attempt 1 must be rolled back and attempt 2 must join the thread.
TEST(ThreadPoolTest, AWorkerThreadEndsCompletelyBeforeTheFork) {
  ThreadPool pool(ThreadPoolOptions{1, "exit", 8000ms});
  int tag;
  AtForkHandler opener;
  opener.name = "opens_the_exit_gate";
  opener.prepare = [](const PrepareAttempt& a) {
    if (a.number >= 2) g_exit_gate.Open();
    return true;
  };
  AtForkRegistration reg(&tag, std::move(opener));  // registered after the pool: prepared before
  pool.Submit([] { UseSlowThreadExit(); }).get();
  auto child = RunInChild(
      [] {
        if (!g_exit_mu.try_lock()) return 1;  // held by a thread that does not exist here
        g_exit_mu.unlock();
        return 0;
      },
      30s);
  EXPECT_TRUE(child.ok()) << "the fork happened while a worker's thread_local destructor held a "
                             "lock: "
                          << child.Describe();
  EXPECT_GE(pool.stats().exit_waits, 1u) << "prepare never waited for the leaving thread";
  EXPECT_EQ(pool.stats().drain_timeouts, 0u);
  const ForkReport r = AtForkRegistry::Get().LastReport();
  EXPECT_FALSE(HasEvent(r, ForkEventKind::kDrainDeadlineExceeded)) << r.ToString();
  EXPECT_GE(r.attempts, 2) << "the first attempt should have been rolled back: " << r.ToString();
}

// Whether the kernel is tearing thread `tid` down (PF_EXITING in its flags, the 9th field of
// /proc/self/task/<tid>/stat): its user-space part has ended (a join has returned), and it lingers
// in /proc for a moment (longer under ThreadSanitizer).
bool KernelIsEnding(const char* tid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/task/%s/stat", tid);
  FILE* f = fopen(path, "r");
  if (f == nullptr) return true;  // gone meanwhile
  char buf[512] = {0};
  const size_t got = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  const char* p = static_cast<const char*>(memrchr(buf, ')', got));  // the name may hold spaces
  if (p == nullptr) return false;
  char state = 0;
  int ppid = 0, pgrp = 0, session = 0, tty = 0, tpgid = 0;
  unsigned long flags = 0;
  if (sscanf(p + 1, " %c %d %d %d %d %d %lu", &state, &ppid, &pgrp, &session, &tty, &tpgid,
             &flags) != 7) {
    return false;
  }
  return (flags & 0x4) != 0;  // PF_EXITING
}

// This process's threads that still run user code (entries of /proc/self/task, less those the
// kernel is tearing down).
int ThreadCount() {
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(d)) {
    if (e->d_name[0] != '.' && !KernelIsEnding(e->d_name)) ++n;
  }
  closedir(d);
  return n;
}

// A worker whose thread takes 2 ms to end (a thread_local destructor), as a thread that used
// tbbmalloc or another allocator with per-thread caches does.
struct ShortThreadExit {
  ~ShortThreadExit() { std::this_thread::sleep_for(2ms); }
};
void UseShortThreadExit() {
  thread_local ShortThreadExit on_exit;
  (void)&on_exit;
}

// The drain lets workers go at every fork; a Post on another thread may win the pool's lock
// first and take a leaving worker off the list to join it. The fork must still wait for that
// thread: a handler prepared after the pool (registered before it) counts the process's threads,
// and no worker may be among them. Before the fix, about 1 fork in 10 here went ahead with a
// worker thread still ending (and under load, 1 in 25,000 forks of fork_soak_test handed the
// child tbbmalloc's lock held by such a thread).
TEST(ThreadPoolTest, NoLeavingWorkerThreadIsAliveWhenTheDrainEnds) {
  const int baseline = ThreadCount();
  ASSERT_GT(baseline, 0) << "cannot read /proc/self/task";
  std::atomic<int> worst{0};
  int tag;
  AtForkHandler h;
  h.name = "thread_counter";
  h.prepare = [&worst](const PrepareAttempt&) {
    const int n = ThreadCount();
    int prev = worst.load();
    while (n > prev && !worst.compare_exchange_weak(prev, n)) {
    }
    return true;
  };
  AtForkRegistration counter(&tag, std::move(h));
  {
    ThreadPool pool(ThreadPoolOptions{2, "reaped", 5000ms});  // prepared before the counter
    std::atomic<bool> stop{false};
    std::thread feeder([&] {
      while (!stop) {
        pool.Post([] { UseShortThreadExit(); });
        std::this_thread::sleep_for(50us);
      }
    });
    for (int i = 0; i < 200; ++i) {
      auto child = RunInChild([] { return 0; }, 20s);
      ASSERT_TRUE(child.ok()) << "fork " << i << ": " << child.Describe();
    }
    stop = true;
    feeder.join();
    pool.Wait();
  }
  // At the counter's prepare: the threads of the baseline, and the feeder.
  EXPECT_LE(worst.load(), baseline + 1)
      << "a pool worker's thread was still alive when the pool's prepare returned";
}

// A worker whose thread_local destructor waits for a lock that the thread calling Post holds:
// Post must not wait for that worker's thread to end (it would wait for itself). Run in a child
// with a deadline, so that the deadlock, if any, is a failure and not a stuck suite.
std::mutex g_post_mu;
struct ExitNeedsPostersLock {
  ~ExitNeedsPostersLock() { std::lock_guard<std::mutex> lk(g_post_mu); }
};
TEST(ThreadPoolTest, PostDoesNotWaitForALeavingWorkerThatWaitsForItsCaller) {
  auto result = RunInChild(
      [] {
        ThreadPool pool(ThreadPoolOptions{1, "poster", 100ms});
        pool.Submit([] {
              thread_local ExitNeedsPostersLock on_exit;
              (void)&on_exit;
            })
            .get();
        std::unique_lock<std::mutex> held(g_post_mu);
        // The fork's drain lets the worker go; its destructor now waits for g_post_mu (held here).
        auto grandchild = RunInChild([] { return 0; }, 20s);
        if (!grandchild.ok()) return 2;
        // Post finds the leaving worker listed and must go on without joining it.
        if (pool.Submit([] { return 5; }).get() != 5) return 3;
        held.unlock();  // now the leaving worker can end
        pool.Wait();
        return 0;
      },
      20s, 20);
  EXPECT_TRUE(result.ok()) << "Post waited for a worker that waited for Post's caller: "
                           << result.Describe();
}

}  // namespace
}  // namespace forksafe::runtime
