// The process around us: a library embedded in someone else's program does not own its signal
// dispositions, its descriptor table or its resource limits. These tests run Process, spawn(),
// Queue and Pool inside programs that
//   - ignore SIGCHLD, or reap every child from a SIGCHLD handler (waitpid(-1, ...));
//   - run children that close every descriptor from 3 up (as daemons and exec wrappers do);
//   - have a small RLIMIT_NOFILE;
//   - cannot fork (EAGAIN, as under RLIMIT_NPROC), through a seccomp filter;
//   - refuse unshare() (some container profiles), so the lifeline falls back to getppid();
//   - run on a kernel without PIDFD_GET_INFO (before 6.15), so that a status the program took is
//     known only from the child's own report (a seccomp filter hides the ioctl).
// The fork server's own hazards (killed, short of descriptors) are in hostile_fork_server_test.cc.
// Each runs in a forked child of the test (ExpectChildPasses: bounded, leak-checked), so that the
// test binary's own dispositions and limits stay as they were. A child body returns 0 for
// success; CHECK prints what failed and returns the line number (tests/mp/hostile_program.h).
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/spawn.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/mp/hostile_program.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using runtime::Error;
using runtime::ErrorCode;
using testing::RunInChild;
using namespace std::chrono_literals;

// ---- entry points (registered: usable with every start method) ----
void ReturnNormally() {}
FORKSAFE_ENTRY_POINT(ReturnNormally);

void ExitWith(int code) { std::exit(code); }
FORKSAFE_ENTRY_POINT(ExitWith);

void QuickExitWith(int code) { _exit(code); }  // no report: only the kernel knows the code
FORKSAFE_ENTRY_POINT(QuickExitWith);

void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
FORKSAFE_ENTRY_POINT(SleepMs);

void IndexedQuickExit(int i, int failing, int code) {
  if (i == failing) _exit(code);
}
FORKSAFE_ENTRY_POINT(IndexedQuickExit);

void Thrower(std::string why) { throw std::invalid_argument(why); }
FORKSAFE_ENTRY_POINT(Thrower);

void IndexedExit(int i, int failing, int code) {
  if (i == failing) std::exit(code);
}
FORKSAFE_ENTRY_POINT(IndexedExit);

void IndexedThrow(int i, int failing) {
  if (i == failing) throw std::runtime_error("rank " + std::to_string(i) + " gave up");
}
FORKSAFE_ENTRY_POINT(IndexedThrow);

int Square(int x) { return x * x; }
FORKSAFE_ENTRY_POINT(Square);

int SlowSquare(int x) {
  std::this_thread::sleep_for(20ms);
  return x * x;
}
FORKSAFE_ENTRY_POINT(SlowSquare);

int TerminateSelfIf(int x, int victim) {
  if (x == victim) raise(SIGTERM);
  return x;
}
FORKSAFE_ENTRY_POINT(TerminateSelfIf);

void PutSquare(Queue q, int x) { q.put(x * x); }
FORKSAFE_ENTRY_POINT(PutSquare);

// What daemons and exec wrappers do first: close every descriptor from 3 up, then open files
// that take the freed numbers. Then work for a while (longer than it takes a lifeline watcher
// to misfire) and exit with `code`.
void CloseAllThenWork(int code, int work_ms) {
  syscall(SYS_close_range, 3u, ~0u, 0u);
  for (int i = 0; i < 4; ++i) open("/dev/null", O_RDONLY);  // reuse 3, 4, 5, 6
  volatile uint64_t x = 1;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(work_ms);
  while (std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 10000; ++i) x = x * 6364136223846793005ull + 1;
    std::this_thread::sleep_for(1ms);
  }
  std::exit(code);
}
FORKSAFE_ENTRY_POINT(CloseAllThenWork);

// Starts CloseAllThenWork(0, 60 s) with `method`, reports its pid, and sleeps until killed.
void StartCloserAndReport(Connection out, std::string method) {
  Process p(ProcessOptions{"closer", false, method}, &CloseAllThenWork, 0, 60000);
  p.start();
  out.send(static_cast<int>(p.pid()));
  std::this_thread::sleep_for(60s);
}
FORKSAFE_ENTRY_POINT(StartCloserAndReport);

// ---- SIGCHLD ignored, or reaped by the program ----

