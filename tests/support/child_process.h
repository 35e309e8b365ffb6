// tests/support/child_process.h: bounded fork-and-wait helpers for tests.
//
// Every helper here ends by itself: a child gets an alarm() so a hang kills it, and the parent
// waits at most a given time, then SIGKILLs and reaps the child and reports the timeout.
//
// A hang says where it hung: before WaitChild kills a child that ran out of time, it prints the
// stacks of every thread of that child to stderr (gdb -p, batch mode, bounded to 30 s; at most 4
// children per test process; "no gdb" said once where there is none), between the lines
// "=== stacks of hung child PID" and "=== end of stacks of hung child PID", which tools/test.sh
// quotes under "how it failed". ExpectingHangs turns it off where hangs are the point.
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
  /// When timed out: the child had exited by itself as the test gave up (it was slow, not hung;
  /// late_exit_code is its code), and how long the waiting thread itself was stalled (see
  /// WaitChild).
  bool exited_late = false;
  int late_exit_code = -1;
  std::chrono::milliseconds stalled{0};
  /// True when the child exited with status 0.
  bool ok() const { return exited && exit_code == 0 && !timed_out; }
  /// "exited with 0", "killed by signal 9 (Killed)", "timed out (killed by the test)".
  std::string Describe() const;
};

/// Waits for `pid` at most `timeout`; on expiry prints its threads' stacks (see above), kills it
/// with SIGKILL, reaps it, and reports timed_out. Time in which the waiting thread did not run
/// (a poll that overslept by more than 250 ms: the machine or the virtual machine stalled, and so,
/// most likely, did the child) does not count against the child: it extends the wait, up to twice
/// `timeout` in all.
ChildResult WaitChild(pid_t pid, std::chrono::milliseconds timeout);

/// Prints the stacks of every thread of process `pid` to stderr with gdb (bounded to 30 s), framed
/// as above. Returns false, having said why, when it printed none (no gdb, the budget of 4 per
/// process spent, or ExpectingHangs in force).
bool PrintStacksOfHungChild(pid_t pid);

/// While one lives (in any thread), WaitChild prints no stacks: for tests that make children hang
/// on purpose (a defect reproduced with its fix turned off).
class ExpectingHangs {
 public:
  ExpectingHangs();
  ~ExpectingHangs();
  ExpectingHangs(const ExpectingHangs&) = delete;
  ExpectingHangs& operator=(const ExpectingHangs&) = delete;
};

/// Forks; the child arms alarm(child_alarm_s), runs `body` and _exits with its return value
/// (exit code 100 when it throws, after printing the exception; kChildLeakExitCode (101) when it
/// returned 0 but left resources behind, listed on stderr: see tests/support/leak_check.h). The
/// parent waits at most `timeout`.
/// Threads of this process (entries of /proc/self/task); -1 when it cannot be read. A forked
/// child starts with one.
int ThreadsOfThisProcess();

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
