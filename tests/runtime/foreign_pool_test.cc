// The foreign pool adapter (runtime/foreign_pool.h, issue 14 "Other foreign pools"): a thread
// pool forksafe does not own is parked before every fork, resumed in the parent and rebuilt in
// the child; the example pool (examples/tiny_pool.h) is forked while busy. Every wait is bounded.
#include "forksafe/runtime/foreign_pool.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "examples/tiny_pool.h"
#include "gtest/gtest.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "tests/support/child_process.h"

namespace forksafe::runtime {
namespace {

using forksafe::testing::ChildResult;
using forksafe::testing::RunInChild;
using forksafe::testing::WaitChild;
using namespace std::chrono_literals;

bool HasEvent(const ForkReport& r, ForkEventKind kind, const std::string& subsystem) {
  for (const ForkEvent& e : r.events) {
    if (e.kind == kind && e.subsystem == subsystem) return true;
  }
  return false;
}

bool Registered(const std::string& name) {
  for (const std::string& n : AtForkRegistry::Get().HandlerNames()) {
    if (n == name) return true;
  }
  return false;
}

// Restores the registry's options at the end of a test that shortens them.
struct OptionsRestorer {
  AtForkOptions saved = AtForkRegistry::Get().options();
  ~OptionsRestorer() { AtForkRegistry::Get().SetOptions(saved); }
};

TEST(ForeignPoolTest, GuardNeedsItsCallbacksAndRegistersForItsLifetime) {
  const auto park = [](const PrepareAttempt&) { return true; };
  const auto rebuild = [](bool) {};
  for (const ForeignPoolCallbacks& bad :
       {ForeignPoolCallbacks{"", park, nullptr, rebuild},
        ForeignPoolCallbacks{"p", nullptr, nullptr, rebuild},
        ForeignPoolCallbacks{"p", park, nullptr, nullptr}}) {
    try {
      ForeignPoolGuard g(bad);
      ADD_FAILURE() << "accepted a guard without " << (bad.name.empty() ? "name" : "callback");
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("ForeignPoolGuard needs"), std::string::npos)
          << e.what();
    }
  }
  {
    ForeignPoolGuard g({"lifetime", park, nullptr, rebuild});
    EXPECT_EQ(g.handler_name(), "foreign_pool:lifetime");
    EXPECT_TRUE(Registered("foreign_pool:lifetime"));
  }
  EXPECT_FALSE(Registered("foreign_pool:lifetime"));
}

TEST(ForeignPoolTest, ParkResumeAndRebuildRunAroundAFork) {
  std::atomic<int> parks{0}, resumes{0};
  std::atomic<int> rebuilt_parked{-1};
  ForeignPoolGuard g({"order",
                      [&](const PrepareAttempt&) {
                        ++parks;
                        return true;
                      },
                      [&] { ++resumes; },
                      [&](bool parked) { rebuilt_parked = parked ? 1 : 0; }});
  ChildResult r = RunInChild([&] {
    // In the child: rebuild ran once, with parked == true, and resume did not.
    return rebuilt_parked.load() == 1 && g.stats().rebuilt == 1 && resumes.load() == 0 ? 0 : 3;
  }, 30s);
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(parks.load(), 1);
  EXPECT_EQ(resumes.load(), 1);
  EXPECT_EQ(rebuilt_parked.load(), -1) << "rebuild ran in the parent";
  const ForeignPoolStats s = g.stats();
  EXPECT_EQ(s.parked, 1u);
  EXPECT_EQ(s.resumed, 1u);
  EXPECT_EQ(s.refused, 0u);
  EXPECT_EQ(s.rebuilt, 0u);
}

TEST(ForeignPoolTest, NotYetAndThrowingParksAreRetried) {
  std::atomic<int> calls{0};
  std::atomic<int> resumes{0};
  ForeignPoolGuard g({"shy",
                      [&](const PrepareAttempt&) -> bool {
                        const int n = ++calls;
                        if (n == 1) return false;                       // "not yet"
                        if (n == 2) throw std::runtime_error("busy");   // counts as "not yet"
                        return true;
                      },
                      [&] { ++resumes; }, [](bool) {}});
  ChildResult r = RunInChild([] { return 0; }, 30s);
  EXPECT_TRUE(r.ok()) << r.Describe();
  const ForkReport rep = AtForkRegistry::Get().LastReport();
  EXPECT_GE(rep.attempts, 3) << rep.ToString();
  EXPECT_TRUE(HasEvent(rep, ForkEventKind::kPrepareRetried, "foreign_pool:shy")) << rep.ToString();
  const ForeignPoolStats s = g.stats();
  EXPECT_EQ(s.refused, 2u);
  EXPECT_EQ(s.parked, 1u);
  EXPECT_EQ(s.resumed, 1u) << "resumed only after its park said yes";
  EXPECT_EQ(resumes.load(), 1);
  EXPECT_EQ(s.gave_up, 0u);
}

TEST(ForeignPoolTest, AParkThatNeverSucceedsLetsTheForkGoAndTheChildKnows) {
  OptionsRestorer restore;
  AtForkOptions o = restore.saved;
  o.max_prepare_attempts = 3;
  o.prepare_deadline = 200ms;
  o.attempt_wait = 10ms;
  AtForkRegistry::Get().SetOptions(o);
  std::atomic<int> resumes{0};
  std::atomic<int> rebuilt_parked{-1};
  ForeignPoolGuard g({"stuck",
                      [](const PrepareAttempt& a) {
                        std::this_thread::sleep_until(a.wait_until);  // bounded, then "not yet"
                        return false;
                      },
                      [&] { ++resumes; },
                      [&](bool parked) { rebuilt_parked = parked ? 1 : 0; }});
  const auto start = std::chrono::steady_clock::now();
  ChildResult r = RunInChild([&] {
    return rebuilt_parked.load() == 0 && g.stats().gave_up == 1 ? 0 : 3;
  }, 30s);
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "the fork is bounded";
  const ForkReport rep = AtForkRegistry::Get().LastReport();
  EXPECT_TRUE(HasEvent(rep, ForkEventKind::kPrepareGaveUp, "foreign_pool:stuck"))
      << rep.ToString();
  EXPECT_EQ(resumes.load(), 0) << "nothing was parked, so nothing is resumed";
  EXPECT_EQ(g.stats().gave_up, 1u);
  EXPECT_EQ(g.stats().refused, 3u);
}

// The defect the adapter exists for, with the smallest pool there is: a std::thread worker and a
// condition variable. In the child the worker does not exist, so a task queued there never runs.
TEST(ForeignPoolTest, WithoutTheAdapterAChildsTasksNeverRun) {
  struct Plain {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> q;
    bool stop = false;
    std::thread worker{[this] {
      std::unique_lock<std::mutex> lk(mu);
      for (;;) {
        cv.wait(lk, [this] { return stop || !q.empty(); });
        if (stop) return;
        auto f = std::move(q.front());
        q.pop_front();
        lk.unlock();
        f();
        lk.lock();
      }
    }};
    ~Plain() {
      {
        std::lock_guard<std::mutex> lk(mu);
        stop = true;
      }
      cv.notify_all();
      worker.join();
    }
  } plain;
  ChildResult r = RunInChild([&plain] {
    std::atomic<bool> ran{false};
    {
      // The worker may have held the mutex at the fork instant: then it stays locked here.
      std::unique_lock<std::mutex> lk(plain.mu, std::defer_lock);
      for (int i = 0; i < 20 && !lk.try_lock(); ++i) std::this_thread::sleep_for(5ms);
      if (!lk.owns_lock()) return 8;  // 8: the pool's mutex is held by a thread that is gone
      plain.q.push_back([&ran] { ran = true; });
    }
    // No notify: the waiters of the parent's condition variable do not exist here.
    for (int i = 0; i < 50 && !ran; ++i) std::this_thread::sleep_for(10ms);
    return ran ? 0 : 7;  // 7: the task never ran
  }, 30s);
  EXPECT_TRUE(r.exited && (r.exit_code == 7 || r.exit_code == 8))
      << "the unguarded pool ran a task in the child? " << r.Describe();
}

// The example pool, busy in the parent (a feeder keeps its two threads going) while the test
// forks: every child runs its own tasks on the rebuilt pool within a deadline, and every task of
// the parent runs exactly once.
TEST(ForeignPoolTest, TinyPoolForkedWhileBusy) {
  const char* env = getenv("FORKSAFE_STORM_FORKS");
  const int forks = std::max(10, std::min(60, env != nullptr ? atoi(env) : 60));
  tiny::TinyPool pool(2, "busy");
  std::atomic<int> submitted{0}, done{0};
  std::atomic<bool> stop{false};
  std::thread feeder([&] {
    while (!stop) {
      pool.Submit([&done] {
        std::this_thread::sleep_for(100us);
        ++done;
      });
      ++submitted;
      std::this_thread::sleep_for(50us);
    }
  });
  int ok = 0;
  std::string failures;
  for (int f = 0; f < forks; ++f) {
    std::this_thread::sleep_for(2ms);
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(30);
      std::atomic<int> mine{0};
      for (int i = 0; i < 20; ++i) pool.Submit([&mine] { ++mine; });
      const bool idle = pool.WaitIdle(10s);
      _exit(idle && mine.load() == 20 ? 0 : 1);
    }
    ASSERT_GT(pid, 0);
    const ChildResult r = WaitChild(pid, 20s);
    if (r.ok()) {
      ++ok;
    } else {
      failures += " fork " + std::to_string(f) + ": " + r.Describe() + ";";
    }
  }
  stop = true;
  feeder.join();
  EXPECT_EQ(ok, forks) << failures;
  EXPECT_TRUE(pool.WaitIdle(30s));
  EXPECT_EQ(done.load(), submitted.load()) << "every task of the parent runs once";
  EXPECT_EQ(pool.fork_guard().stats().gave_up, 0u);
  EXPECT_GE(pool.fork_guard().stats().parked, static_cast<uint64_t>(forks));
}

}  // namespace
}  // namespace forksafe::runtime
