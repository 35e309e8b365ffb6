// A fork that interrupts another thread's first use of a lazily made singleton whose making
// registers an at-fork handler (runtime/internal/fork_aware_once.h): the child's first use
// must make its own, not wait for ever on the parent's half-made one.
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/runtime/at_fork.h"
#include "gtest/gtest.h"

namespace forksafe::mp {
namespace {

TEST(ForkDuringFirstUse, AChildForkedWhileAnotherThreadMakesTheArenaCanUseIt) {
  // A prepare that holds the fork for 300 ms: the thread below starts making the shared arena
  // meanwhile, and its constructor's registration waits for this fork to end.
  std::atomic<bool> in_prepare{false};
  static int tag;
  runtime::AtForkHandler h;
  h.name = "test_slow_prepare";
  h.prepare = [&in_prepare](const runtime::PrepareAttempt&) {
    in_prepare = true;
    usleep(300 * 1000);
    return true;
  };
  runtime::AtForkRegistry::Get().Register(&tag, std::move(h));
  std::thread maker([&in_prepare] {
    while (!in_prepare) sched_yield();
    usleep(50 * 1000);
    internal::SharedArena::Get();  // the process's first use
  });
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(10);  // a child that waits for the parent's half-made arena ends by SIGALRM
    internal::SharedArena::Get();
    _exit(0);
  }
  ASSERT_GT(pid, 0);
  maker.join();
  runtime::AtForkRegistry::Get().Unregister(&tag);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the child's first use of the arena hung (status " << status
      << "): it waited for the parent's thread that was making it when the fork came";
}

}  // namespace
}  // namespace forksafe::mp