using SigchldParam = std::tuple<std::string, Sigchld>;
class SigchldTest : public ::testing::TestWithParam<SigchldParam> {
 protected:
  std::string method() const { return std::get<0>(GetParam()); }
  Sigchld sigchld() const { return std::get<1>(GetParam()); }
};

TEST_P(SigchldTest, JoinExitcodeAndFailureWork) {
  ExpectChildPasses([m = method(), how = sigchld()] {
    SetSigchld(how);
    Process ok(ProcessOptions{"ok", false, m}, &ReturnNormally);
    Process three(ProcessOptions{"three", false, m}, &ExitWith, 3);
    Process quick(ProcessOptions{"quick", false, m}, &QuickExitWith, 5);
    Process thrower(ProcessOptions{"thrower", false, m}, &Thrower, std::string("bad shape"));
    Process sleeper(ProcessOptions{"sleeper", false, m}, &SleepMs, 60000);
    for (Process* p : {&ok, &three, &quick, &thrower, &sleeper}) p->start();
    for (Process* p : {&ok, &three, &quick, &thrower}) CHECK(p->join(10s));
    CHECK(sleeper.is_alive());
    CHECK(!sleeper.join(0.05));
    CHECK(sleeper.exitcode() == std::nullopt);
    sleeper.kill();
    CHECK(sleeper.join(10s));
    CHECK(!sleeper.is_alive());
    CHECK(ok.exitcode() == 0);
    CHECK(three.exitcode() == 3);
    CHECK(thrower.exitcode() == 1);
    CHECK(thrower.failure().has_value() && thrower.failure()->message == "bad shape");
    // No report from these two: their status is the kernel's (the fork server's own, or the
    // pidfd's exit information on Linux 6.15+); elsewhere the error names the cause.
    for (auto [p, want] : {std::pair<Process*, int>{&quick, 5}, {&sleeper, -SIGKILL}}) {
      try {
        CHECK(p->exitcode() == want);
      } catch (const Error& e) {
        fprintf(stderr, "%s\n", e.what());
        CHECK(m != "forkserver");
        CHECK(e.code() == ErrorCode::kFailedPrecondition);
        CHECK(Contains(e.message(), "SIGCHLD"));
      }
    }
    return 0;
  });
}

TEST_P(SigchldTest, DestructorAndJoinBlockInsteadOfSpinning) {
  ExpectChildPasses([m = method(), how = sigchld()] {
    SetSigchld(how);
    const double cpu0 = CpuSeconds();
    const auto t0 = std::chrono::steady_clock::now();
    {
      Process p(ProcessOptions{"", false, m}, &SleepMs, 600);
      p.start();
    }  // waits for the exit
    const auto waited = std::chrono::steady_clock::now() - t0;
    CHECK(waited >= 500ms);
    {
      Process p(ProcessOptions{"", false, m}, &SleepMs, 600);
      p.start();
      CHECK(p.join(30s));  // no timeout would have ended a spin
    }
    {
      Process d(ProcessOptions{"", true, m}, &SleepMs, 60000);  // a daemon: terminated
      d.start();
    }
    // A spin through 1.2 s of waiting would burn about as much CPU; a blocked wait, nearly none.
    // (Starting three processes costs far less than the bound, even sanitized.)
    const double cpu = CpuSeconds() - cpu0;
    fprintf(stderr, "cpu %.3f s\n", cpu);
    CHECK(cpu < 0.6);
    return 0;
  });
}

TEST_P(SigchldTest, SpawnJoinsAndPropagatesErrors) {
  ExpectChildPasses([m = method(), how = sigchld()] {
    SetSigchld(how);
    SpawnOptions o;
    o.nprocs = 3;
    o.start_method = m;
    o.grace_period = 1s;
    auto ctx = spawn(&IndexedExit, std::make_tuple(-1, 0), o);
    for (Process& p : ctx->processes()) CHECK(p.exitcode() == 0);
    try {
      spawn(&IndexedExit, std::make_tuple(1, 3), o);
      CHECK(false);
    } catch (const ProcessExitedException& e) {
      CHECK(e.error_index() == 1);
      CHECK(e.exit_code() == 3);
    }
    try {
      spawn(&IndexedThrow, std::make_tuple(2), o);
      CHECK(false);
    } catch (const ProcessRaisedException& e) {
      CHECK(e.error_index() == 2);
      CHECK(Contains(e.what(), "rank 2 gave up"));
    }
    return 0;
  });
}

