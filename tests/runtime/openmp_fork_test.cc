// OpenMP (GNU libgomp, this binary is built with -fopenmp) across fork(): the child of a parent
// that ran parallel regions runs regions too, under fork storms and in grandchildren; the hard
// cases (a fork from inside a region, nested regions, OpenMP threads blocked at the fork) are
// either safe or reported, never hung. runtime/openmp_fork.h says what each case does.
#include "forksafe/runtime/openmp_fork.h"

#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/internal/openmp_fork_bypass.h"
#include "forksafe/runtime/thread_pool.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::runtime {
namespace {

using forksafe::testing::ChildResult;
using forksafe::testing::ExpectingHangs;
using forksafe::testing::RunInChild;
using forksafe::testing::WaitChild;
using namespace std::chrono_literals;

// The sum of [0, n) by an OpenMP region of `threads` threads.
long OmpSum(long n, int threads = 4) {
  long s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(threads)
  for (long i = 0; i < n; ++i) s += i;
  return s;
}

constexpr long Expected(long n) { return n * (n - 1) / 2; }

// A child's body: 0 when OpenMP is usable here and a region gives the right sum.
int ChildRunsARegion() {
  if (!OpenMpUsableInThisProcess()) return 2;
  return OmpSum(20000) == Expected(20000) ? 0 : 1;
}

bool ReportSaysOpenMpUnusable(const ForkReport& r) {
  for (const ForkEvent& e : r.events) {
    if (e.kind == ForkEventKind::kSubsystemUnusable && e.subsystem == "openmp") return true;
  }
  return false;
}

// Forks `n` children one after the other, each running a region; then waits for all of them
// together until `deadline`. Returns how many timed out (were killed by the test).
int ForkChildrenRunningRegions(int n, std::chrono::milliseconds deadline, int* ok) {
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(60);  // a last resort: the parent kills us long before
      _exit(ChildRunsARegion());
    }
    if (pid > 0) pids.push_back(pid);
  }
  const auto end = std::chrono::steady_clock::now() + deadline;
  int hung = 0;
  *ok = 0;
  for (pid_t pid : pids) {
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   end - std::chrono::steady_clock::now()));
    const ChildResult r = WaitChild(pid, left);
    hung += r.timed_out;
    *ok += r.ok();
  }
  return hung;
}

TEST(OpenMpForkTest, FindsLibgompAmongTheLoadedObjects) {
  ASSERT_EQ(OmpSum(1000), Expected(1000));
  const std::vector<OpenMpRuntime> found = LoadedOpenMpRuntimes();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].kind, OpenMpRuntimeKind::kGnu);
  EXPECT_NE(found[0].path.find("libgomp"), std::string::npos) << found[0].path;
}

// Prepare runs in reverse registration order: "openmp" must come before "onetbb" and the pools
// so that it is prepared after them (runtime/openmp_fork.h, "Place in the prepare order").
TEST(OpenMpForkTest, PreparedAfterThePoolsAndOneTbb) {
  ThreadPool pool(ThreadPoolOptions{1, "omp_order", 5000ms});
  const std::vector<std::string> names = AtForkRegistry::Get().HandlerNames();
  const auto at = [&](const std::string& name) {
    return std::find(names.begin(), names.end(), name) - names.begin();
  };
  const auto n = static_cast<long>(names.size());
  ASSERT_LT(at("openmp"), n);
  ASSERT_LT(at("onetbb"), n);
  ASSERT_LT(at("thread_pool:omp_order"), n);
  EXPECT_LT(at("openmp"), at("onetbb"));
  EXPECT_LT(at("onetbb"), at("thread_pool:omp_order"));
}

TEST(OpenMpForkTest, ChildRunsARegionAfterTheParentDid) {
  ASSERT_EQ(OmpSum(100000), Expected(100000));
  const uint64_t paused = GetOpenMpForkStats().paused;
  auto child = RunInChild(ChildRunsARegion, 30s, 30);
  EXPECT_TRUE(child.ok()) << child.Describe() << " (2: OpenMP unusable, 1: wrong sum)";
  EXPECT_EQ(GetOpenMpForkStats().paused, paused + 1);
  EXPECT_TRUE(AtForkRegistry::Get().LastReport().clean())
      << AtForkRegistry::Get().LastReport().ToString();
  EXPECT_EQ(OmpSum(1000), Expected(1000)) << "OpenMP must work again in the parent";
}

