// The main() of every forksafe test binary: GoogleTest plus a watchdog, so that a test that hangs
// (a deadlock after fork, a child that never answers) fails with a message instead of stalling CI,
// plus the leak check of tests/support/leak_check.h around every test.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"
#include "tests/support/leak_check.h"

namespace {

char g_current_test[512] = "(none)";
pid_t g_main_pid = 0;

void OnAlarm(int) {
  if (getpid() != g_main_pid) _exit(124);  // a forked child that inherited the alarm handler
  static const char kPrefix[] = "\n*** forksafe test watchdog: no progress, test ";
  static const char kSuffix[] = " hung; aborting the binary ***\n";
  (void)!write(2, kPrefix, sizeof(kPrefix) - 1);
  (void)!write(2, g_current_test, strlen(g_current_test));
  (void)!write(2, kSuffix, sizeof(kSuffix) - 1);
  _exit(124);
}

// Re-arms the per-test watchdog at the start of every test.
class WatchdogListener : public ::testing::EmptyTestEventListener {
 public:
  explicit WatchdogListener(unsigned seconds) : seconds_(seconds) {}
  void OnTestStart(const ::testing::TestInfo& info) override {
    snprintf(g_current_test, sizeof(g_current_test), "%s.%s", info.test_suite_name(), info.name());
    alarm(seconds_);
  }
  void OnTestEnd(const ::testing::TestInfo&) override { alarm(0); }

 private:
  unsigned seconds_;
};

}  // namespace

// Shared by the plain main below and mp_test_main.cc.
int ForksafeTestMain(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  g_main_pid = getpid();
  signal(SIGALRM, OnAlarm);
  unsigned seconds = 120;
  if (const char* v = getenv("FORKSAFE_TEST_WATCHDOG_S")) seconds = static_cast<unsigned>(atoi(v));
  ::testing::UnitTest::GetInstance()->listeners().Append(new WatchdogListener(seconds));
  // Last, so that its OnTestEnd (called in reverse order) runs while the watchdog is still armed
  // and before the printer reports the test's result.
  forksafe::testing::InstallLeakCheck();
  return RUN_ALL_TESTS();
}

#ifndef FORKSAFE_TEST_MAIN_NO_MAIN
int main(int argc, char** argv) { return ForksafeTestMain(argc, argv); }
#endif
