// Process with the three start methods: targets, arguments, exit codes, signals, exceptions with
// stack traces, bad input, and the lifeline (children die with their parent).
#include "forksafe/mp/process.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

// ---- entry points (registered: usable with every start method) ----
void Echo(Connection out, int x, std::string s) {
  out.send(x * 2, s + "!", static_cast<int>(getppid()));
}
FORKSAFE_ENTRY_POINT(Echo);

void ExitWith(int code) { std::exit(code); }
FORKSAFE_ENTRY_POINT(ExitWith);

void Abort() { std::abort(); }
FORKSAFE_ENTRY_POINT(Abort);

// A real SIGSEGV, not a null store: UBSan would report the store and exit 1 instead.
void Segfault() { raise(SIGSEGV); }
FORKSAFE_ENTRY_POINT(Segfault);

void SleepSeconds(int s) { std::this_thread::sleep_for(std::chrono::seconds(s)); }
FORKSAFE_ENTRY_POINT(SleepSeconds);

[[gnu::noinline]] void ThrowDeep(const std::string& why) { throw std::invalid_argument(why); }
void Thrower(std::string why) { ThrowDeep(why); }
FORKSAFE_ENTRY_POINT(Thrower);

void NotRegistered(int) {}

// Reports the pids of children it started (with `method`) and then sleeps until killed.
void StartSleepersAndReport(Connection out, std::string method) {
  std::vector<Process> ps;
  for (int i = 0; i < 2; ++i) ps.emplace_back(ProcessOptions{"", false, method}, &SleepSeconds, 60);
  std::vector<int> pids;
  for (Process& p : ps) {
    p.start();
    pids.push_back(p.pid());
  }
  out.send(pids);
  std::this_thread::sleep_for(60s);
}
FORKSAFE_ENTRY_POINT(StartSleepersAndReport);

class ProcessTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ProcessTest, RunsARegisteredFunctionWithArguments) {
  auto [parent, child] = Pipe();
  Process p(ProcessOptions{"echo", false, GetParam()}, &Echo, child, 21, "hi");
  EXPECT_EQ(p.pid(), 0);
  p.start();
  EXPECT_GT(p.pid(), 0);
  ASSERT_TRUE(parent.poll(30s)) << "no reply from the child";
  Message m = parent.RecvMessage(std::nullopt);
  int doubled = 0, ppid = 0;
  std::string s;
  Decode(m, doubled, s, ppid);
  EXPECT_EQ(doubled, 42);
  EXPECT_EQ(s, "hi!");
  if (GetParam() == "forkserver") {
    EXPECT_NE(ppid, getpid()) << "forkserver children are the server's children";
  } else {
    EXPECT_EQ(ppid, getpid());
  }
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  EXPECT_FALSE(p.is_alive());
  EXPECT_FALSE(p.failure().has_value());
  EXPECT_EQ(p.name(), "echo");
  EXPECT_EQ(p.start_method(), GetParam());
}

TEST_P(ProcessTest, ExitCodesAndSignals) {
  Process three(ProcessOptions{"", false, GetParam()}, &ExitWith, 3);
  Process aborts(ProcessOptions{"", false, GetParam()}, &Abort);
  Process segv(ProcessOptions{"", false, GetParam()}, &Segfault);
  three.start();
  aborts.start();
  segv.start();
  ASSERT_TRUE(three.join(30s));
  ASSERT_TRUE(aborts.join(30s));
  ASSERT_TRUE(segv.join(30s));
  EXPECT_EQ(three.exitcode(), 3);
  EXPECT_EQ(aborts.exitcode(), -SIGABRT);
  EXPECT_EQ(segv.exitcode(), -SIGSEGV);
  EXPECT_EQ(SignalName(SIGSEGV), "SIGSEGV (Segmentation fault)");
}

TEST_P(ProcessTest, HangPastJoinTimeoutThenTerminateAndKill) {
  Process p(ProcessOptions{"", false, GetParam()}, &SleepSeconds, 60);
  p.start();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(p.join(0.2));
  // A bound far above 0.2 s (the machine may be loaded, the binary sanitized) and far below the
  // child's 60 s sleep: it only shows that join() gave up on its timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  EXPECT_TRUE(p.is_alive());
  EXPECT_EQ(p.exitcode(), std::nullopt);
  EXPECT_THROW(p.close(), Error);  // still running
  p.terminate();
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), -SIGTERM);
  p.kill();  // no-op once exited
  Process q(ProcessOptions{"", false, GetParam()}, &SleepSeconds, 60);
  q.start();
  q.kill();
  ASSERT_TRUE(q.join(30s));
  EXPECT_EQ(q.exitcode(), -SIGKILL);
  q.close();
  EXPECT_THROW(q.join(), Error);
}

TEST_P(ProcessTest, ExceptionReachesTheParentWithTypeMessageAndTrace) {
  Process p(ProcessOptions{"", false, GetParam()}, &Thrower, std::string("bad shape"));
  p.start();
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 1);
  auto f = p.failure();
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->type, "std::invalid_argument");
  EXPECT_EQ(f->message, "bad shape");
  EXPECT_NE(f->traceback.find("ThrowDeep"), std::string::npos) << f->traceback;
  EXPECT_NE(f->traceback.find("Thrower"), std::string::npos) << f->traceback;
}