TEST_P(SigchldTest, PoolWorkersLiveAndTheirDeathIsDetected) {
  ExpectChildPasses([m = method(), how = sigchld()] {
    SetSigchld(how);
    PoolOptions o;
    o.processes = 2;
    o.start_method = m;
    Pool pool(o);
    const std::vector<pid_t> before = pool.pids();
    std::vector<int> in(30);
    for (int i = 0; i < 30; ++i) in[i] = i;
    // 30 x 20 ms on 2 workers: many liveness checks of the pool pass meanwhile.
    const std::vector<int> out = pool.map(&SlowSquare, in, 1);
    CHECK(out.size() == 30u && out[29] == 29 * 29);
    CHECK(pool.pids() == before);  // no worker was taken for dead
    auto r = pool.apply_async(&TerminateSelfIf, 7, 7);
    try {
      r.get(30s);
      CHECK(false);
    } catch (const WorkerLostError& e) {
      fprintf(stderr, "%s\n", e.what());
      CHECK(e.exit_code() == -SIGTERM || Contains(e.what(), "SIGCHLD"));
    }
    CHECK(pool.map(&Square, in, 1).size() == 30u);  // replaced, still serving
    pool.close();
    CHECK(pool.join(30s));
    return 0;
  });
}

INSTANTIATE_TEST_SUITE_P(
    Programs, SigchldTest,
    ::testing::Combine(::testing::Values("fork", "spawn", "forkserver"),
                       ::testing::Values(Sigchld::kIgnored, Sigchld::kReapingHandler)),
    [](const auto& info) {
      return std::get<0>(info.param) +
             (std::get<1>(info.param) == Sigchld::kIgnored ? "_Ignored" : "_ReapingHandler");
    });

// ---- children that close their descriptors ----

class ClosedDescriptorsTest : public ::testing::TestWithParam<std::string> {};

// The child must live, and its parent's death must still end it. With `deny_unshare` the
// lifeline watcher cannot take a private descriptor table and falls back to getppid().
int CloserLivesAndDiesWithItsParent(const std::string& m, bool deny_unshare) {
  if (deny_unshare && !InstallFilter(true, false, false)) return kSkip;
  for (int i = 0; i < 10; ++i) {
    Process p(ProcessOptions{"closer", false, m}, &CloseAllThenWork, 7, 150);
    p.start();
    CHECK(p.join(30s));
    if (p.exitcode() != 7) {
      fprintf(stderr, "run %d: exit code %d\n", i, p.exitcode().value_or(-1000));
      CHECK(p.exitcode() == 7);
    }
  }
  // Parent death: a middle process starts the closer and is SIGKILLed; this process adopts the
  // orphan so that it can see it die.
  CHECK(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0);
  auto [ours, theirs] = Pipe();
  Process middle(ProcessOptions{"middle", false, "fork"}, &StartCloserAndReport, theirs, m);
  middle.start();
  theirs.close();
  CHECK(ours.poll(30s));
  const pid_t closer = ours.recv<int>();
  std::this_thread::sleep_for(200ms);  // it has closed its descriptors by now
  CHECK(::kill(closer, 0) == 0);
  middle.kill();
  CHECK(middle.join(10s));
  bool gone = false;
  const auto t0 = std::chrono::steady_clock::now();
  while (!gone && std::chrono::steady_clock::now() - t0 < 10s) {
    int st = 0;
    const pid_t r = waitpid(closer, &st, WNOHANG);  // adopted
    gone = r == closer || (r < 0 && ::kill(closer, 0) != 0);
    if (!gone) std::this_thread::sleep_for(5ms);
  }
  CHECK(gone);
  while (waitpid(-1, nullptr, WNOHANG) > 0) {  // whatever else was adopted (a fork server)
  }
  return 0;
}

TEST_P(ClosedDescriptorsTest, ChildThatClosesItsDescriptorsLivesAndDiesWithItsParent) {
  ExpectChildPasses([m = GetParam()] { return CloserLivesAndDiesWithItsParent(m, false); });
}

