// spawn(): success with each start method, join(timeout), and error propagation: exceptions with
// index, pid, type, message and trace; exit codes; signals; the others terminated at once.
#include "forksafe/mp/spawn.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <thread>

#include "forksafe/mp/connection.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"

namespace forksafe::mp {
namespace {

using namespace std::chrono_literals;

void Report(int i, Connection out, int base) { out.send(i, base + i); }
FORKSAFE_ENTRY_POINT(Report);

void SleepThenExit(int i, double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}
FORKSAFE_ENTRY_POINT(SleepThenExit);

// Process 1 fails in the requested way; the others sleep long. (Not inlined, so that the trace
// names it: the symbolizer reads symbols, not inlining records.)
[[gnu::noinline]] void OneFails(int i, std::string how) {
  if (i != 1) {
    std::this_thread::sleep_for(60s);
    return;
  }
  if (how == "throw") throw std::runtime_error("rank 1 gave up");
  if (how == "exit") std::exit(3);
  if (how == "segv") raise(SIGSEGV);
  if (how == "kill") raise(SIGKILL);
}
FORKSAFE_ENTRY_POINT(OneFails);

// The last process (index n - 1) throws at once; every other one sleeps long.
void LastFails(int i, int n) {
  if (i == n - 1) throw std::runtime_error("the last one gave up");
  std::this_thread::sleep_for(60s);
}
FORKSAFE_ENTRY_POINT(LastFails);

// Process 0 succeeds at once, process n - 1 throws when told to on `go`, the others sleep long.
void FirstSucceedsLastFailsLater(int i, int n, Connection go) {
  if (i == 0) return;
  if (i == n - 1) {
    if (go.poll(30s)) go.RecvMessage(std::nullopt);
    throw std::runtime_error("late failure");
  }
  std::this_thread::sleep_for(60s);
}
FORKSAFE_ENTRY_POINT(FirstSucceedsLastFailsLater);

class SpawnTest : public ::testing::TestWithParam<std::string> {
 protected:
  SpawnOptions Options(int n, bool join = true) {
    SpawnOptions o;
    o.nprocs = n;
    o.join = join;
    o.start_method = GetParam();
    o.grace_period = 1s;
    return o;
  }
};

TEST_P(SpawnTest, RunsFnWithIndexInEveryProcess) {
  auto [parent, child] = Pipe();
  auto ctx = spawn(&Report, std::make_tuple(child, 100), Options(3));
  std::vector<bool> seen(3, false);
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(parent.poll(10s));
    Message m = parent.RecvMessage(std::nullopt);
    int i = -1, v = -1;
    Decode(m, i, v);
    ASSERT_GE(i, 0);
    ASSERT_LT(i, 3);
    EXPECT_EQ(v, 100 + i);
    seen[i] = true;
  }
  EXPECT_EQ(seen, (std::vector<bool>{true, true, true}));
  EXPECT_TRUE(ctx->join(0.0));  // already joined by spawn()
  for (Process& p : ctx->processes()) EXPECT_EQ(p.exitcode(), 0);
}

TEST_P(SpawnTest, JoinWithTimeoutReturnsFalseWhileRunning) {
  auto ctx = spawn(&SleepThenExit, std::make_tuple(0.5), Options(2, /*join=*/false));
  EXPECT_FALSE(ctx->join(0.05));
  EXPECT_TRUE(ctx->join(30.0));
  EXPECT_EQ(ctx->pids().size(), 2u);
}

TEST_P(SpawnTest, JoinWithTimeoutWaitsItsTimeoutThenSeesTheExit) {
  auto ctx = spawn(&SleepThenExit, std::make_tuple(0.3), Options(2, /*join=*/false));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(ctx->join(0.05));
  // A false join has waited its whole timeout (it is not a poll that returns at once).
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 50ms);
  for (Process& p : ctx->processes()) EXPECT_TRUE(p.is_alive());
  EXPECT_FALSE(ctx->join(0.0));
  EXPECT_TRUE(ctx->join(30.0));
  for (Process& p : ctx->processes()) {
    EXPECT_FALSE(p.is_alive());
    EXPECT_EQ(p.exitcode(), 0);
  }
  EXPECT_TRUE(ctx->join(0.0));  // joined: stays true
}

TEST_P(SpawnTest, FailureOfTheLastStartedProcessIsSeenWhileTheFirstSleeps) {
  const int n = 4;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    spawn(&LastFails, std::make_tuple(n), Options(n));
    FAIL() << "no error";
  } catch (const ProcessRaisedException& e) {
    EXPECT_EQ(e.error_index(), n - 1);
    EXPECT_EQ(e.failure().message, "the last one gave up");
  }
  // Bounds a hang (the sleepers sleep 60 s), not a speed.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s)
      << "the failure was not seen until the sleeping processes ended";
}