TEST_P(ProcessTest, ChildrenDieWhenTheirParentIsKilled) {
  // This process adopts orphans, so it can reap them and see for sure that they died.
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  auto [parent, child] = Pipe();
  Process middle(ProcessOptions{"middle", false, "fork"}, &StartSleepersAndReport, child,
                 GetParam());
  middle.start();
  ASSERT_TRUE(parent.poll(30s));
  std::vector<int> pids;
  Message m = parent.RecvMessage(std::nullopt);
  Decode(m, pids);
  ASSERT_EQ(pids.size(), 2u);
  middle.kill();
  ASSERT_TRUE(middle.join(10s));
  const auto t0 = std::chrono::steady_clock::now();
  for (int pid : pids) {
    bool gone = false;
    while (std::chrono::steady_clock::now() - t0 < 5s) {
      int st;
      const pid_t r = waitpid(pid, &st, WNOHANG);  // we adopted it
      if (r == pid || (r < 0 && errno == ECHILD && kill(pid, 0) != 0)) {
        gone = true;
        break;
      }
      std::this_thread::sleep_for(5ms);
    }
    EXPECT_TRUE(gone) << "child " << pid << " outlived its parent";
  }
  // The bound above (5 s) is a watchdog, not a speed target: a loaded CI machine may take a while
  // to schedule the death signal's delivery.
  // Reap anything else we adopted (the fork server of the middle process).
  while (waitpid(-1, nullptr, WNOHANG) > 0) {
  }
  prctl(PR_SET_CHILD_SUBREAPER, 0);
}

INSTANTIATE_TEST_SUITE_P(StartMethods, ProcessTest,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

TEST(ProcessForkTest, AnyCallableWorksWithFork) {
  auto [parent, child] = Pipe();
  std::vector<int> captured = {1, 2, 3};
  Process p(
      ProcessOptions{"", false, "fork"},
      [captured](Connection c, int k) {
        int sum = 0;
        for (int x : captured) sum += x * k;
        c.send(sum);
      },
      child, 10);
  p.start();
  ASSERT_TRUE(parent.poll(30s));
  EXPECT_EQ(parent.recv<int>(), 60);
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
}

TEST(ProcessErrorsTest, BadInputIsAClearError) {
  try {
    Process p(ProcessOptions{"", false, "spawn"}, &NotRegistered, 1);
    p.start();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("FORKSAFE_ENTRY_POINT"), std::string::npos) << e.what();
  }
  try {
    Process p(ProcessOptions{"", false, "forkserver"}, [] {});
    p.start();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("only with \"fork\""), std::string::npos) << e.what();
  }
  try {
    Process p(ProcessOptions{"", false, "vfork"}, &ExitWith, 0);
    p.start();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("fork, spawn, forkserver"), std::string::npos);
  }
  EXPECT_THROW(get_context("threads"), Error);
  Process p(ProcessOptions{"", false, "fork"}, &ExitWith, 0);
  EXPECT_THROW(p.join(), Error);  // before start
  p.start();
  EXPECT_THROW(p.start(), Error);  // twice
  try {
    p.join(-1.0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  EXPECT_TRUE(p.join(30s));
}

TEST(ProcessErrorsTest, StartMethodsAndContexts) {
  EXPECT_EQ(get_all_start_methods(), (std::vector<std::string>{"fork", "spawn", "forkserver"}));
  EXPECT_EQ(get_context("spawn").start_method(), "spawn");
  set_start_method("fork", true);
  EXPECT_EQ(get_start_method(), "fork");
  EXPECT_THROW(set_start_method("spawn"), Error);  // already set, not forced
  set_start_method("fork");                        // the same again is fine
  Process p = get_context("forkserver").MakeProcess(&ExitWith, 0);
  EXPECT_EQ(p.start_method(), "forkserver");
  p.start();
  EXPECT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
}

TEST(ProcessErrorsTest, StartMethodsAreValuesParsedAtTheEdge) {
  // Names convert where they are given; the library compares values.
  ProcessOptions o;
  EXPECT_TRUE(o.start_method.is_default());
  o.start_method = "spawn";
  EXPECT_EQ(o.start_method, StartMethod::kSpawn);
  o.start_method = StartMethod::kForkServer;
  EXPECT_STREQ(o.start_method.name(), "forkserver");
  try {
    o.start_method = "vfork";
    FAIL() << "an unknown name must not convert";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("fork, spawn, forkserver"), std::string::npos);
  }
  EXPECT_EQ(o.start_method, StartMethod::kForkServer);  // unchanged by the failed conversion
  // The default resolves to get_start_method(), never stays kDefault.
  set_start_method(StartMethod::kFork, true);
  EXPECT_EQ(get_start_method(), StartMethod::kFork);
  EXPECT_EQ(get_context().start_method(), StartMethod::kFork);
  Process p(ProcessOptions{"", false, {}}, &ExitWith, 0);
  EXPECT_EQ(p.start_method(), StartMethod::kFork);
  try {
    set_start_method("", true);  // "" is the default, which is not a method to set
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  EXPECT_EQ(get_start_method(), StartMethod::kFork);
}

TEST(ProcessErrorsTest, AnInheritedProcessRefusesToActInAForkedChild) {
  Process p(ProcessOptions{"", false, "fork"}, &SleepSeconds, 60);
  p.start();
  auto r = forksafe::testing::RunInChild(
      [&] {
        try {
          p.terminate();
          return 1;
        } catch (const Error& e) {
          return e.code() == ErrorCode::kFailedPrecondition ? 0 : 2;
        }
      },
      20s);
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_TRUE(p.is_alive()) << "the sibling must not have been signalled";
  p.kill();
  EXPECT_TRUE(p.join(30s));
}

TEST(ProcessErrorsTest, DaemonIsTerminatedWhenDestroyed) {
  pid_t pid = 0;
  {
    Process p(ProcessOptions{"d", true, "fork"}, &SleepSeconds, 60);
    p.start();
    pid = p.pid();
  }
  EXPECT_NE(kill(pid, 0), 0) << "daemon child survived its Process";
}

}  // namespace
}  // namespace forksafe::mp