// The defect, reproduced: without the handler's pause, every child of a parent that ran a
// region hangs in its first region (libgomp's team still lists threads the child lacks). With
// it, none does. The figures are printed for docs/guide.md.
TEST(OpenMpForkTest, WithoutThePauseTheChildHangsWithItItRuns) {
  ASSERT_EQ(OmpSum(100000), Expected(100000));
  constexpr int kChildren = 5;
  int ok_without = 0, ok_with = 0;
  int hung_without = 0;
  {
    const ExpectingHangs hangs_are_the_point;  // no stacks printed for these children
    internal::SetOpenMpForkBypassForTest(true);
    hung_without = ForkChildrenRunningRegions(kChildren, 3s, &ok_without);
    internal::SetOpenMpForkBypassForTest(false);
  }
  ASSERT_EQ(OmpSum(1000), Expected(1000));
  const int hung_with = ForkChildrenRunningRegions(kChildren, 30s, &ok_with);
  std::printf(
      "children of a parent that ran a region: without the pause %d of %d hung, with it "
      "%d of %d hung (%d ran their region)\n",
      hung_without, kChildren, hung_with, kChildren, ok_with);
  EXPECT_EQ(hung_without, kChildren) << "the defect no longer shows: this test shows nothing";
  EXPECT_EQ(hung_with, 0);
  EXPECT_EQ(ok_with, kChildren);
}

// Several threads run regions (some nested) without pause while several others fork, each
// after running a region of its own; every child runs a region and exits within its deadline.
// FORKSAFE_OPENMP_STORM_BYPASS=1 runs it without the handler's pause, with 2 s child deadlines,
// to measure the defect (it then fails): see docs/guide.md, "OpenMP".
TEST(OpenMpForkTest, ForkStormWhileOtherThreadsRunRegions) {
#if defined(__SANITIZE_ADDRESS__)
  // gcc 12's AddressSanitizer does not lock its allocator around fork(). Here libgomp starts
  // threads all the time (every fork's pause ends its pools), and a thread starting under ASan
  // allocates: a child forked meanwhile inherits the allocator's region lock held and hangs in
  // its first allocation (seen in CI: 1 child in 60; here 1 in about 1,700 forks under load, gdb:
  // every thread of the child in SizeClassAllocator64::GetFromAllocator). The plain and ubsan
  // runs fork 300 times; the other OpenMP cases run under ASan too.
  GTEST_SKIP() << "gcc 12's ASan allocator is not fork-safe while threads start (see the comment)";
#endif
  int forks = 300;
  if (const char* v = std::getenv("FORKSAFE_STORM_FORKS")) forks = std::max(2, std::atoi(v));
  const char* bypass_env = std::getenv("FORKSAFE_OPENMP_STORM_BYPASS");
  const bool bypass = bypass_env != nullptr && bypass_env[0] == '1';
  const auto child_deadline = bypass ? 2s : 20s;
  std::optional<ExpectingHangs> hangs_are_the_point;  // measuring the defect: children hang
  if (bypass) hangs_are_the_point.emplace();
  internal::SetOpenMpForkBypassForTest(bypass);
  constexpr int kBusy = 2, kForkers = 2;
  omp_set_max_active_levels(2);
  std::atomic<bool> stop{false};
  std::atomic<long> regions{0}, wrong{0};
  std::vector<std::thread> busy;
  for (int b = 0; b < kBusy; ++b) {
    busy.emplace_back([&, b] {
      while (!stop.load()) {
        long s = 0;
        if (b == 0) {
#pragma omp parallel num_threads(2) reduction(+ : s)
          s += OmpSum(2000, 2);  // nested
          wrong += s != 2 * Expected(2000);
        } else {
          wrong += OmpSum(50000, 3) != Expected(50000);
        }
        ++regions;
      }
    });
  }
  std::atomic<int> ok{0}, hung{0}, failed{0};
  std::atomic<int> first_failure{0};
  std::vector<std::thread> forkers;
  for (int f = 0; f < kForkers; ++f) {
    forkers.emplace_back([&] {
      for (int i = 0; i < forks / kForkers; ++i) {
        if (OmpSum(5000, 2) != Expected(5000)) ++wrong;
        const ChildResult r = RunInChild(ChildRunsARegion, child_deadline, 30);
        if (r.ok()) {
          ++ok;
        } else if (r.timed_out) {
          ++hung;
        } else {
          ++failed;
          int none = 0;
          first_failure.compare_exchange_strong(none, r.exited ? r.exit_code : -r.signal);
        }
      }
    });
  }
  for (auto& t : forkers) t.join();
  stop = true;
  for (auto& t : busy) t.join();
  internal::SetOpenMpForkBypassForTest(false);
  std::printf(
      "OpenMP fork storm%s: %d forks, %d children ran their region, %d hung, %d failed; "
      "%ld regions in the busy threads\n",
      bypass ? " WITHOUT the pause" : "", (forks / kForkers) * kForkers, ok.load(), hung.load(),
      failed.load(), regions.load());
  EXPECT_EQ(hung.load(), 0);
  EXPECT_EQ(failed.load(), 0) << "first failure: " << first_failure.load()
                              << " (exit code, or minus the signal)";
  EXPECT_EQ(ok.load(), (forks / kForkers) * kForkers);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(regions.load(), 0);
  omp_set_max_active_levels(1);
}

