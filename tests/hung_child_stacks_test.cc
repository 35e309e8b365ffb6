// WaitChild's stacks of a hung child (tests/support/child_process.h), tested: a child that never
// ends is killed after its timeout, and before that the stacks of its threads reach stderr, framed
// by the two marker lines tools/test.sh quotes, naming the function the child hangs in; under
// ExpectingHangs nothing is printed. Where there is no gdb, the first case skips and says so.
// Time in which the waiting thread itself did not run extends the wait.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::testing {
namespace {

using namespace std::chrono_literals;

bool HaveGdb() {
  return access("/usr/bin/gdb", X_OK) == 0 || system("command -v gdb >/dev/null 2>&1") == 0;
}

// Not inlined and not static-looking: its name must show in the child's stack.
__attribute__((noinline)) void ThisChildHangsHere() {
  for (;;) pause();
}

pid_t ForkAHangingChild() {
  fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(60);  // a last resort: the test kills it long before
    ThisChildHangsHere();
  }
  return pid;
}

TEST(HungChildStacksTest, AHungChildsStacksArePrintedBeforeItIsKilled) {
  if (!HaveGdb()) GTEST_SKIP() << "no gdb here: WaitChild then says so instead of printing stacks";
  const pid_t pid = ForkAHangingChild();
  ASSERT_GT(pid, 0);
  ::testing::internal::CaptureStderr();
  const ChildResult r = WaitChild(pid, 300ms);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(r.timed_out) << r.Describe();
  const std::string begin = "=== stacks of hung child " + std::to_string(pid);
  const std::string end = "=== end of stacks of hung child " + std::to_string(pid);
  const size_t b = err.find(begin), e = err.find(end);
  ASSERT_NE(b, std::string::npos) << err;
  ASSERT_NE(e, std::string::npos) << err;
  EXPECT_LT(b, e);
  const std::string stacks = err.substr(b, e - b);
  EXPECT_NE(stacks.find("ThisChildHangsHere"), std::string::npos) << stacks;
  EXPECT_NE(stacks.find("pause"), std::string::npos) << stacks;
  // Killed after the stacks, and reaped: no such process any more.
  EXPECT_EQ(kill(pid, 0), -1);
}

TEST(HungChildStacksTest, NoStacksWhileHangsAreExpected) {
  const pid_t pid = ForkAHangingChild();
  ASSERT_GT(pid, 0);
  ::testing::internal::CaptureStderr();
  ChildResult r;
  {
    const ExpectingHangs hangs_are_the_point;
    r = WaitChild(pid, 200ms);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(r.timed_out) << r.Describe();
  EXPECT_EQ(err.find("=== stacks of hung child"), std::string::npos) << err;
  EXPECT_EQ(kill(pid, 0), -1);
}

// The waiting thread stopped for 2.5 s (SIGSTOP to this process from a helper, as a paused
// virtual machine would stop it) while its child, which needs 3 s, runs on: the 2 s deadline
// counts only the time the waiter ran, so the child is waited for and exits with 0 (without the
// stall rule the wait ends at 2 s, before the child).
TEST(HungChildStacksTest, TimeTheWaiterDidNotRunDoesNotCountAgainstTheChild) {
  fflush(nullptr);
  const pid_t child = fork();
  if (child == 0) {
    alarm(60);
    usleep(3000 * 1000);
    _exit(0);
  }
  ASSERT_GT(child, 0);
  const pid_t self = getpid();
  const pid_t stopper = fork();
  if (stopper == 0) {
    alarm(60);
    usleep(200 * 1000);
    kill(self, SIGSTOP);
    usleep(2500 * 1000);
    kill(self, SIGCONT);
    _exit(0);
  }
  ASSERT_GT(stopper, 0);
  const ChildResult r = WaitChild(child, 2s);
  const ChildResult s = WaitChild(stopper, 30s);
  EXPECT_TRUE(s.ok()) << s.Describe();
  EXPECT_TRUE(r.ok()) << r.Describe();
}

}  // namespace
}  // namespace forksafe::testing
