// OpenMP that arrives after forksafe, by dlopen(RTLD_LOCAL) (as Python extensions load it), in a
// program that does not link OpenMP itself: forksafe finds the runtime among the loaded objects
// at each fork (not in the global scope, where dlsym(RTLD_DEFAULT) looks), pauses GNU libgomp,
// leaves LLVM's libomp to its own at-fork handlers, and every child runs a region. Built twice:
// OPENMP_PLUGIN names the plugin (tests/runtime/openmp_plugin.cc) linked with one runtime or the
// other, OPENMP_KIND the kind forksafe must see.
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/openmp_fork.h"
#include "tests/support/child_process.h"

namespace forksafe::runtime {
namespace {

using forksafe::testing::ChildResult;
using forksafe::testing::RunInChild;
using namespace std::chrono_literals;

using SumFn = long (*)(long, int);
constexpr long Expected(long n) { return n * (n - 1) / 2; }

void* g_plugin = nullptr;

// The plugin's sum function, loaded once per process (never unloaded).
SumFn LoadPlugin(std::string* error) {
  static SumFn sum = nullptr;
  if (sum != nullptr) return sum;
  char cwd[4096];
  if (getcwd(cwd, sizeof cwd) == nullptr) return *error = "getcwd failed", nullptr;
  const std::string path = std::string(cwd) + "/tests/runtime/" OPENMP_PLUGIN;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) return *error = std::string("dlopen: ") + dlerror(), nullptr;
  g_plugin = h;
  sum = reinterpret_cast<SumFn>(dlsym(h, "openmp_plugin_sum"));
  if (sum == nullptr) *error = "the plugin has no openmp_plugin_sum";
  return sum;
}

// Ends the runtime's threads after the last test. LeakSanitizer's scan at exit crashes ("Tracer
// caught signal 11") while LLVM libomp 14's threads are alive (gcc 12's ASan; the same without
// forksafe, in a six-line program that dlopens the plugin).
class PauseOpenMpAtExit : public ::testing::Environment {
 public:
  void TearDown() override {
    if (g_plugin == nullptr) return;
    auto pause = reinterpret_cast<int (*)(int)>(dlsym(g_plugin, "omp_pause_resource_all"));
    if (pause != nullptr) pause(2);  // omp_pause_hard
  }
};
::testing::Environment* const g_pause_at_exit =
    ::testing::AddGlobalTestEnvironment(new PauseOpenMpAtExit);

SumFn g_sum = nullptr;
int ChildRunsARegion() {
  if (!OpenMpUsableInThisProcess()) return 2;
  const int code = g_sum(20000, 4) == Expected(20000) ? 0 : 1;
  // LLVM libomp registers each process in /dev/shm ("__KMP_REGISTERED_LIB_<pid>_<uid>") and
  // removes the entry only at a normal exit; this child leaves with _exit (RunInChild), so it
  // removes its own (the storm left one per child before). GNU libgomp makes none: ENOENT.
  const std::string entry = "/__KMP_REGISTERED_LIB_" + std::to_string(getpid()) + "_" +
                            std::to_string(getuid());
  shm_unlink(entry.c_str());
  return code;
}

TEST(OpenMpDlopenTest, NoOpenMpBeforeThePluginThenFoundOutsideTheGlobalScope) {
  std::string error;
  if (g_sum == nullptr) {
    EXPECT_TRUE(LoadedOpenMpRuntimes().empty()) << "this binary must not link OpenMP";
    auto child = RunInChild([] { return OpenMpUsableInThisProcess() ? 0 : 1; }, 30s, 30);
    EXPECT_TRUE(child.ok()) << child.Describe();
    g_sum = LoadPlugin(&error);
  }
  ASSERT_NE(g_sum, nullptr) << error;
  ASSERT_EQ(g_sum(100000, 4), Expected(100000));
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "omp_pause_resource_all"), nullptr)
      << "the runtime came with RTLD_LOCAL: it must not be in the global scope";
  const std::vector<OpenMpRuntime> found = LoadedOpenMpRuntimes();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].kind, OpenMpRuntimeKind::OPENMP_KIND) << found[0].path;
}

TEST(OpenMpDlopenTest, ChildrenRunRegionsWhileOtherThreadsRunThem) {
  std::string error;
  if (g_sum == nullptr) g_sum = LoadPlugin(&error);
  ASSERT_NE(g_sum, nullptr) << error;
  int forks = 200;
  if (const char* v = std::getenv("FORKSAFE_STORM_FORKS")) forks = std::max(2, std::atoi(v));
  const OpenMpForkStats before = GetOpenMpForkStats();
  std::atomic<bool> stop{false};
  std::atomic<long> wrong{0};
  std::thread busy([&] {
    while (!stop.load()) wrong += g_sum(50000, 3) != Expected(50000);
  });
  std::atomic<int> ok{0}, hung{0}, failed{0};
  std::vector<std::thread> forkers;
  for (int f = 0; f < 2; ++f) {
    forkers.emplace_back([&] {
      for (int i = 0; i < forks / 2; ++i) {
        wrong += g_sum(5000, 2) != Expected(5000);
        const ChildResult r = RunInChild(ChildRunsARegion, 20s, 30);
        (r.ok() ? ok : r.timed_out ? hung : failed)++;
      }
    });
  }
  for (auto& t : forkers) t.join();
  stop = true;
  busy.join();
  std::printf("%s: %d forks, %d children ran their region, %d hung, %d failed\n", OPENMP_PLUGIN,
              (forks / 2) * 2, ok.load(), hung.load(), failed.load());
  EXPECT_EQ(hung.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(ok.load(), (forks / 2) * 2);
  EXPECT_EQ(wrong.load(), 0);
  const OpenMpForkStats after = GetOpenMpForkStats();
  if (OpenMpRuntimeKind::OPENMP_KIND == OpenMpRuntimeKind::kGnu) {
    EXPECT_EQ(after.paused - before.paused, static_cast<uint64_t>(forks / 2 * 2));
  } else {
    EXPECT_EQ(after.paused, before.paused) << "libomp is left to its own at-fork handlers";
    EXPECT_EQ(after.left_to_runtime - before.left_to_runtime,
              static_cast<uint64_t>(forks / 2 * 2));
  }
}

}  // namespace
}  // namespace forksafe::runtime
