// OpenMP fork events count forks, not prepare attempts (runtime/openmp_fork.h, OpenMpForkStats):
// a fork that takes three attempts counts once and reports once. This binary links the runtime
// statically (linkstatic), so that the namespace-scope initializer below runs before the
// runtime's own: the refusing handler is registered before "openmp" and prepared after it, and
// each of its refusals makes the registry prepare "openmp" again.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/openmp_fork.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::runtime {
namespace {

using forksafe::testing::ChildResult;
using forksafe::testing::RunInChild;
using namespace std::chrono_literals;

// Says "not yet" to the next `g_refusals` prepare attempts.
std::atomic<int> g_refusals{0};
int g_refuser_tag;
const bool g_refuser_registered = [] {
  AtForkHandler h;
  h.name = "refuse_first_attempts";
  h.prepare = [](const PrepareAttempt&) {
    if (g_refusals.load() <= 0) return true;
    --g_refusals;
    return false;
  };
  AtForkRegistry::Get().Register(&g_refuser_tag, std::move(h));
  return true;
}();

long OmpSum(long n) {
  long s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(4)
  for (long i = 0; i < n; ++i) s += i;
  return s;
}

constexpr long Expected(long n) { return n * (n - 1) / 2; }

int OpenMpEvents(const ForkReport& r) {
  int n = 0;
  for (const ForkEvent& e : r.events) n += e.subsystem == "openmp";
  return n;
}

TEST(OpenMpAttemptsTest, TheRefusingHandlerIsPreparedAfterOpenMp) {
  ASSERT_TRUE(g_refuser_registered);
  const std::vector<std::string> names = AtForkRegistry::Get().HandlerNames();
  const auto at = [&](const std::string& name) {
    return std::find(names.begin(), names.end(), name) - names.begin();
  };
  ASSERT_LT(at("openmp"), static_cast<long>(names.size()));
  EXPECT_LT(at("refuse_first_attempts"), at("openmp"))
      << "the other tests of this file would show nothing";
}

// libgomp paused in each of three attempts: one pause counted.
TEST(OpenMpAttemptsTest, APauseCountsOncePerFork) {
  ASSERT_EQ(OmpSum(100000), Expected(100000));
  const uint64_t paused = GetOpenMpForkStats().paused;
  g_refusals = 2;
  const ChildResult child = RunInChild(
      [] { return OpenMpUsableInThisProcess() && OmpSum(20000) == Expected(20000) ? 0 : 1; }, 30s,
      30);
  EXPECT_TRUE(child.ok()) << child.Describe();
  EXPECT_EQ(g_refusals.load(), 0);
  const ForkReport report = AtForkRegistry::Get().LastReport();
  EXPECT_EQ(report.attempts, 3) << report.ToString();
  EXPECT_EQ(GetOpenMpForkStats().paused, paused + 1);
  EXPECT_EQ(OpenMpEvents(report), 0) << report.ToString();
}

// A fork from inside a region, seen in each of three attempts: counted and reported once.
TEST(OpenMpAttemptsTest, AForkFromInsideARegionCountsAndReportsOnce) {
  const uint64_t in_region = GetOpenMpForkStats().in_region;
  std::atomic<int> status{-1};
#pragma omp parallel num_threads(2)
  {
    if (omp_get_thread_num() == 0) {
      g_refusals = 2;
      const ChildResult r = RunInChild([] { return OpenMpUsableInThisProcess() ? 1 : 0; }, 30s, 30);
      status = r.ok() ? 0 : 1;
    }
  }
  EXPECT_EQ(status.load(), 0) << "the child must be told that OpenMP is unusable";
  const ForkReport report = AtForkRegistry::Get().LastReport();
  EXPECT_EQ(report.attempts, 3) << report.ToString();
  EXPECT_EQ(OpenMpEvents(report), 1) << report.ToString();
  EXPECT_EQ(GetOpenMpForkStats().in_region, in_region + 1);
}

}  // namespace
}  // namespace forksafe::runtime
