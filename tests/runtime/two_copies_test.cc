// Two copies of forksafe in one process (runtime/at_fork.h, "One registry per process, even with
// several copies of forksafe"): two shared objects that each link //runtime statically, loaded
// with dlopen(RTLD_LOCAL). They must find each other and run every fork through one registry:
// exactly one is primary, the other nests in it as one handler, and forks made while both are
// busy quiesce both. This binary links no copy of the runtime itself (//tests:support brings only
// //runtime:resources): every fork() it makes goes through the copies' pthread_atfork handler.
#include <cstdio>
#include <string>

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
      << "the primary's handlers:\n" << handlers;
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
  ASSERT_EQ(c.primary->start(), 0);
  ASSERT_EQ(c.nested->start(), 0);
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
  if (not_clean > 0) std::printf("%d of %d forks reported events; first: %s\n", not_clean, forks, example.c_str());
  c.primary->stop();
  c.nested->stop();
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
  const ChildResult r = RunInChild(
      [&] { return c.primary->work() == 0 && c.nested->work() == 0 ? 0 : 1; }, 30s, 30);
  const auto took = std::chrono::steady_clock::now() - start;
  c.nested->stop();
  ASSERT_TRUE(r.ok()) << "the child " << r.Describe();
  const std::string report = c.primary->last_report();
  EXPECT_GE(c.primary->count_events("prepare_retried", "forksafe copy in "), 1) << report;
  EXPECT_GE(c.primary->count_events("prepare_retried", "held:copy_"), 1) << report;
  EXPECT_EQ(c.primary->count_events("prepare_gave_up", ""), 0) << report;
  EXPECT_LT(took, 10s);
}

}  // namespace
}  // namespace forksafe::testing