// A child that forks a grandchild: each runs a region.
TEST(OpenMpForkTest, GrandchildRunsARegion) {
  ASSERT_EQ(OmpSum(100000), Expected(100000));
  auto child = RunInChild(
      [] {
        if (ChildRunsARegion() != 0) return 1;
        const ChildResult grandchild = RunInChild(ChildRunsARegion, 20s, 20);
        if (!grandchild.ok()) {
          std::fprintf(stderr, "grandchild: %s\n", grandchild.Describe().c_str());
          return 2;
        }
        return OmpSum(1000) == Expected(1000) ? 0 : 3;
      },
      40s, 40);
  EXPECT_TRUE(child.ok()) << child.Describe();
}

// The forking thread is inside a region (the primary thread, then a worker, then inside an
// explicit task of the region): prepare cannot pause, the fork goes ahead at once, the report
// says so, and the child is told that OpenMP is unusable there (and in its own children).
TEST(OpenMpForkTest, ForkFromInsideARegionIsReportedNotHung) {
  for (int who = 0; who < 3; ++who) {
    SCOPED_TRACE(who == 0 ? "primary thread" : who == 1 ? "worker thread" : "explicit task");
    const uint64_t in_region = GetOpenMpForkStats().in_region;
    std::atomic<int> status{-1};
#pragma omp parallel num_threads(2)
    {
      const auto fork_here = [&] {
        const ChildResult r = RunInChild(
            [] {
              if (OpenMpUsableInThisProcess()) return 1;
              // The grandchild inherits the verdict.
              const ChildResult g =
                  RunInChild([] { return OpenMpUsableInThisProcess() ? 1 : 0; }, 20s, 20);
              return g.ok() ? 0 : 2;
            },
            30s, 30);
        status = r.ok() ? 0 : r.timed_out ? 3 : (r.exited ? r.exit_code : 4);
      };
      if (who < 2 && omp_get_thread_num() == who) fork_here();
      if (who == 2) {
#pragma omp single
        {
#pragma omp task
          fork_here();
        }
      }
    }
    EXPECT_EQ(status.load(), 0)
        << "1: the child believed OpenMP usable, 2: the grandchild did, 3: a hang";
    EXPECT_TRUE(ReportSaysOpenMpUnusable(AtForkRegistry::Get().LastReport()))
        << AtForkRegistry::Get().LastReport().ToString();
    EXPECT_EQ(GetOpenMpForkStats().in_region, in_region + 1);
    EXPECT_TRUE(OpenMpUsableInThisProcess()) << "the parent keeps OpenMP";
    EXPECT_EQ(OmpSum(1000), Expected(1000));
  }
}

// An explicit task outside any region runs on the forking thread at level 0: no team is running,
// so the pause is allowed and the child is usable.
TEST(OpenMpForkTest, ForkFromATaskOutsideAnyRegionRuns) {
  ASSERT_EQ(OmpSum(100000), Expected(100000));
  int status = -1;
#pragma omp task shared(status)
  {
    const ChildResult r = RunInChild(ChildRunsARegion, 30s, 30);
    status = r.ok() ? 0 : r.timed_out ? 3 : 1;
  }
#pragma omp taskwait
  EXPECT_EQ(status, 0) << "3: a hang";
  EXPECT_TRUE(AtForkRegistry::Get().LastReport().clean())
      << AtForkRegistry::Get().LastReport().ToString();
}

