// tests/support/child_process.h: bounded fork-and-wait helpers for tests.
//
// Every helper here ends by itself: a child gets an alarm() so a hang kills it, and the parent
// waits at most a given time, then SIGKILLs and reaps the child and reports the timeout.
#ifndef FORKSAFE_TESTS_SUPPORT_CHILD_PROCESS_H_
#define FORKSAFE_TESTS_SUPPORT_CHILD_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>

namespace forksafe::testing {

/// How a child ended.
struct ChildResult {
  pid_t pid = -1;
  bool exited = false;  ///< Exited normally; see exit_code.
  int exit_code = -1;
  int signal = 0;          ///< Killed by this signal (0 if it exited).
  bool timed_out = false;  ///< The parent gave up waiting and killed it.
  /// True when the child exited with status 0.
  bool ok() const { return exited && exit_code == 0 && !timed_out; }
  /// "exited with 0", "killed by signal 9 (Killed)", "timed out (killed by the test)".
  std::string Describe() const;
};

/// Waits for `pid` at most `timeout`; on expiry kills it with SIGKILL, reaps it, and reports
/// timed_out.
ChildResult WaitChild(pid_t pid, std::chrono::milliseconds timeout);

/// Forks; the child arms alarm(child_alarm_s), runs `body` and _exits with its return value
/// (exit code 100 when it throws, after printing the exception; kChildLeakExitCode (101) when it
/// returned 0 but left resources behind, listed on stderr: see tests/support/leak_check.h). The
/// parent waits at most `timeout`.
/// Polls `cond` every `poll` until it holds or `limit` passes; returns whether it held (checked
/// once more at the end). For tests that wait for another process to act.
bool WaitUntil(const std::function<bool()>& cond,
               std::chrono::milliseconds limit = std::chrono::seconds(10),
               std::chrono::milliseconds poll = std::chrono::milliseconds(10));

ChildResult RunInChild(const std::function<int()>& body,
                       std::chrono::milliseconds timeout = std::chrono::seconds(60),
                       unsigned child_alarm_s = 60);

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_CHILD_PROCESS_H_
