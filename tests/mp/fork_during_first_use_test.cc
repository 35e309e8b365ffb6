// Forks that interrupt another thread's work in mp/sharing: its first use of the shared arena
// (whose making registers an at-fork handler: runtime/internal/fork_aware_once.h), and the
// locks of sharing a storage. The child must not wait for ever on what that thread held.
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/runtime/at_fork.h"
#include "gtest/gtest.h"

namespace forksafe::mp {
namespace {

TEST(ForkDuringFirstUse, AChildForkedWhileAnotherThreadMakesTheArenaCanUseIt) {
#if defined(__SANITIZE_THREAD__)
  // tsan intercepts pthread_once with its own, which a fork does not restart in the child.
  GTEST_SKIP() << "tsan's pthread_once is not fork-aware (glibc's, which forksafe relies on, is)";
#endif
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

// Two threads share tensors (share_memory_, SharedEmpty) while the main thread forks 200 times;
// each child shares one too. A child hung when a thread held the sharing's identity lock at the
// fork (held by no thread of the child).
TEST(ForkDuringFirstUse, ChildrenShareTensorsWhileParentThreadsDo) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "tsan: forks while threads run ran past the test's timeout (20 forks, 120 s)";
#endif
  std::atomic<bool> stop{false};
  std::vector<std::thread> sharers;
  for (int i = 0; i < 2; ++i) {
    sharers.emplace_back([&stop, i] {
      while (!stop) {
        device::Tensor t = device::Tensor::Zeros({64 + i});
        share_memory_(t);
        device::Tensor u = SharedEmpty({32 + i});
      }
    });
  }
  int hung = 0, failed = 0;
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  const int forks = 20;  // a fork with threads is slow under a sanitizer (200 ran past 120 s)
#else
  const int forks = 200;
#endif
  for (int k = 0; k < forks; ++k) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(5);
      device::Tensor t = device::Tensor::Zeros({128});
      share_memory_(t);
      device::Tensor u = SharedEmpty({16});
      _exit(t.is_shared() && u.is_shared() ? 0 : 3);
    }
    ASSERT_GT(pid, 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
      ++hung;
      break;  // one says it all (each costs the alarm's 5 s)
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  stop = true;
  for (auto& t : sharers) t.join();
  EXPECT_EQ(hung, 0) << "children hung sharing a tensor (a lock held by a parent's thread)";
  EXPECT_EQ(failed, 0);
}

}  // namespace
}  // namespace forksafe::mp
