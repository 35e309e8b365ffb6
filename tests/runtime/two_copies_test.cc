// Two copies of forksafe in one process (runtime/at_fork.h, "One registry per process, even with
// several copies of forksafe"): two shared objects that each link //runtime statically, loaded
// with dlopen(RTLD_LOCAL). They must find each other and run every fork through one registry:
// exactly one is primary, the other nests in it as one handler, and forks made while both are
// busy quiesce both. This binary links no copy of the runtime itself (//tests:support brings only
// //runtime:resources): every fork() it makes goes through the copies' pthread_atfork handler.
#include <cstdio>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tests/runtime/two_copies_loader.h"
#include "tests/support/child_process.h"

namespace forksafe::testing {
namespace {

using namespace std::chrono_literals;

constexpr int kPrimary = 0;
constexpr int kNested = 1;

struct Copies {
  PluginCopy* primary = nullptr;
  PluginCopy* nested = nullptr;
};

// Loads both copies (once per process) and tells which is which; fails the test unless exactly
// one is primary and the other nested (then copy a plays the primary, b the nested one).
Copies LoadBoth() {
  std::string error;
  PluginCopy* a = LoadCopy("libforksafe_copy_a.so", &error);
  EXPECT_NE(a, nullptr) << error;
  PluginCopy* b = LoadCopy("libforksafe_copy_b.so", &error);
  EXPECT_NE(b, nullptr) << error;
  Copies c;
  if (a == nullptr || b == nullptr) return c;
  const int ra = a->role(), rb = b->role();
  if (ra == kPrimary && rb == kNested) c = {a, b};
  if (rb == kPrimary && ra == kNested) c = {b, a};
  const bool decided = c.primary != nullptr;
  if (!decided) c = {a, b};  // go on, to show what else goes wrong
  EXPECT_TRUE(decided) << "roles: copy a " << ra << ", copy b " << rb
                       << " (0 primary, 1 nested, 2 separate): exactly one copy must "
                          "be primary and the other nested in it";
  return c;
}

// Stops a copy's busy work when it goes out of scope.
struct StopOnExit {
  PluginCopy* copy;
  ~StopOnExit() { copy->stop(); }
};

bool Contains(const std::string& lines, const std::string& line) {
  return ("\n" + lines).find("\n" + line + "\n") != std::string::npos;
}

// Fewer forks under the sanitizers: each fork of a sanitized process copies its shadow memory.
int StormForks() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return 40;
#else
  return 200;
#endif
}

TEST(TwoCopiesTest, ExactlyOneIsPrimaryAndTheOtherNestsInIt) {
  const Copies c = LoadBoth();
  ASSERT_NE(c.primary, nullptr);
  ASSERT_EQ(c.primary->work(), 0);  // creates each copy's pool and held mutex
  ASSERT_EQ(c.nested->work(), 0);
  const std::string handlers = c.primary->handler_names();
  EXPECT_TRUE(Contains(handlers, "forksafe copy in " + c.nested->path))
      << "the primary's handlers:\n"
      << handlers;
  EXPECT_EQ(std::string(c.nested->primary_object()), c.primary->path);
  EXPECT_EQ(std::string(c.primary->primary_object()), c.primary->path);
  // The nested copy keeps its own handlers (pool, held mutex) in its own registry.
  const std::string nested_handlers = c.nested->handler_names();
  const std::string letter = c.nested->path.find("copy_a") != std::string::npos ? "a" : "b";
  EXPECT_TRUE(Contains(nested_handlers, "thread_pool:copy_" + letter)) << nested_handlers;
  EXPECT_EQ(nested_handlers.find("forksafe copy in"), std::string::npos) << nested_handlers;
}

TEST(TwoCopiesTest, ForksManyTimesWhileBothCopiesAreBusy) {
  const Copies c = LoadBoth();
  ASSERT_NE(c.primary, nullptr);
  ASSERT_EQ(c.primary->work(), 0);
  ASSERT_EQ(c.nested->work(), 0);
  ASSERT_EQ(c.primary->start(), 0) << "2: its threads ran no first round in 20 s";
  const StopOnExit stop_primary{c.primary};  // also when an ASSERT below fails
  ASSERT_EQ(c.nested->start(), 0) << "2: its threads ran no first round in 20 s";
  const StopOnExit stop_nested{c.nested};
  const uint64_t primary_forks = c.primary->fork_count();
  const uint64_t nested_forks = c.nested->fork_count();
  const int forks = StormForks();
  int not_clean = 0;
  std::string example;
  for (int i = 0; i < forks; ++i) {
    const ChildResult r = RunInChild(
        [&] {
          if (c.primary->work() != 0) return 1;
          if (c.nested->work() != 0) return 2;
          return 0;
        },
        30s, 30);
    ASSERT_TRUE(r.ok()) << "fork " << i << ": the child " << r.Describe();
    ASSERT_EQ(c.primary->count_events("prepare_gave_up", ""), 0)
        << "fork " << i << ": " << c.primary->last_report();
    ASSERT_EQ(c.primary->count_events("subsystem_unusable", ""), 0)
        << "fork " << i << ": " << c.primary->last_report();
    const std::string report = c.primary->last_report();
    if (report.find(" 0 event(s)") == std::string::npos) {
      ++not_clean;
      if (example.empty()) example = report;
    }
  }
  // For the log: forks whose report had events (retries, drain deadlines), and the first one.
  RecordProperty("forks_with_events", not_clean);
  if (not_clean > 0)
    std::printf("%d of %d forks reported events; first: %s\n", not_clean, forks, example.c_str());
  // Every fork went through the primary's registry and through the nested copy's handlers.
  EXPECT_EQ(c.primary->fork_count() - primary_forks, static_cast<uint64_t>(forks));
  EXPECT_EQ(c.nested->fork_count() - nested_forks, static_cast<uint64_t>(forks));
}

TEST(TwoCopiesTest, NestedCopyNotReadyIsRetriedAndTheForkCompletes) {
  const Copies c = LoadBoth();
  ASSERT_NE(c.primary, nullptr);
  // A thread of the nested copy holds the mutex that copy holds across forks: its prepare says
  // "not yet" until the thread lets go, 300 ms later, well before the prepare deadline (3 s).
  c.nested->hold_for_ms(300);
  const auto start = std::chrono::steady_clock::now();
  const ChildResult r =
      RunInChild([&] { return c.primary->work() == 0 && c.nested->work() == 0 ? 0 : 1; }, 30s, 30);
  const auto took = std::chrono::steady_clock::now() - start;
  c.nested->stop();
  ASSERT_TRUE(r.ok()) << "the child " << r.Describe();
  const std::string report = c.primary->last_report();
  EXPECT_GE(c.primary->count_events("prepare_retried", "forksafe copy in "), 1) << report;
  // The nested copy's own event, forwarded under a name that says which copy it comes from.
  const std::string forwarded = "forksafe copy in " + c.nested->path + ": held:copy_";
  EXPECT_GE(c.primary->count_events("prepare_retried", forwarded.c_str()), 1) << report;
  EXPECT_EQ(c.primary->count_events("prepare_gave_up", ""), 0) << report;
  EXPECT_LT(took, 10s);
}

// A nested copy whose framework lock throws (a custom lock gone wrong) must not leave its
// registry locked: before, the exception escaped its prepare with the registry lock held, and the
// next attempt (or fork) locked it again on the same thread and hung. In a child, so that the
// throwing lock stays out of this process; the child forks twice itself.
TEST(TwoCopiesTest, AThrowingFrameworkLockInTheNestedCopyLeavesNothingLocked) {
  const Copies c = LoadBoth();
  ASSERT_NE(c.primary, nullptr);
  const std::string forwarded = "forksafe copy in " + c.nested->path + ": framework_lock";
  const ChildResult r = RunInChild(
      [&] {
        c.nested->set_throwing_framework_lock();
        for (int i = 0; i < 2; ++i) {
          const ChildResult inner = RunInChild([] { return 0; }, 20s, 20);
          if (!inner.ok()) return 10 + i;
          if (c.primary->count_events("handler_threw", forwarded.c_str()) != 1) return 20 + i;
        }
        return c.nested->work() == 0 ? 0 : 30;
      },
      40s, 40);
  EXPECT_TRUE(r.ok()) << "the child " << r.Describe()
                      << " (10+i: fork i hung or failed; 20+i: no handler_threw event for \""
                      << forwarded << "\" in the primary's report)";
}

// The nested copy's listener hears about a fork whose nested report has events (a retry), on the
// forking thread, once the primary released its registry.
TEST(TwoCopiesTest, TheNestedCopysListenerIsCalled) {
  const Copies c = LoadBoth();
  ASSERT_NE(c.primary, nullptr);
  c.nested->set_listener();
  const int before = c.nested->listener_calls();
  c.nested->hold_for_ms(200);  // its prepare says "not yet" for a while: its report has events
  const ChildResult r = RunInChild([] { return 0; }, 30s, 30);
  c.nested->stop();
  ASSERT_TRUE(r.ok()) << "the child " << r.Describe();
  EXPECT_EQ(c.nested->listener_calls(), before + 1) << c.nested->last_report();
  // A clean fork calls no listener.
  const ChildResult clean = RunInChild([] { return 0; }, 30s, 30);
  ASSERT_TRUE(clean.ok()) << "the child " << clean.Describe();
  if (std::string(c.nested->last_report()).find(" 0 event(s)") != std::string::npos) {
    EXPECT_EQ(c.nested->listener_calls(), before + 1);
  }
}

// A thread of the nested copy holds that copy's framework lock far longer than the fork may wait:
// the fork takes it once, after every copy's handlers are prepared, and gives up within the
// primary's framework-lock deadline (before, each attempt waited the nested copy's whole
// framework_lock_timeout), so the fork ends while the holder still holds it; the timeout is
// reported under the nested copy's name.
TEST(TwoCopiesTest, ANestedFrameworkLockHeldTooLongDelaysTheForkOnlyOnce) {
  const Copies c = LoadBoth();
  ASSERT_NE(c.primary, nullptr);
  c.nested->hold_framework_lock_for_ms(8000);
  c.nested->hold_for_ms(300);  // and its prepare says "not yet" for a while: several attempts
  const ChildResult r = RunInChild([] { return 0; }, 30s, 30);
  const int64_t fork_done_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count();
  const int64_t released_ns = c.nested->framework_lock_released_ns();
  const std::string report = c.primary->last_report();
  c.nested->stop();  // joins the holders
  ASSERT_TRUE(r.ok()) << "the child " << r.Describe();
  EXPECT_TRUE(released_ns == 0 || fork_done_ns < released_ns)
      << "the fork waited for the holder of the nested copy's framework lock";
  EXPECT_EQ(
      c.primary->count_events("framework_lock_timeout",
                              ("forksafe copy in " + c.nested->path + ": framework_lock").c_str()),
      1)
      << report;
}

// A worker of the nested copy's pool forks: the primary calls the nested copy's fork-entry hooks,
// so that pool's drain does not wait for the worker that is itself inside fork().
TEST(TwoCopiesTest, AWorkerOfTheNestedCopysPoolForks) {
  const Copies c = LoadBoth();
  ASSERT_NE(c.primary, nullptr);
  ASSERT_EQ(c.nested->work(), 0);
  const uint64_t forks = c.primary->fork_count();
  EXPECT_EQ(c.nested->fork_from_worker(), 0);
  EXPECT_EQ(c.primary->fork_count(), forks + 1);
  EXPECT_EQ(c.primary->count_events("prepare_gave_up", ""), 0) << c.primary->last_report();
  EXPECT_EQ(c.primary->count_events("drain_deadline_exceeded", ""), 0) << c.primary->last_report();
}

}  // namespace
}  // namespace forksafe::testing