TEST_P(SpawnTest, FailureAfterAnotherProcessSucceededIsSeenAndTheRestTerminated) {
  const int n = 3;
  auto [parent, child] = Pipe();
  auto ctx = spawn(&FirstSucceedsLastFailsLater, std::make_tuple(n, child), Options(n, false));
  const auto t0 = std::chrono::steady_clock::now();
  // Process 0 has exited (successfully) before the last one is told to fail.
  ASSERT_TRUE(ctx->processes()[0].join(30.0));
  parent.send(1);
  try {
    while (!ctx->join(30.0)) {
    }
    FAIL() << "no error";
  } catch (const ProcessRaisedException& e) {
    EXPECT_EQ(e.error_index(), n - 1);
    EXPECT_EQ(e.failure().message, "late failure");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  auto& ps = ctx->processes();
  EXPECT_EQ(ps[0].exitcode(), 0);
  EXPECT_EQ(ps[1].exitcode(), -SIGTERM);  // terminated, and reaped
  EXPECT_EQ(ps[2].exitcode(), 1);
  for (Process& p : ps) EXPECT_FALSE(p.is_alive());
}

TEST_P(SpawnTest, ManyProcessesAllRunAndAreReaped) {
  const int n = GetParam() == "spawn" ? 16 : 48;
  auto [parent, child] = Pipe();
  auto ctx = spawn(&Report, std::make_tuple(child, 1000), Options(n));
  std::vector<int> seen(n, 0);
  for (int k = 0; k < n; ++k) {
    ASSERT_TRUE(parent.poll(10s));
    Message m = parent.RecvMessage(std::nullopt);
    int i = -1, v = -1;
    Decode(m, i, v);
    ASSERT_GE(i, 0);
    ASSERT_LT(i, n);
    EXPECT_EQ(v, 1000 + i);
    ++seen[i];
  }
  EXPECT_EQ(seen, std::vector<int>(n, 1));
  std::set<pid_t> pids;
  for (Process& p : ctx->processes()) {
    EXPECT_EQ(p.exitcode(), 0);
    pids.insert(p.pid());
  }
  EXPECT_EQ(pids.size(), static_cast<size_t>(n));
}

TEST_P(SpawnTest, ExceptionInAChildIsRaisedInTheParent) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    spawn(&OneFails, std::make_tuple(std::string("throw")), Options(3));
    FAIL() << "no error";
  } catch (const ProcessRaisedException& e) {
    EXPECT_EQ(e.error_index(), 1);
    EXPECT_GT(e.error_pid(), 0);
    EXPECT_EQ(e.failure().type, "std::runtime_error");
    EXPECT_EQ(e.failure().message, "rank 1 gave up");
    EXPECT_NE(e.failure().traceback.find("OneFails"), std::string::npos) << e.failure().traceback;
    // The trace ends at the target: the launcher's frames (the child body, spawn(), main) are
    // left out.
    EXPECT_EQ(e.failure().traceback.find("RunChildBody"), std::string::npos)
        << e.failure().traceback;
    EXPECT_EQ(e.failure().traceback.find(" main"), std::string::npos) << e.failure().traceback;
    const std::string what = e.what();
    EXPECT_NE(what.find("process 1"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1 gave up"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s)
      << "the sleeping processes were not terminated after the failure";
}

TEST_P(SpawnTest, NonZeroExitAndSignalsAreNamed) {
  try {
    spawn(&OneFails, std::make_tuple(std::string("exit")), Options(2));
    FAIL();
  } catch (const ProcessExitedException& e) {
    EXPECT_EQ(e.error_index(), 1);
    EXPECT_EQ(e.exit_code(), 3);
    EXPECT_EQ(e.signal_name(), "");
    EXPECT_NE(std::string(e.what()).find("exit code 3"), std::string::npos);
  }
  try {
    spawn(&OneFails, std::make_tuple(std::string("segv")), Options(2));
    FAIL();
  } catch (const ProcessExitedException& e) {
    EXPECT_EQ(e.exit_code(), -SIGSEGV);
    EXPECT_EQ(e.signal_name(), "SIGSEGV (Segmentation fault)");
    EXPECT_NE(std::string(e.what()).find("SIGSEGV"), std::string::npos) << e.what();
  }
  try {
    spawn(&OneFails, std::make_tuple(std::string("kill")), Options(2));
    FAIL();
  } catch (const ProcessExitedException& e) {
    EXPECT_EQ(e.exit_code(), -SIGKILL);
    EXPECT_NE(std::string(e.what()).find("SIGKILL"), std::string::npos) << e.what();
  }
}

TEST_P(SpawnTest, FailureWithoutJoinSurfacesFromContextJoin) {
  auto ctx = spawn(&OneFails, std::make_tuple(std::string("throw")), Options(2, false));
  bool raised = false;
  const auto t0 = std::chrono::steady_clock::now();
  while (!raised && std::chrono::steady_clock::now() - t0 < 30s) {
    try {
      if (ctx->join(0.1)) break;
    } catch (const ProcessRaisedException& e) {
      raised = true;
      EXPECT_EQ(e.error_index(), 1);
    }
  }
  EXPECT_TRUE(raised);
  for (Process& p : ctx->processes()) EXPECT_FALSE(p.is_alive());
}

INSTANTIATE_TEST_SUITE_P(StartMethods, SpawnTest, ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

TEST(SpawnOptionsTest, BadNprocs) {
  SpawnOptions o;
  o.nprocs = 0;
  try {
    spawn(&SleepThenExit, std::make_tuple(0.0), o);
    FAIL();
  } catch (const runtime::Error& e) {
    EXPECT_EQ(e.code(), runtime::ErrorCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace forksafe::mp
