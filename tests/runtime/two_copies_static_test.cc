// One copy of forksafe linked statically into the program and one in a shared object loaded with
// dlopen(RTLD_LOCAL) (runtime/at_fork.h, "One registry per process, even with several copies of
// forksafe"): the program's copy, loaded first, is the primary (the runtime library's linkopts
// export its instance symbol from every executable); the plugin's copy nests in it.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/internal/process_instance.h"
#include "forksafe/runtime/thread_pool.h"
#include "gtest/gtest.h"
#include "tests/runtime/two_copies_loader.h"
#include "tests/support/child_process.h"
#include "tests/support/workloads.h"

namespace forksafe::testing {
namespace {

using namespace std::chrono_literals;
using runtime::AtForkRegistry;
using runtime::RegistryRole;

// A mutex of the program held across every fork, registered before the plugin loads: prepared
// after the plugin's nested handler (prepare runs in reverse registration order), so a "not yet"
// here rolls the nested copy back.
std::mutex g_program_mu;
const bool g_program_mu_registered = (runtime::HoldAcrossFork(&g_program_mu, "held:program"), true);

// Also registered before the plugin loads, so prepared after its nested handler: records whether
// the plugin's framework lock is already held by the forking thread at that point (it must not
// be: framework locks are taken last, after every handler of every copy).
std::atomic<int (*)()> g_plugin_lock_probe{nullptr};
std::atomic<int> g_plugin_lock_seen{-1};
int g_probe_tag;
const bool g_probe_registered = [] {
  runtime::AtForkHandler h;
  h.name = "probe:program";
  h.prepare = [](const runtime::PrepareAttempt&) {
    if (int (*probe)() = g_plugin_lock_probe.load()) g_plugin_lock_seen.store(probe());
    return true;
  };
  AtForkRegistry::Get().Register(&g_probe_tag, std::move(h));
  return true;
}();

PluginCopy* LoadPlugin() {
  std::string error;
  PluginCopy* p = LoadCopy("libforksafe_copy_a.so", &error);
  EXPECT_NE(p, nullptr) << error;
  return p;
}

TEST(ProgramAndPluginTest, TheProgramExportsItsInstance) {
  void* self = dlopen(nullptr, RTLD_LAZY | RTLD_NOLOAD);
  ASSERT_NE(self, nullptr);
  EXPECT_NE(dlsym(self, "forksafe_process_instance_v1"), nullptr)
      << "the program does not export forksafe_process_instance_v1: a copy loaded later cannot "
         "find this one (runtime/BUILD.bazel's linkopts export it)";
  dlclose(self);
}

TEST(ProgramAndPluginTest, TheProgramIsPrimaryAndThePluginNests) {
  AtForkRegistry& registry = AtForkRegistry::Get();
  EXPECT_EQ(registry.role(), RegistryRole::kPrimary);
  EXPECT_FALSE(registry.IsNested());
  PluginCopy* plugin = LoadPlugin();
  ASSERT_NE(plugin, nullptr);
  EXPECT_EQ(plugin->role(), 1) << "0 primary, 1 nested, 2 separate";
  EXPECT_EQ(std::string(plugin->primary_object()), registry.PrimaryObject());
  bool found = false;
  for (const std::string& name : registry.HandlerNames()) {
    found = found || name == "forksafe copy in " + plugin->path;
  }
  EXPECT_TRUE(found) << "no handler \"forksafe copy in " << plugin->path << "\" in the program's "
                     << "registry";
}

TEST(ProgramAndPluginTest, ForksWhileBothAreBusy) {
  PluginCopy* plugin = LoadPlugin();
  ASSERT_NE(plugin, nullptr);
  runtime::ThreadPoolOptions o;
  o.num_threads = 2;
  o.name = "program";
  runtime::ThreadPool pool(o);
  ASSERT_EQ(plugin->start(), 0);
  const uint64_t plugin_forks = plugin->fork_count();
  constexpr int kForks = 30;
  for (int i = 0; i < kForks; ++i) {
    pool.Post([] {});
    const ChildResult r = RunInChild(
        [&] {
          if (PoolSum(pool, 10000) != int64_t{10000} * 9999 / 2) return 1;
          return plugin->work() == 0 ? 0 : 2;
        },
        30s, 30);
    ASSERT_TRUE(r.ok()) << "fork " << i << ": the child " << r.Describe();
    for (const runtime::ForkEvent& e : AtForkRegistry::Get().LastReport().events) {
      EXPECT_NE(e.kind, runtime::ForkEventKind::kPrepareGaveUp)
          << AtForkRegistry::Get().LastReport().ToString();
    }
  }
  plugin->stop();
  EXPECT_EQ(plugin->fork_count() - plugin_forks, static_cast<uint64_t>(kForks));
}

TEST(ProgramAndPluginTest, TheNestedFrameworkLockIsTakenAfterEveryHandler) {
  ASSERT_TRUE(g_probe_registered);
  PluginCopy* plugin = LoadPlugin();
  ASSERT_NE(plugin, nullptr);
  g_plugin_lock_probe.store(plugin->framework_lock_held_here);
  g_plugin_lock_seen.store(-1);
  const ChildResult r = RunInChild([] { return 0; }, 30s, 30);
  g_plugin_lock_probe.store(nullptr);
  ASSERT_TRUE(r.ok()) << "the child " << r.Describe();
  EXPECT_EQ(g_plugin_lock_seen.load(), 0)
      << "1: the plugin's framework lock was taken before a handler of the program registered "
         "before the plugin was prepared; -1: the probe did not run";
}

// The program's handler says "not yet" (a thread holds its mutex for 300 ms) after the nested
// copy was prepared: the primary rolls the nested copy back (NestedCopy::RollBack) and retries,
// and between attempts the nested copy's registry is free: another thread's HandlerNames() on it
// returns long before the fork ends.
TEST(ProgramAndPluginTest, AProgramHandlerNotReadyRollsTheNestedCopyBack) {
  ASSERT_TRUE(g_program_mu_registered);
  PluginCopy* plugin = LoadPlugin();
  ASSERT_NE(plugin, nullptr);
  ASSERT_EQ(plugin->work(), 0);
  std::promise<void> holding;
  std::thread holder([&holding] {
    std::lock_guard<std::mutex> lk(g_program_mu);
    holding.set_value();
    std::this_thread::sleep_for(300ms);
  });
  holding.get_future().wait();
  std::atomic<bool> done{false};
  std::atomic<int64_t> longest_ms{0};
  std::atomic<int> calls{0};
  std::thread reader([&] {
    while (!done.load()) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::string names = plugin->handler_names();
      const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::steady_clock::now() - t0)
                             .count();
      if (names.find("held:copy_a") != std::string::npos) calls.fetch_add(1);
      longest_ms.store(std::max(longest_ms.load(), ms));
      std::this_thread::sleep_for(2ms);
    }
  });
  const ChildResult r = RunInChild([] { return 0; }, 30s, 30);
  done.store(true);
  reader.join();
  holder.join();
  ASSERT_TRUE(r.ok()) << "the child " << r.Describe();
  const runtime::ForkReport report = AtForkRegistry::Get().LastReport();
  int retried = 0;
  for (const runtime::ForkEvent& e : report.events) {
    EXPECT_NE(e.kind, runtime::ForkEventKind::kPrepareGaveUp) << report.ToString();
    retried += e.kind == runtime::ForkEventKind::kPrepareRetried && e.subsystem == "held:program";
  }
  EXPECT_GE(retried, 1) << report.ToString();
  // The nested copy was called (and rolled back) on more than one attempt.
  const std::string nested_report = plugin->last_report();
  const int nested_attempts = std::atoi(nested_report.c_str() + nested_report.find(": ") + 2);
  EXPECT_GE(nested_attempts, 2) << nested_report;
  EXPECT_GE(calls.load(), 1);
  EXPECT_LT(longest_ms.load(), 1000) << "the nested copy's registry stayed locked between attempts";
}

