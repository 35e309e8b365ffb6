// tests/support/leak_check.h: the leak check that runs around every test of every test binary.
//
// What it offers
//   A GoogleTest listener, installed by the test mains (test_main.cc, so both //tests:support and
//   //tests:mp_support), that takes a snapshot when a test starts and compares it with the state
//   when the test ends. The test fails (a non-fatal failure added to it, never a crash) when it
//   left behind anything of this process's that was not there before:
//     - an open file descriptor (listed with its number and target, from /proc/self/fd),
//     - a child process, running or a zombie not reaped (pid, name and state, from the parent
//       pid in /proc/<pid>/stat),
//     - a /dev/shm entry whose name says this process created it (forksafe_<pid>_*),
//     - a shared memory mapping (/dev/shm/..., /memfd:..., SysV; range and path, from
//       /proc/self/maps).
//   Before comparing, it calls runtime::ReleaseCachedResources() (the library's caches are not
//   leaks), and it leaves out what the library says it keeps for the life of the process
//   (runtime/internal/kept_resources.h: the lifeline pipe, the fork server, the shm manager): a
//   server started by a test is not that test's leak. Something the library kept before the test
//   and no longer reports, but that is still there, is a leak ("abandoned"). What a test leaves
//   behind is given a second to disappear (threads that close descriptors as they finish), then
//   reported.
//
//   A test that must leave something behind says so, with a reason, by calling ExpectLeak("why")
//   (grep for ExpectLeak to find them all); its leaks are printed, not failed, and the reason is
//   recorded as the test's "leak_expected" property in test.xml.
//
//   The body of a forked child run by RunInChild (tests/support/child_process.h) is checked the
//   same way, against the child's state right after the fork: a body that returns and leaves
//   something behind makes the child exit with kChildLeakExitCode instead of its own code.
//
// Thread safety: ExpectLeak is called from the test's body (any thread of the test). The listener
// runs on GoogleTest's thread. In a forked child of a test nothing of this runs.
#ifndef FORKSAFE_TESTS_SUPPORT_LEAK_CHECK_H_
#define FORKSAFE_TESTS_SUPPORT_LEAK_CHECK_H_

#include <string>

namespace forksafe::testing {

/// Exit code of a RunInChild child whose body returned 0 but left resources behind.
inline constexpr int kChildLeakExitCode = 101;

/// The current test is allowed to leave resources behind, for `reason` (required, non-empty).
void ExpectLeak(const std::string& reason);

/// The same check for the body of a forked child (RunInChild uses it): a snapshot when
/// constructed (right after the fork), compared by Check() when the body has returned.
class ChildLeakScope {
 public:
  ChildLeakScope();
  ~ChildLeakScope();
  ChildLeakScope(const ChildLeakScope&) = delete;
  ChildLeakScope& operator=(const ChildLeakScope&) = delete;
  /// True when the body left nothing behind (or ExpectLeak was called); otherwise prints the
  /// leaks to stderr and returns false.
  bool Check();

 private:
  struct State;
  State* state_;
};

/// Appends the leak-check listener to GoogleTest's listeners (the test mains call it once, after
/// InitGoogleTest, as the last listener so that its result is in before the printer's).
void InstallLeakCheck();

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_LEAK_CHECK_H_
