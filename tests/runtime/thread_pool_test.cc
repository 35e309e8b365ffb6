// Tests of ThreadPool and TaskGroup, alone and across fork().
#include "forksafe/runtime/thread_pool.h"

#include <dirent.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/tbb_fork.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"
#include "tests/support/workloads.h"

namespace forksafe::runtime {
namespace {

using forksafe::testing::RunInChild;
using namespace std::chrono_literals;

// Waits (at most 20 s) until `done()` holds. A test whose threads must be stopped and joined cannot
// return early from an ASSERT, so a wait that never ends aborts with `what` instead: a hang of the
// code under test becomes a failure with a message, never a stuck test.
template <class Done>
void WaitOrAbort(Done done, const char* what) {
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) {
      std::fprintf(stderr, "thread_pool_test: gave up after 20 s waiting for %s\n", what);
      std::abort();
    }
    std::this_thread::sleep_for(100us);
  }
}

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

pid_t Tid() { return static_cast<pid_t>(syscall(SYS_gettid)); }

// Workers park across a fork instead of ending: no thread_local destructor runs at the fork (one
// that held a lock, as tbbmalloc's do, used to make the drain wait for the thread's end), the
// same worker thread goes on in the parent, and the child can take the lock.
TEST(ThreadPoolTest, WorkersStayParkedAcrossAForkAndNoThreadEndsThere) {
  ThreadPool pool(ThreadPoolOptions{1, "exit", 8000ms});
  const pid_t before = pool.Submit([] {
                             UseSlowThreadExit();
                             return Tid();
                           })
                           .get();
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
  EXPECT_EQ(pool.live_workers(), 1) << "a fork must leave the workers alive";
  EXPECT_EQ(pool.Submit([] { return Tid(); }).get(), before) << "the worker was re-created";
  EXPECT_EQ(pool.stats().exit_waits, 0u);
  EXPECT_EQ(pool.stats().drain_timeouts, 0u);
  EXPECT_GE(pool.stats().forks_drained, 1u);
  const ForkReport r = AtForkRegistry::Get().LastReport();
  EXPECT_FALSE(HasEvent(r, ForkEventKind::kDrainDeadlineExceeded)) << r.ToString();
  g_exit_gate.Open();  // the worker's thread ends in the pool's destructor
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

// Forks while a feeder keeps the pool busy: the workers are parked at each fork, never let go and
// started again. A handler prepared after the pool (registered before it) counts the process's
// threads: the baseline, the feeder and the two workers, never more (a thread ending or starting
// around the fork would show). The tasks see at most two distinct worker threads (kernel thread
// ids, which are not reused at once) over 200 forks: the workers were never re-created.
TEST(ThreadPoolTest, WorkersAreParkedNotRecreatedAcrossForks) {
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
  std::mutex tids_mu;
  std::set<pid_t> tids;
  {
    ThreadPool pool(ThreadPoolOptions{2, "parked", 5000ms});  // prepared before the counter
    std::atomic<bool> stop{false};
    std::thread feeder([&] {
      while (!stop) {
        pool.Post([&] {
          UseShortThreadExit();
          std::lock_guard<std::mutex> lk(tids_mu);
          tids.insert(Tid());
        });
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
    EXPECT_EQ(pool.live_workers(), 2);
    EXPECT_EQ(pool.stats().exit_waits, 0u);
  }
  EXPECT_LE(tids.size(), 2u) << "workers were started again after forks";
  EXPECT_LE(worst.load(), baseline + 3)
      << "more threads than the baseline, the feeder and the two workers at a fork";
}

// A worker whose thread_local destructor waits for a lock that the thread calling Post holds: no
// fork and no Post may wait for that worker's thread to end (it would wait for itself; workers
// park across forks and end only in the destructor). Run in a child with a deadline, so that the
// deadlock, if any, is a failure and not a stuck suite.
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
        // The fork parks the worker (its thread does not end: its destructor would wait for
        // g_post_mu, held here).
        auto grandchild = RunInChild([] { return 0; }, 20s);
        if (!grandchild.ok()) return 2;
        // Post finds the parked worker and goes on with it.
        if (pool.Submit([] { return 5; }).get() != 5) return 3;
        held.unlock();  // now the worker can end (in the pool's destructor)
        pool.Wait();
        return 0;
      },
      20s, 20);
  EXPECT_TRUE(result.ok()) << "Post waited for a worker that waited for Post's caller: "
                           << result.Describe();
}

// The peers' workload 6: forks while another thread runs ParallelFor on the workers. Every fork
// completes, every ParallelFor of the parent sums right, the child's ParallelFor works on a
// fresh pool, and the parent's workers are never re-created.
TEST(ThreadPoolTest, ForksWhileAParallelForRunsOnTheWorkers) {
  ThreadPool pool(ThreadPoolOptions{2, "busy_pf", 5000ms});
  constexpr int64_t kN = 1 << 16;
  auto sum_to = [&pool](int64_t n) {
    std::atomic<int64_t> sum{0};
    pool.ParallelFor(0, n, n / 16, [&](int64_t lo, int64_t hi) {
      int64_t s = 0;
      for (int64_t i = lo; i < hi; ++i) s += i;
      sum += s;
    });
    return sum.load();
  };
  ASSERT_EQ(sum_to(kN), kN * (kN - 1) / 2);
  std::atomic<bool> stop{false};
  std::atomic<int> rounds{0}, wrong{0};
  std::thread busy([&] {
    while (!stop) {
      if (sum_to(kN) != kN * (kN - 1) / 2) ++wrong;
      ++rounds;
    }
  });
  WaitOrAbort([&] { return rounds >= 3; }, "the busy thread's first ParallelFor rounds");
  for (int i = 0; i < 20; ++i) {
    auto child = RunInChild(
        [&] {
          if (pool.live_workers() != 0) return 1;
          if (sum_to(1000) != 499500) return 2;
          if (pool.Submit([] { return 42; }).get() != 42) return 3;
          return pool.stats().rebuilt_in_child == 1 ? 0 : 4;
        },
        20s);
    ASSERT_TRUE(child.ok()) << "fork " << i << ": " << child.Describe();
  }
  const int at_end = rounds.load();
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (rounds.load() < at_end + 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(100us);
  }
  stop = true;
  busy.join();
  EXPECT_GE(rounds.load(), at_end + 2) << "the busy thread's ParallelFor stopped after the forks";
  EXPECT_EQ(wrong.load(), 0) << "a ParallelFor of the parent summed wrong";
  EXPECT_EQ(pool.live_workers(), 2) << "the workers must stay alive across the forks";
  EXPECT_EQ(pool.stats().drain_timeouts, 0u);
  EXPECT_GE(pool.stats().forks_drained, 20u);
}

// The drain waits for one grain of a ParallelFor, not for the whole loop: the pool's one worker
// runs a helper through 1 ms grains while the calling thread is held in its first chunk (a gate
// opened after the fork). Waiting for the helper's whole task would let it run every other chunk
// first; parked between two chunks, the fork sees most of the loop still to do. After the fork
// the helper resumes and the loop completes, each chunk once.
TEST(ThreadPoolTest, AForkParksAParallelForHelperBetweenTwoGrains) {
  ThreadPool pool(ThreadPoolOptions{1, "grains", 20000ms});
  constexpr int64_t kChunks = 2000;
  Gate caller_gate;
  std::atomic<bool> fast{false};
  std::atomic<int64_t> done{0}, helper_done{0};
  std::vector<std::atomic<int>> hits(kChunks);
  std::thread::id caller_id;
  std::atomic<bool> caller_ready{false};
  std::thread caller([&] {
    caller_id = std::this_thread::get_id();
    caller_ready = true;
    pool.ParallelFor(0, kChunks, 1, [&](int64_t lo, int64_t hi) {
      if (std::this_thread::get_id() == caller_id) {
        caller_gate.WaitOpen();  // the caller's first chunk waits for the fork
      } else {
        if (!fast) std::this_thread::sleep_for(1ms);
        ++helper_done;
      }
      for (int64_t i = lo; i < hi; ++i) hits[i].fetch_add(1);
      ++done;
    });
  });
  WaitOrAbort([&] { return caller_ready && helper_done >= 3; },
              "the caller and its helper's first grains");
  auto child = RunInChild(
      [&] {
        // The child's copy of the counter: the chunks done when the fork happened.
        if (done.load() >= kChunks - 1) return 1;  // the fork waited for the helper's whole loop
        std::atomic<int64_t> s{0};
        pool.ParallelFor(0, 100, 10, [&](int64_t lo, int64_t hi) { s += hi - lo; });
        return s == 100 ? 0 : 2;
      },
      30s);
  fast = true;
  caller_gate.Open();
  caller.join();
  EXPECT_TRUE(child.ok()) << "the drain waited for the whole ParallelFor: " << child.Describe();
  EXPECT_EQ(done.load(), kChunks);
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  EXPECT_EQ(pool.live_workers(), 1);
  EXPECT_EQ(pool.stats().drain_timeouts, 0u);
  EXPECT_TRUE(PreparedFully(AtForkRegistry::Get().LastReport()))
      << AtForkRegistry::Get().LastReport().ToString();
}

// A helper that runs nested inside another task never parks mid-loop: the pool's one worker
// runs a task that holds a user mutex and picks up another thread's ParallelFor helper (TryRunOne,
// as TaskGroup::Wait and ParallelFor do from a worker). The fork comes while that helper runs
// chunks; it must wait for the whole outer task, so the child never sees the mutex held.
TEST(ThreadPoolTest, ANestedParallelForHelperIsNotParkedMidTask) {
  ThreadPool pool(ThreadPoolOptions{1, "nested_helper", 20000ms});
  static std::mutex user_mu;
  constexpr int64_t kChunks = 200;
  std::atomic<bool> outer_holds{false}, nested_ran{false};
  std::atomic<int64_t> sum{0}, nested_chunks{0};
  std::thread::id worker_id;
  pool.Post([&] {
    worker_id = std::this_thread::get_id();
    std::lock_guard<std::mutex> lk(user_mu);
    outer_holds = true;
    // Wait (bounded) for the other thread's helper to be queued, then run it nested here.
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (pool.queued() == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(100us);
    }
    nested_ran = pool.TryRunOne();
  });
  WaitOrAbort([&] { return outer_holds.load(); }, "the outer task to take the user mutex");
  std::thread caller([&] {
    pool.ParallelFor(0, kChunks, 1, [&](int64_t lo, int64_t hi) {
      std::this_thread::sleep_for(1ms);
      if (std::this_thread::get_id() == worker_id) ++nested_chunks;
      sum += hi - lo;
    });
  });
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (nested_chunks < 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(100us);
  }
  auto child = RunInChild(
      [] {
        if (!user_mu.try_lock()) return 1;  // held by the worker's outer task at the fork
        user_mu.unlock();
        return 0;
      },
      30s);
  caller.join();
  pool.Wait();
  EXPECT_TRUE(child.ok()) << "a nested helper parked with its outer task's mutex held: "
                          << child.Describe();
  EXPECT_TRUE(nested_ran.load());
  EXPECT_GE(nested_chunks.load(), 2) << "the helper did not run nested on the worker";
  EXPECT_EQ(sum.load(), kChunks);
  EXPECT_EQ(pool.live_workers(), 1);
}

// A rolled-back attempt lets a helper parked between two grains go on, and the fork then goes
// ahead: a handler prepared after the pool (so the pool is paused when it refuses) refuses the
// first two attempts.
TEST(ThreadPoolTest, ARolledBackAttemptResumesAParkedHelper) {
  int handle;
  AtForkHandler h;
  h.name = "refuses_twice";
  h.prepare = [](const PrepareAttempt& a) { return a.number > 2; };
  AtForkRegistration reg(&handle, std::move(h));  // registered before the pool: prepared after
  ThreadPool pool(ThreadPoolOptions{1, "rollback", 20000ms});
  std::atomic<bool> stop{false};
  std::atomic<int64_t> rounds{0}, wrong{0};
  std::thread busy([&] {
    while (!stop) {
      std::atomic<int64_t> s{0};
      pool.ParallelFor(0, 64, 1, [&](int64_t lo, int64_t hi) {
        std::this_thread::sleep_for(200us);
        s += hi - lo;
      });
      if (s != 64) ++wrong;
      ++rounds;
    }
  });
  WaitOrAbort([&] { return rounds >= 2; }, "the busy thread's first ParallelFor rounds");
  auto child = RunInChild([] { return 0; }, 30s);
  EXPECT_TRUE(child.ok()) << child.Describe();
  const int64_t at_fork = rounds.load();
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (rounds.load() < at_fork + 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(100us);
  }
  stop = true;
  busy.join();
  EXPECT_GE(rounds.load(), at_fork + 2);
  EXPECT_EQ(wrong.load(), 0);
  const ForkReport r = AtForkRegistry::Get().LastReport();
  EXPECT_GE(r.attempts, 3) << r.ToString();
  EXPECT_EQ(pool.live_workers(), 1);
  EXPECT_EQ(pool.stats().drain_timeouts, 0u);
}

// Workers that ran oneTBB stay parked across a fork, and oneTBB is still finalized at that fork
// (a live thread that holds oneTBB thread state makes finalize refuse; a worker drops that state
// as it parks): an idle worker that ran oneTBB earlier, and a ParallelFor helper whose grains run
// oneTBB, parked between two grains. The child can use oneTBB.
TEST(ThreadPoolTest, WorkersThatRanOneTbbDoNotKeepItFromBeingFinalized) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "Debian's oneTBB is not built with ThreadSanitizer (tests/runtime/BUILD.bazel)";
#endif
  ThreadPool idle(ThreadPoolOptions{1, "tbb_idle", 20000ms});
  ASSERT_EQ(idle.Submit([] { return forksafe::testing::TbbSum(100000); }).get(), 4999950000L);
  ThreadPool busy(ThreadPoolOptions{1, "tbb_busy", 20000ms});
  std::atomic<bool> stop{false};
  std::atomic<int64_t> rounds{0}, wrong{0};
  std::thread caller([&] {
    while (!stop) {
      busy.ParallelFor(0, 8, 1, [&](int64_t, int64_t) {
        // oneTBB on the pool's worker only: a thread outside the pools that runs oneTBB keeps
        // it from being finalized (runtime/tbb_fork.h, Hazards).
        if (!ThreadPool::OnWorkerThread()) return;
        if (forksafe::testing::TbbSum(20000) != 199990000L) ++wrong;
      });
      ++rounds;
    }
  });
  WaitOrAbort([&] { return rounds >= 2; }, "the busy thread's first ParallelFor rounds");
  const TbbForkStats before = GetTbbForkStats();
  for (int i = 0; i < 5; ++i) {
    auto child = RunInChild(
        [] {
          if (!TbbUsableInThisProcess()) return 1;
          return forksafe::testing::TbbSum(1000) == 499500L ? 0 : 2;
        },
        30s);
    EXPECT_TRUE(child.ok()) << "fork " << i << ": " << child.Describe();
  }
  stop = true;
  caller.join();
  const TbbForkStats after = GetTbbForkStats();
  EXPECT_EQ(after.gave_up, before.gave_up) << "a parked worker kept oneTBB from being finalized";
  EXPECT_GE(after.finalized, before.finalized + 5);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(idle.live_workers(), 1);
  EXPECT_EQ(busy.live_workers(), 1);
  EXPECT_EQ(idle.Submit([] { return forksafe::testing::TbbSum(1000); }).get(), 499500L);
}

}  // namespace
}  // namespace forksafe::runtime