// Nested teams in the forking thread's region (and, meanwhile, in another thread's): the child
// runs nested regions.
TEST(OpenMpForkTest, NestedParallelismSurvivesTheFork) {
  omp_set_max_active_levels(2);
  const auto nested_sum = [] {
    long s = 0;
    int inner_level = 0;
#pragma omp parallel num_threads(2) reduction(+ : s)
    {
      s += OmpSum(10000, 2);
#pragma omp single
      inner_level = omp_get_level();
    }
    return s == 2 * Expected(10000) && inner_level == 1;
  };
  ASSERT_TRUE(nested_sum());
  std::atomic<bool> stop{false};
#if defined(__SANITIZE_ADDRESS__)
  // Under gcc 12's ASan the other thread runs nothing: its nested regions start libgomp threads
  // all the time, and ASan's allocator is not locked around fork() (see the storm test above).
  // Seen in CI on 2026-11-28: fork 8's child hung, a thread it started spinning (state R) and the
  // forking thread waiting for it. The children still run nested regions after the parent did;
  // the plain and ubsan runs fork beside the other thread's regions.
  constexpr bool kOtherThread = false;
#else
  constexpr bool kOtherThread = true;
#endif
  std::thread other([&] {
    while (kOtherThread && !stop.load()) {
      if (!nested_sum()) std::abort();
    }
  });
  for (int i = 0; i < 10; ++i) {
    const ChildResult r = RunInChild(
        [&] {
          if (!OpenMpUsableInThisProcess()) return 2;
          return nested_sum() ? 0 : 1;
        },
        30s, 30);
    EXPECT_TRUE(r.ok()) << "fork " << i << ": " << r.Describe();
    ASSERT_TRUE(nested_sum());
  }
  stop = true;
  other.join();
  omp_set_max_active_levels(1);
}

// Another thread's OpenMP threads are blocked at the fork: two wait for an omp_lock_t that the
// third holds, in one region; in the next, two wait at a barrier for the third. The forking
// thread's pause is not held up by them, and the children run their own regions.
TEST(OpenMpForkTest, ForkWhileOtherOpenMpThreadsAreBlocked) {
  ASSERT_EQ(OmpSum(100000), Expected(100000));
  for (const char* kind : {"lock", "barrier"}) {
    SCOPED_TRACE(kind);
    std::atomic<bool> release{false};
    std::atomic<int> arrived{0};
    const bool use_lock = kind[0] == 'l';
    std::thread blocked([&] {
      omp_lock_t lock;
      omp_init_lock(&lock);
#pragma omp parallel num_threads(3)
      {
        if (omp_get_thread_num() == 0) {
          if (use_lock) omp_set_lock(&lock);
          ++arrived;
          while (!release.load()) std::this_thread::sleep_for(1ms);
          if (use_lock) omp_unset_lock(&lock);
        } else {
          ++arrived;
          if (use_lock) {
            // Blocked here (sleeping in libgomp) until thread 0 lets go.
            while (arrived.load() < 3) std::this_thread::sleep_for(1ms);
            omp_set_lock(&lock);
            omp_unset_lock(&lock);
          }
        }
#pragma omp barrier
      }
      omp_destroy_lock(&lock);
    });
    ASSERT_TRUE(forksafe::testing::WaitUntil([&] { return arrived.load() == 3; }, 30s));
    std::this_thread::sleep_for(20ms);  // let the other two block
    const uint64_t paused = GetOpenMpForkStats().paused;
    int ok = 0;
    const int hung = ForkChildrenRunningRegions(5, 30s, &ok);
    EXPECT_EQ(hung, 0);
    EXPECT_EQ(ok, 5);
    EXPECT_EQ(GetOpenMpForkStats().paused, paused + 5);
    release = true;
    blocked.join();
    EXPECT_EQ(OmpSum(1000), Expected(1000));
  }
}

}  // namespace
}  // namespace forksafe::runtime