TEST_P(ClosedDescriptorsTest, WithoutUnshareTheLifelineFallsBackToTheParentPid) {
  ExpectChildPasses([m = GetParam()] { return CloserLivesAndDiesWithItsParent(m, true); });
}

INSTANTIATE_TEST_SUITE_P(StartMethods, ClosedDescriptorsTest,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

// ---- small limits ----

class LimitsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LimitsTest, StartingProcessesUntilDescriptorsRunOutIsAClearError) {
  ExpectChildPasses([m = GetParam()] {
    CHECK(SetNofile(32));
    std::vector<std::unique_ptr<Process>> running;
    bool refused = false;
    for (int i = 0; i < 40 && !refused; ++i) {
      auto p = std::make_unique<Process>(ProcessOptions{"", true, m}, &SleepMs, 60000);
      try {
        p->start();
        running.push_back(std::move(p));
      } catch (const Error& e) {
        CHECK(ClearLimitError(e, "RLIMIT_NOFILE"));
        refused = true;
      }
    }
    CHECK(refused);
    CHECK(running.size() >= 3u);
    fprintf(stderr, "%zu processes ran under 32 descriptors\n", running.size());
    for (auto& p : running) p->kill();
    for (auto& p : running) CHECK(p->join(10s));
    running.clear();
    // Descriptors are back: starting works again.
    Process again(ProcessOptions{"", false, m}, &ExitWith, 4);
    again.start();
    CHECK(again.join(10s) && again.exitcode() == 4);
    return 0;
  });
}

TEST_P(LimitsTest, SpawnQueueAndPoolWorkOrFailClearlyUnderASmallLimit) {
  ExpectChildPasses([m = GetParam()] {
    CHECK(SetNofile(64));
    int worked = 0;
    try {
      SpawnOptions o;
      o.nprocs = 4;
      o.start_method = m;
      spawn(&IndexedExit, std::make_tuple(-1, 0), o);
      ++worked;
    } catch (const Error& e) {
      CHECK(ClearLimitError(e, "RLIMIT_NOFILE"));
    }
    try {
      Queue q;
      std::vector<std::unique_ptr<Process>> ps;
      for (int i = 0; i < 4; ++i) {
        ps.push_back(std::make_unique<Process>(ProcessOptions{"", false, m}, &PutSquare, q, i));
        ps.back()->start();
      }
      int sum = 0;
      for (int i = 0; i < 4; ++i) sum += q.get<int>(true, 30.0);
      CHECK(sum == 0 + 1 + 4 + 9);
      for (auto& p : ps) CHECK(p->join(10s) && p->exitcode() == 0);
      ++worked;
    } catch (const Error& e) {
      CHECK(ClearLimitError(e, "RLIMIT_NOFILE"));
    }
    try {
      PoolOptions o;
      o.processes = 3;
      o.start_method = m;
      Pool pool(o);
      std::vector<int> in = {1, 2, 3, 4, 5, 6};
      CHECK(pool.map(&Square, in, 1).back() == 36);
      pool.close();
      CHECK(pool.join(30s));
      ++worked;
    } catch (const Error& e) {
      CHECK(ClearLimitError(e, "RLIMIT_NOFILE"));
    }
    fprintf(stderr, "%d of 3 worked under 64 descriptors\n", worked);
    return 0;
  });
}

TEST_P(LimitsTest, ForkFailingWithEagainIsAClearError) {
  ExpectChildPasses([m = GetParam()] {
    // fork() fails; posix_spawn (a clone with CLONE_VM) too, except for the forkserver case,
    // whose server must start so that its own fork() can fail.
    if (!InstallFilter(false, true, m != "forkserver")) return kSkip;
    Process p(ProcessOptions{"doomed", false, m}, &ExitWith, 0);
    try {
      p.start();
      CHECK(false);
    } catch (const Error& e) {
      CHECK(ClearLimitError(e, "RLIMIT_NPROC"));
      CHECK(Contains(e.message(), "doomed"));
    }
    CHECK(p.pid() == 0);
    try {
      SpawnOptions o;
      o.nprocs = 2;
      o.start_method = m;
      spawn(&IndexedExit, std::make_tuple(-1, 0), o);
      CHECK(false);
    } catch (const Error& e) {
      CHECK(ClearLimitError(e, "RLIMIT_NPROC"));
    }
    try {
      PoolOptions o;
      o.processes = 2;
      o.start_method = m;
      Pool pool(o);
      CHECK(false);
    } catch (const Error& e) {
      CHECK(ClearLimitError(e, "RLIMIT_NPROC"));
    }
    return 0;
  });
}