// A copy that the primary refuses (here through the test hook; in life a 17th copy, or a copy
// whose object cannot be pinned) runs separately with its own pthread_atfork registration, and
// says so on stderr, naming both copies and why. Last in this file: that copy stays loaded.
TEST(ProgramAndPluginTest, ARefusedCopyRunsSeparatelyAndSaysSo) {
  runtime::internal::RefuseNestingForTest("nesting refused by two_copies_static_test");
  std::string error;
  PluginCopy* b = nullptr;
  const std::string said = CaptureStderr([&] { b = LoadCopy("libforksafe_copy_b.so", &error); });
  runtime::internal::RefuseNestingForTest(nullptr);
  ASSERT_NE(b, nullptr) << error;
  EXPECT_EQ(b->role(), 2) << "0 primary, 1 nested, 2 separate";
  EXPECT_NE(said.find("could not nest"), std::string::npos) << said;
  EXPECT_NE(said.find(b->path), std::string::npos) << said;
  EXPECT_NE(said.find(AtForkRegistry::Get().PrimaryObject()), std::string::npos) << said;
  EXPECT_NE(said.find("nesting refused by two_copies_static_test"), std::string::npos) << said;
  bool listed = false;
  for (const std::string& name : AtForkRegistry::Get().HandlerNames()) {
    listed = listed || name == "forksafe copy in " + b->path;
  }
  EXPECT_FALSE(listed);
  // Its own registration runs its own registry on each fork.
  const uint64_t b_forks = b->fork_count(), forks = AtForkRegistry::Get().fork_count();
  const ChildResult r = RunInChild([] { return 0; }, 30s, 30);
  ASSERT_TRUE(r.ok()) << "the child " << r.Describe();
  EXPECT_EQ(b->fork_count(), b_forks + 1);
  EXPECT_EQ(AtForkRegistry::Get().fork_count(), forks + 1);
}

}  // namespace
}  // namespace forksafe::testing
