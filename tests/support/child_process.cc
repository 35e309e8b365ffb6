#include "tests/support/child_process.h"

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <thread>

#include "tests/support/leak_check.h"

namespace forksafe::testing {

std::string ChildResult::Describe() const {
  if (timed_out) return "timed out (killed by the test)";
  if (exited) return "exited with " + std::to_string(exit_code);
  if (signal != 0) {
    return "killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  }
  return "did not end";
}

ChildResult WaitChild(pid_t pid, std::chrono::milliseconds timeout) {
  ChildResult r;
  r.pid = pid;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto sleep = std::chrono::microseconds(50);
  int status = 0;
  for (;;) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) {
      r.exited = false;
      return r;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(pid, SIGKILL);
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      r.timed_out = true;
      return r;
    }
    std::this_thread::sleep_for(sleep);
    if (sleep < std::chrono::milliseconds(5)) sleep *= 2;
  }
  if (WIFEXITED(status)) {
    r.exited = true;
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
  return r;
}

bool WaitUntil(const std::function<bool()>& cond, std::chrono::milliseconds limit,
               std::chrono::milliseconds poll) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(poll);
  }
  return cond();
}

ChildResult RunInChild(const std::function<int()>& body, std::chrono::milliseconds timeout,
                       unsigned child_alarm_s) {
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    return ChildResult{};
  }
  if (pid == 0) {
    alarm(child_alarm_s);
    int code = 0;
    try {
#if defined(__SANITIZE_ADDRESS__)
      // gcc 12's ASan allocator is not locked around fork(): a child forked while another thread
      // of a multi-threaded test is inside malloc hangs in its first allocation. The child-body
      // leak check allocates (it reads /proc) in every child, which made that hazard frequent
      // (two children hung in one CI run), so ASan builds skip it; the plain and ubsan runs
      // check every child body.
      code = body();
#else
      ChildLeakScope leak_scope;
      code = body();
      if (!leak_scope.Check() && code == 0) code = kChildLeakExitCode;
#endif
    } catch (const std::exception& e) {
      fprintf(stderr, "child %d threw: %s\n", getpid(), e.what());
      code = 100;
    } catch (...) {
      fprintf(stderr, "child %d threw a non-std exception\n", getpid());
      code = 100;
    }
    fflush(stdout);
    fflush(stderr);
    _exit(code);
  }
  return WaitChild(pid, timeout);
}

}  // namespace forksafe::testing
