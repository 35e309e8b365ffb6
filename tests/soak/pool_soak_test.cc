// Pool soak (issue 7, "Load"): a Pool runs tasks for minutes while a killer thread SIGKILLs a
// random worker every 50-250 ms. Every task submitted must end exactly once: with its result, or
// with WorkerLostError (mp/pool.h: the chunk a dying worker held fails with it and is not
// retried). None may be lost (its result never arriving: a 60 s wait turns that into a failure)
// and none may run twice (each task counts its runs in shared memory). Duration: 180 s times
// FORKSAFE_SOAK_SCALE, or FORKSAFE_SOAK_POOL_SECONDS.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/soak/soak_scale.h"

namespace forksafe::mp {
namespace {

using namespace std::chrono_literals;

// Runs of each task, in memory that the forked workers share with the test (MAP_SHARED before
// the pool forks them; replacements are forked from the test process too).
constexpr int64_t kMaxTasks = int64_t{1} << 24;
std::atomic<int32_t>* g_runs = nullptr;

// A task: counts its run, works 0-3 ms (so kills land mid-task as well as between tasks).
int64_t Work(int64_t i) {
  if (g_runs != nullptr) g_runs[i].fetch_add(1);
  std::this_thread::sleep_for(std::chrono::microseconds((i % 4) * 1000));
  return i * 3 + 1;
}
FORKSAFE_ENTRY_POINT(Work);

TEST(PoolSoakTest, RandomWorkerKillsLoseNoTask) {
  double seconds = 180 * forksafe::testing::SoakScale();
  if (const char* v = getenv("FORKSAFE_SOAK_POOL_SECONDS")) seconds = atof(v);
  if (seconds < 2) seconds = 2;
  void* mem = mmap(nullptr, kMaxTasks * sizeof(int32_t), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  g_runs = static_cast<std::atomic<int32_t>*>(mem);

  constexpr int kWorkers = 4;
  PoolOptions options;
  options.processes = kWorkers;
  options.start_method = "fork";
  options.name = "soak";
  Pool pool(options);

  std::atomic<bool> stop{false};
  std::atomic<int> kills{0};
  std::thread killer([&] {
    std::mt19937 rng(12345);
    while (!stop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 200));
      if (stop) break;
      const std::vector<pid_t> pids = pool.pids();
      if (pids.empty()) continue;
      const pid_t victim = pids[rng() % pids.size()];
      if (victim > 0 && ::kill(victim, SIGKILL) == 0) ++kills;
    }
  });

  int64_t submitted = 0, done = 0, lost = 0, wrong = 0, other_errors = 0, hung = 0;
  int64_t ran_twice = 0;
  std::string first_other;
  std::deque<std::pair<int64_t, AsyncResult<int64_t>>> window;
  auto settle = [&] {
    auto [i, r] = std::move(window.front());
    window.pop_front();
    try {
      if (r.get(60s) == i * 3 + 1) {
        ++done;
        if (g_runs[i].load() != 1) ++ran_twice;  // a result means exactly one run
      } else {
        ++wrong;
      }
    } catch (const WorkerLostError&) {
      ++lost;
      if (g_runs[i].load() > 1) ++ran_twice;  // not retried: at most one (cut-short) run
    } catch (const runtime::Error& e) {
      if (e.code() == runtime::ErrorCode::kDeadlineExceeded) {
        ++hung;
      } else {
        ++other_errors;
      }
      if (first_other.empty()) first_other = e.what();
    }
  };
  const auto start = std::chrono::steady_clock::now();
  const auto end = start + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end && submitted < kMaxTasks && hung == 0) {
    while (window.size() < 4 * kWorkers && submitted < kMaxTasks) {
      window.emplace_back(submitted, pool.apply_async(&Work, submitted));
      ++submitted;
    }
    settle();
  }
  stop = true;
  killer.join();
  while (!window.empty() && hung == 0) settle();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  pool.close();
  const bool joined = pool.join(60s);

  printf(
      "soak: pool: %.1f s, %lld tasks submitted: %lld done, %lld failed with WorkerLostError, "
      "%lld other errors, %lld hung, %lld wrong results, %lld ran twice; %d workers killed "
      "(%.0f tasks/s)\n",
      secs, static_cast<long long>(submitted), static_cast<long long>(done),
      static_cast<long long>(lost), static_cast<long long>(other_errors),
      static_cast<long long>(hung), static_cast<long long>(wrong),
      static_cast<long long>(ran_twice), kills.load(), submitted / secs);
  RecordProperty("tasks", static_cast<int>(submitted));
  RecordProperty("killed_workers", kills.load());
  EXPECT_TRUE(joined) << "the pool's workers did not exit after close()";
  EXPECT_EQ(hung, 0) << first_other;
  EXPECT_EQ(other_errors, 0) << first_other;
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(ran_twice, 0);
  EXPECT_EQ(done + lost, submitted) << "every task ends with a result or WorkerLostError";
  EXPECT_LE(lost, kills.load()) << "a kill fails at most the one task its worker held";
  EXPECT_GT(kills.load(), 0);
  EXPECT_GT(done, 0);
  munmap(mem, kMaxTasks * sizeof(int32_t));
  g_runs = nullptr;
}

}  // namespace
}  // namespace forksafe::mp
