// The at-fork registry's pthread_atfork registration and its renewal
// (runtime/internal/fork_registration.h): a library that registers its own handlers after
// forksafe is prepared before forksafe's registry until forksafe renews its registration; then
// forksafe is prepared first and finished last, and still runs exactly once per fork.
#include "forksafe/runtime/internal/fork_registration.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>

#include "forksafe/runtime/at_fork.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::runtime {
namespace {

using forksafe::testing::ChildResult;
using forksafe::testing::RunInChild;
using namespace std::chrono_literals;

// The order in which the registry's handler ("r") and the foreign library's handlers ("x") ran
// in the last fork, as letters: prepare in upper case, parent in lower case.
char g_trace[32];
std::atomic<int> g_len{0};
void Trace(char c) {
  const int i = g_len.fetch_add(1);
  if (i < static_cast<int>(sizeof g_trace) - 1) g_trace[i] = c;
}
std::string TakeTrace() {
  const int n = std::min<int>(g_len.exchange(0), sizeof g_trace - 1);
  return std::string(g_trace, n);
}
std::atomic<int> g_acting{-2};

// A library of its own that registers with pthread_atfork after forksafe (as libomp does).
void ForeignPrepare() { Trace('X'); }
void ForeignParent() { Trace('x'); }
void ForeignChild() {}

class Recorder {
 public:
  Recorder() {
    AtForkHandler h;
    h.name = "fork_registration_test";
    h.prepare = [](const PrepareAttempt&) {
      Trace('R');
      g_acting = internal::ActingForkRegistration();
      return true;
    };
    h.parent = [](bool) { Trace('r'); };
    h.child = [](bool) { Trace('c'); };
    AtForkRegistry::Get().Register(this, std::move(h));
  }
  ~Recorder() { AtForkRegistry::Get().Unregister(this); }
};

// In one test: the registrations cannot be undone, so the steps depend on each other.
TEST(ForkRegistrationTest, RenewalPutsTheRegistryInFrontOfALaterLibraryOncePerFork) {
  Recorder recorder;
  ASSERT_EQ(internal::ActingForkRegistration(), -1) << "outside a fork";

  // 1. The foreign library registers after forksafe: its prepare runs first, its parent last.
  ASSERT_EQ(pthread_atfork(ForeignPrepare, ForeignParent, ForeignChild), 0);
  TakeTrace();
  ChildResult child = RunInChild(
      [] {
        // The child's own trace holds the prepare phase and the child callback.
        return TakeTrace() == "XRc" ? 0 : 1;
      },
      30s, 30);
  EXPECT_TRUE(child.ok()) << child.Describe();
  EXPECT_EQ(TakeTrace(), "XRrx") << "before the renewal, the later library is prepared first";
  const int first_acting = g_acting.load();

  // 2. Renewed: forksafe's registry is prepared first and finished last, once.
  const int renewed = internal::RenewForkRegistration();
  ASSERT_GT(renewed, first_acting);
  child = RunInChild([] { return TakeTrace() == "RXc" ? 0 : 1; }, 30s, 30);
  EXPECT_TRUE(child.ok()) << child.Describe() << " (1: the child's order was wrong)";
  EXPECT_EQ(TakeTrace(), "RXxr");
  EXPECT_EQ(g_acting.load(), renewed) << "the newest registration acts";
  EXPECT_EQ(internal::ActingForkRegistration(), -1);

  // 3. Forks of the child (grandchildren) keep the order: the registrations are inherited.
  child = RunInChild(
      [] {
        TakeTrace();
        const ChildResult g = RunInChild([] { return 0; }, 20s, 20);
        return g.ok() && TakeTrace() == "RXxr" ? 0 : 1;
      },
      30s, 30);
  EXPECT_TRUE(child.ok()) << child.Describe();
  TakeTrace();

  // 4. Bounded: renewals stop at kMaxForkRegistrations, and forks still run the registry once.
  int made = renewed;
  while (made < internal::kMaxForkRegistrations - 1) {
    const int n = internal::RenewForkRegistration();
    ASSERT_EQ(n, made + 1);
    made = n;
  }
  EXPECT_EQ(internal::RenewForkRegistration(), 0) << "more than kMaxForkRegistrations";
  child = RunInChild([] { return TakeTrace() == "RXc" ? 0 : 1; }, 30s, 30);
  EXPECT_TRUE(child.ok()) << child.Describe();
  EXPECT_EQ(TakeTrace(), "RXxr");
  EXPECT_EQ(g_acting.load(), internal::kMaxForkRegistrations - 1);
}

// A fork made from inside the acting registration's parent phase (here from the registry's
// event listener, which runs after the registry is unlocked) is a fork of its own: its prepare
// runs, and the outer fork's parent callbacks run once. Before the counters were reset ahead of
// the callback, the inner fork's prepare was skipped and its parent phase ran the registry's
// parent callbacks a second time.
TEST(ForkRegistrationTest, AForkFromTheParentPhaseIsAForkOfItsOwn) {
  static std::atomic<int> prepares{0}, parents{0}, inner_ok{-1};
  static std::atomic<bool> report_once{false};
  int tag;
  AtForkHandler h;
  h.name = "listener_fork_counter";
  h.prepare = [](const PrepareAttempt&) {
    ++prepares;
    // Makes the outer fork's report unclean, so that the listener runs for it.
    if (report_once.exchange(false)) {
      AtForkRegistry::ReportEvent(ForkEventKind::kSubsystemUnusable, "listener_fork_counter",
                                  "makes the report unclean on purpose");
    }
    return true;
  };
  h.parent = [](bool) { ++parents; };
  AtForkRegistration reg(&tag, std::move(h));
  std::atomic<int> listener_calls{0};
  AtForkRegistry::Get().SetEventListener([&listener_calls](const ForkReport&) {
    if (listener_calls++ != 0) return;
    const ChildResult inner = RunInChild([] { return 0; }, 20s, 20);
    inner_ok = inner.ok() ? 1 : 0;
  });
  report_once = true;
  const ChildResult outer = RunInChild([] { return 0; }, 20s, 20);
  AtForkRegistry::Get().SetEventListener(nullptr);
  EXPECT_TRUE(outer.ok()) << outer.Describe();
  EXPECT_EQ(inner_ok.load(), 1);
  EXPECT_EQ(prepares.load(), 2) << "the fork made from the listener was not prepared";
  EXPECT_EQ(parents.load(), 2) << "parent callbacks ran " << parents.load() << " times for 2 forks";
}

}  // namespace
}  // namespace forksafe::runtime