INSTANTIATE_TEST_SUITE_P(StartMethods, LimitsTest, ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

// ---- the exit is noticed by every look, under every start method ----

class ExitNoticedTest : public ::testing::TestWithParam<std::string> {};

// Looks at `p` with is_alive() until it is false, at most 10 s; false if it never was.
bool PollUntilDead(Process& p) {
  for (int i = 0; i < 2000; ++i) {
    if (!p.is_alive()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

TEST_P(ExitNoticedTest, IsAliveExitcodeJoinZeroAndCloseSeeAnExitWithoutJoin) {
  ExpectChildPasses([m = GetParam()] {
    Process p(ProcessOptions{"quick", false, m}, &ExitWith, 6);
    p.start();
    CHECK(PollUntilDead(p));  // a look with a deadline in the past still reads the exit
    CHECK(p.exitcode() == 6);
    CHECK(p.join(0.0));
    p.close();
    // exitcode() alone notices it too, and close() then needs no join.
    Process q(ProcessOptions{"quiet", false, m}, &ReturnNormally);
    q.start();
    std::optional<int> code;
    for (int i = 0; i < 2000 && !code; ++i) {
      code = q.exitcode();
      if (!code) std::this_thread::sleep_for(5ms);
    }
    CHECK(code == 0);
    q.close();
    // join(0) alone, then close().
    Process r(ProcessOptions{"joined", false, m}, &ExitWith, 2);
    r.start();
    bool joined = false;
    for (int i = 0; i < 2000 && !joined; ++i) {
      joined = r.join(0.0);
      if (!joined) std::this_thread::sleep_for(5ms);
    }
    CHECK(joined);
    r.close();
    return 0;
  });
}

INSTANTIATE_TEST_SUITE_P(StartMethods, ExitNoticedTest,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

// ---- statuses nobody kept (the kernel's pidfd exit information hidden, as before Linux 6.15) ----

class LostStatusTest : public ::testing::TestWithParam<SigchldParam> {
 protected:
  std::string method() const { return std::get<0>(GetParam()); }
  Sigchld sigchld() const { return std::get<1>(GetParam()); }
};

// The error of a status nobody knows: kFailedPrecondition naming the cause and the way out.
bool LostStatusError(const Error& e) {
  fprintf(stderr, "error: %s\n", e.what());
  return e.code() == ErrorCode::kFailedPrecondition && Contains(e.message(), "status is lost") &&
         Contains(e.message(), "SIGCHLD") && Contains(e.message(), "_exit()");
}

// With SIGCHLD ignored the kernel reaps every child at once: no waitid() of ours ever gets a
// status, so every outcome below is certain. A reaping handler races with our own waitid(), so
// there the kernel's status may still win.
TEST_P(LostStatusTest, ReportsGiveTheCodeAndTheRestIsAClearError) {
  ExpectChildPasses([m = method(), how = sigchld()] {
    if (!InstallFilter(false, false, false, true)) return kSkip;
    SetSigchld(how);
    const bool certain = how == Sigchld::kIgnored;
    Process ok(ProcessOptions{"ok", false, m}, &ReturnNormally);
    Process three(ProcessOptions{"three", false, m}, &ExitWith, 3);
    Process thrower(ProcessOptions{"thrower", false, m}, &Thrower, std::string("bad shape"));
    Process quick(ProcessOptions{"quick", false, m}, &QuickExitWith, 5);
    Process killed(ProcessOptions{"killed", false, m}, &SleepMs, 60000);
    for (Process* p : {&ok, &three, &thrower, &quick, &killed}) p->start();
    for (Process* p : {&ok, &three, &thrower, &quick}) CHECK(p->join(10s));
    killed.kill();
    CHECK(killed.join(10s));
    // The child's own report ("exiting", also for exit(3) through the exit handler).
    CHECK(ok.exitcode() == 0);
    CHECK(three.exitcode() == 3);
    CHECK(thrower.exitcode() == 1);
    CHECK(thrower.failure().has_value() && thrower.failure()->message == "bad shape");
    // No report: unknown, and said so.
    for (auto [p, want] : {std::pair<Process*, int>{&quick, 5}, {&killed, -SIGKILL}}) {
      try {
        const std::optional<int> code = p->exitcode();
        CHECK(!certain);
        CHECK(code == want);
      } catch (const Error& e) {
        CHECK(LostStatusError(e));
      }
    }
    return 0;
  });
}

TEST_P(LostStatusTest, SpawnAndPoolReportWhatIsKnownAndNameWhatIsNot) {
  ExpectChildPasses([m = method(), how = sigchld()] {
    if (!InstallFilter(false, false, false, true)) return kSkip;
    SetSigchld(how);
    const bool certain = how == Sigchld::kIgnored;
    SpawnOptions o;
    o.nprocs = 2;
    o.start_method = m;
    o.grace_period = 1s;
    try {
      spawn(&IndexedExit, std::make_tuple(1, 3), o);
      CHECK(false);
    } catch (const ProcessExitedException& e) {
      CHECK(e.error_index() == 1 && e.exit_code() == 3);  // from the child's report
    }
    try {
      spawn(&IndexedQuickExit, std::make_tuple(1, 4), o);
      CHECK(false);
    } catch (const ProcessExitedException& e) {
      CHECK(!certain);
      CHECK(e.error_index() == 1 && e.exit_code() == 4);
    } catch (const Error& e) {
      CHECK(LostStatusError(e));
      CHECK(Contains(e.message(), "Process-"));  // names the process
    }
    PoolOptions po;
    po.processes = 2;
    po.start_method = m;
    Pool pool(po);
    auto r = pool.apply_async(&TerminateSelfIf, 7, 7);
    try {
      r.get(30s);
      CHECK(false);
    } catch (const WorkerLostError& e) {
      fprintf(stderr, "%s\n", e.what());
      if (e.exit_code() != -SIGTERM) {
        CHECK(e.exit_code() == 0);  // not an invented status
        CHECK(Contains(e.what(), "status is lost") && Contains(e.what(), "SIGCHLD"));
        CHECK(!Contains(e.what(), "SIGKILL"));
      } else {
        CHECK(!certain);
      }
    }
    std::vector<int> in = {1, 2, 3};
    CHECK(pool.map(&Square, in, 1).back() == 9);  // replaced, still serving
    pool.close();
    CHECK(pool.join(30s));
    return 0;
  });
}

INSTANTIATE_TEST_SUITE_P(
    Programs, LostStatusTest,
    ::testing::Combine(::testing::Values("fork", "spawn"),
                       ::testing::Values(Sigchld::kIgnored, Sigchld::kReapingHandler)),
    [](const auto& info) {
      return std::get<0>(info.param) +
             (std::get<1>(info.param) == Sigchld::kIgnored ? "_Ignored" : "_ReapingHandler");
    });

// ---- a closed Process ----

TEST(ClosedProcessTest, EveryUseAfterCloseIsKClosed) {
  Process p(ProcessOptions{"done", false, "fork"}, &ExitWith, 0);
  p.start();
  ASSERT_TRUE(p.join(30s));
  p.close();
  p.close();  // twice is fine, as in Python
  auto expect_closed = [](const char* what, const std::function<void()>& call) {
    try {
      call();
      ADD_FAILURE() << what << " did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kClosed) << what << ": " << e.what();
      EXPECT_TRUE(Contains(e.message(), "is closed")) << e.what();
    }
  };
  expect_closed("start", [&] { p.start(); });
  expect_closed("join", [&] { p.join(); });
  expect_closed("is_alive", [&] { p.is_alive(); });
  expect_closed("exitcode", [&] { p.exitcode(); });
  expect_closed("terminate", [&] { p.terminate(); });
  expect_closed("kill", [&] { p.kill(); });
  EXPECT_GT(p.pid(), 0);
  EXPECT_EQ(p.name(), "done");
  EXPECT_FALSE(p.failure().has_value());
  // A never-started Process closes too, and then cannot start.
  Process q(ProcessOptions{"", false, "fork"}, &ExitWith, 0);
  q.close();
  expect_closed("start", [&] { q.start(); });
}

}  // namespace
}  // namespace forksafe::mp
