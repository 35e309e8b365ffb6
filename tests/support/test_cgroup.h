// tests/support/test_cgroup.h: a cgroup of a test's own, that leaves the machine as it found it.
//
// What it offers
//   TestCgroup::Make("cpu" | "memory" | ...) makes a cgroup named forksafe_test_<pid>_<controller>
//   at the root of the hierarchy that has the controller (cgroup v2 where the root's
//   cgroup.controllers lists it, else the v1 hierarchy of that controller), found through
//   runtime/internal/cgroup.h (LocateCgroups: the one locator of cgroups). A forked child joins it
//   with Join(); the test writes its limits with Write(). Used by //tests/runtime:cpu_budget_test
//   and //tests/mp:memory_cgroup_test.
//
// Guarantees (leave the machine as found)
//   - Remove(), also run by the destructor (so also when the test fails: an ASSERT returns, an
//     exception unwinds), kills what is still inside the cgroup (only the test's own descendants
//     can be there: nothing else joins it), waits (bounded) for them to leave, removes the cgroup
//     and its sub-cgroups, and, on v2, restores the root's cgroup.subtree_control: a controller
//     that Make had to enable ("+cpu") is disabled again; one that was already on is left on.
//     What could not be undone fails the test (ADD_FAILURE, from the destructor) with the path.
//   - Make removes the cgroups that earlier runs left behind (a test killed by its watchdog or by
//     Bazel's timeout runs no destructor): RemoveStaleTestCgroups below. Only directories named
//     by this fixture's scheme (and the older forksafe_test_<pid> / forksafe_cpu_test_<pid>),
//     whose pid is dead and that hold no process, are removed: never one another process uses.
//   - Tests that use the fixture on one hierarchy run one at a time, across processes (parallel
//     --runs_per_test, other test binaries): Make takes a POSIX record lock (fcntl F_SETLK) on
//     the hierarchy root's cgroup.procs, held until Remove, and waits for it at most kLockWait.
//     Without it, one run could disable the controller ("-cpu") under another run's cgroup, or
//     take it for stale. A record lock belongs to the process: children forked meanwhile do not
//     hold it (with flock, a descendant that outlived the test kept the next test waiting).
//   - Make returns null, with the reason in *why (for GTEST_SKIP), where no cgroup can be made:
//     no such controller, no write access to /sys/fs/cgroup (not root, a read-only mount: such
//     tests are tagged no-sandbox), a v2 root that will not enable the controller.
//
// Hazards
//   - Processes left in the cgroup are killed with SIGKILL at Remove: do not Join() a process the
//     test still needs afterwards.
//   - The test process must not open the hierarchy root's cgroup.procs itself while it holds a
//     TestCgroup: closing any descriptor of that file drops a record lock.
#ifndef FORKSAFE_TESTS_SUPPORT_TEST_CGROUP_H_
#define FORKSAFE_TESTS_SUPPORT_TEST_CGROUP_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace forksafe::testing {

class TestCgroup {
 public:
  /// How long Make waits for another test's cgroup on the same hierarchy to be removed (the
  /// tests that hold one take seconds; well under the watchdog's 120 s per test).
  static constexpr std::chrono::seconds kLockWait{60};

  /// Makes the cgroup (see the banner), or returns null with the reason in *why.
  static std::unique_ptr<TestCgroup> Make(const std::string& controller, std::string* why);

  /// Remove(); what could not be undone fails the current test.
  ~TestCgroup();
  TestCgroup(const TestCgroup&) = delete;
  TestCgroup& operator=(const TestCgroup&) = delete;

  bool v2() const { return v2_; }
  /// The cgroup's directory ("/sys/fs/cgroup/memory/forksafe_test_123_memory").
  const std::string& dir() const { return dir_; }
  /// The root of its hierarchy (the mount point: "/sys/fs/cgroup/memory").
  const std::string& hierarchy() const { return hierarchy_; }

  /// Makes the sub-cgroup `name` inside (removed with the cgroup); its directory, or "" (errno
  /// set) when it cannot be made.
  std::string MakeSub(const std::string& name);

  /// Writes `text` to the file `name` of the cgroup ("memory.max"); false (errno set) on failure.
  bool Write(const std::string& name, const std::string& text) const;

  /// Moves the calling process (a forked child) into `dir` (default: the cgroup); false (errno
  /// set) on failure.
  bool Join(const std::string& dir = "") const;

  /// Undoes what Make did (see the banner); returns "" or what could not be undone. Idempotent.
  std::string Remove();

 private:
  TestCgroup() = default;

  std::string controller_;
  bool v2_ = false;
  std::string hierarchy_;
  std::string dir_;
  bool enabled_controller_ = false;  // Make wrote "+controller" to the root's subtree_control
  int lock_fd_ = -1;
};

/// Removes, from the directory `hierarchy` (a cgroup hierarchy's root), the cgroups that earlier
/// runs of forksafe's tests left behind: named forksafe_test_<pid>[_...] or
/// forksafe_cpu_test_<pid>[_...], whose <pid> is not alive and that hold no process (their
/// sub-cgroups first). Returns the directories removed.
std::vector<std::string> RemoveStaleTestCgroups(const std::string& hierarchy);

/// The pids in `dir`/cgroup.procs (empty when it cannot be read).
std::vector<int> CgroupPids(const std::string& dir);

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_TEST_CGROUP_H_
