// The one-per-concept helpers of runtime/internal: the liveness rule (process_liveness.h) and
// random ids (random.h). Each is the only answer the library gives to its question, so each rule
// of its banner is checked here: a running process is alive, a zombie and a reaped process have
// exited, pid <= 0 is never a process; ids are non-zero and a forked child does not repeat its
// parent's.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <thread>

#include "forksafe/runtime/internal/process_liveness.h"
#include "forksafe/runtime/internal/random.h"
#include "gtest/gtest.h"

namespace forksafe::runtime::internal {
namespace {

using namespace std::chrono_literals;

// Waits (bounded) until /proc shows `pid` as a zombie; false after 10 s.
bool WaitUntilZombie(pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    siginfo_t info{};
    // WNOWAIT: look without reaping, so the child stays a zombie.
    if (waitid(P_PID, pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid) {
      return true;
    }
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

TEST(ProcessLiveness, ThisProcessAndARunningChildAreAlive) {
  EXPECT_TRUE(ProcessAlive(getpid()));
  EXPECT_FALSE(ProcessExited(getpid()));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the test
    sleep(60);                         // bounded; the parent kills it long before
    _exit(0);
  }
  EXPECT_TRUE(ProcessAlive(child));
  kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
}

TEST(ProcessLiveness, AZombieHasExitedAndSoHasAReapedProcess) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_TRUE(WaitUntilZombie(child)) << "the child did not exit within 10 s";
  // Not reaped yet: kill(pid, 0) still succeeds, yet the process runs no more code.
  EXPECT_EQ(kill(child, 0), 0);
  EXPECT_TRUE(ProcessExited(child));
  EXPECT_FALSE(ProcessAlive(child));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(ProcessExited(child));
}

TEST(ProcessLiveness, NonPositivePidsAreNeverProcesses) {
  EXPECT_FALSE(ProcessExited(0));
  EXPECT_FALSE(ProcessExited(-1));
  EXPECT_FALSE(ProcessAlive(0));
  EXPECT_FALSE(ProcessAlive(-1));
}

TEST(ProcessLiveness, InitIsAliveWhateverOurPermissions) {
  // pid 1 exists in every pid namespace; kill(1, 0) may be EPERM for a non-root user: alive.
  EXPECT_TRUE(ProcessAlive(1));
}

TEST(Random, IdsAreNonZeroAndDistinct) {
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    const uint64_t id = RandomId();
    EXPECT_NE(id, 0u);
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_EQ(RandomBytes(37).size(), 37u);
  const std::string hex = RandomHex128();
  EXPECT_EQ(hex.size(), 32u);
  EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos) << hex;
}

TEST(Random, AForkedChildDoesNotRepeatItsParentsIds) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const uint64_t id = RandomId();
    const bool ok = write(fds[1], &id, sizeof id) == static_cast<ssize_t>(sizeof id);
    _exit(ok ? 0 : 1);
  }
  close(fds[1]);  // a child that dies before writing gives end-of-file, not a read for ever
  const uint64_t mine = RandomId();
  uint64_t theirs = 0;
  ASSERT_EQ(read(fds[0], &theirs, sizeof theirs), static_cast<ssize_t>(sizeof theirs));
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_NE(mine, theirs);
}

}  // namespace
}  // namespace forksafe::runtime::internal
