// A thread pool that forksafe does not own, made fork-safe with runtime/foreign_pool.h
// (examples/tiny_pool.h), forked while it is busy.
//
//   bazel run //examples:foreign_pool_example      (it is also a test of the suite)
//
// The parent keeps two threads of a TinyPool busy and forks three times meanwhile. Each fork
// parks the pool (running tasks finish, queued ones wait, the threads are joined), the parent
// resumes it, and each child runs its own tasks on the rebuilt pool. Without the guard a child's
// pool has no threads and its tasks never run (and a thread that held the pool's mutex at the
// fork would leave it locked for ever).
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "examples/tiny_pool.h"

namespace {

using namespace std::chrono_literals;

// Waits at most `limit` for `pid`; kills and reaps it past that. True when it exited with 0.
bool WaitFor(pid_t pid, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return false;
    }
    std::this_thread::sleep_for(1ms);
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace

int main() {
  alarm(60);  // whatever happens, this program ends
  tiny::TinyPool pool(2, "example");
  std::atomic<int> done{0};
  constexpr int kTasks = 300;
  for (int i = 0; i < kTasks; ++i) {
    pool.Submit([&done] {
      std::this_thread::sleep_for(200us);  // some work
      done.fetch_add(1);
    });
  }
  int children_ok = 0;
  for (int f = 0; f < 3; ++f) {
    std::this_thread::sleep_for(5ms);  // the pool is busy
    const pid_t pid = fork();
    if (pid == 0) {
      // The child: the parent's queued tasks are not here; the pool starts fresh threads.
      std::atomic<int> mine{0};
      for (int i = 0; i < 100; ++i) pool.Submit([&mine] { mine.fetch_add(1); });
      const bool idle = pool.WaitIdle(10s);
      _exit(idle && mine.load() == 100 ? 0 : 1);
    }
    if (pid > 0 && WaitFor(pid, 20s)) ++children_ok;
  }
  const bool all_ran = pool.WaitIdle(30s) && done.load() == kTasks;
  const forksafe::runtime::ForeignPoolStats s = pool.fork_guard().stats();
  std::printf("children that ran their tasks on the rebuilt pool: %d of 3\n", children_ok);
  std::printf("parent tasks run: %d of %d (parked %llu times, resumed %llu)\n", done.load(), kTasks,
              static_cast<unsigned long long>(s.parked),
              static_cast<unsigned long long>(s.resumed));
  return children_ok == 3 && all_ran && s.parked >= 3 ? 0 : 1;
}
