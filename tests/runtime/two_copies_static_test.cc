// One copy of forksafe linked statically into the program and one in a shared object loaded with
// dlopen(RTLD_LOCAL) (runtime/at_fork.h, "One registry per process, even with several copies of
// forksafe"): the program's copy, loaded first, is the primary (the runtime library's linkopts
// export its instance symbol from every executable); the plugin's copy nests in it.
#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "gtest/gtest.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/thread_pool.h"
#include "tests/runtime/two_copies_loader.h"
#include "tests/support/child_process.h"
#include "tests/support/workloads.h"

namespace forksafe::testing {
namespace {

using namespace std::chrono_literals;
using runtime::AtForkRegistry;
using runtime::RegistryRole;

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

}  // namespace
}  // namespace forksafe::testing
