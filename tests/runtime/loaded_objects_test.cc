// runtime/internal/loaded_objects.h: an address maps to the loaded object whose PT_LOAD segments
// hold it (the program, libc, the vDSO, dlopen'ed plugins, one of them linked at a high address
// so that its load bias wraps around), an address in no object maps to none, and Find() reads
// each object's symbols at the right addresses. Built twice: as a PIE (the toolchain's default)
// and as a non-PIE program (load bias 0), loaded_objects_nopie_test.
#include "forksafe/runtime/internal/loaded_objects.h"

#include <dlfcn.h>
#include <sys/auxv.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/support/child_process.h"

// Exported from the program (-Wl,--export-dynamic-symbol in BUILD.bazel), so that it is in the
// program's dynamic symbol table.
extern "C" __attribute__((visibility("default"), noinline)) int loaded_objects_test_marker() {
  return 7;
}

namespace forksafe::runtime::internal {
namespace {

using forksafe::testing::ChildResult;
using forksafe::testing::RunInChild;
using namespace std::chrono_literals;

// What a walk found for one address. The visitor runs under the loader's write lock: it only
// copies pointers (no allocation).
struct Holder {
  const void* address = nullptr;
  const char* symbol = nullptr;  // looked up in the object that holds `address`, if any
  int objects = 0;               // how many objects hold it (1 or 0)
  const char* path = nullptr;
  void* found = nullptr;
};

bool VisitForHolder(const LoadedObject& object, void* context) {
  auto* h = static_cast<Holder*>(context);
  if (object.Contains(h->address)) {
    ++h->objects;
    h->path = object.path();
    if (h->symbol != nullptr) h->found = object.Find(h->symbol);
  }
  return true;
}

Holder HolderOf(const void* address, const char* symbol = nullptr) {
  Holder h;
  h.address = address;
  h.symbol = symbol;
  ForEachLoadedObject(&VisitForHolder, &h);
  return h;
}

bool EndsWith(const char* s, const char* suffix) {
  const size_t n = std::strlen(s), m = std::strlen(suffix);
  return n >= m && std::strcmp(s + n - m, suffix) == 0;
}

// tests/runtime/<file> from the test's runfiles, dlopen'ed RTLD_LOCAL once per process.
void* LoadPlugin(const char* file, std::string* error) {
  char cwd[4096];
  if (getcwd(cwd, sizeof cwd) == nullptr) return *error = "getcwd failed", nullptr;
  const std::string path = std::string(cwd) + "/tests/runtime/" + file;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) *error = std::string("dlopen: ") + dlerror();
  return h;
}

TEST(LoadedObjectsTest, TheProgramsAddressesMapToTheProgram) {
  const void* marker = reinterpret_cast<const void*>(&loaded_objects_test_marker);
  const Holder h = HolderOf(marker, "loaded_objects_test_marker");
  ASSERT_EQ(h.objects, 1) << "objects holding the program's own function";
  EXPECT_STREQ(h.path, "") << "the program's object has an empty path";
  EXPECT_EQ(h.found, marker) << "Find() in the program's own symbol table";
}

TEST(LoadedObjectsTest, LibcsAddressesMapToLibc) {
  // stdout points at libc's _IO_2_1_stdout_ (also in a non-PIE program, where the variable
  // `stdout` itself is copied into the program).
  const void* file = static_cast<const void*>(stdout);
  const Holder h = HolderOf(file, "_IO_2_1_stdout_");
  ASSERT_EQ(h.objects, 1) << "objects holding libc's stdout FILE";
  EXPECT_NE(std::strstr(h.path, "libc.so"), nullptr) << h.path;
  EXPECT_EQ(h.found, file) << "Find() in libc";
  // And the C library's function lies in the same object.
  const void* dl_fn = dlsym(RTLD_DEFAULT, "dl_iterate_phdr");
  ASSERT_NE(dl_fn, nullptr);
  const Holder f = HolderOf(dl_fn);
  EXPECT_EQ(f.objects, 1);
}

TEST(LoadedObjectsTest, ThePluginsAddressesMapToThePlugin) {
  std::string error;
  void* plugin = LoadPlugin("libloaded_objects_plugin.so", &error);
  ASSERT_NE(plugin, nullptr) << error;
  void* marker = dlsym(plugin, "loaded_objects_plugin_marker");
  ASSERT_NE(marker, nullptr);
  const Holder h = HolderOf(marker, "loaded_objects_plugin_marker");
  ASSERT_EQ(h.objects, 1);
  EXPECT_TRUE(EndsWith(h.path, "/libloaded_objects_plugin.so")) << h.path;
  EXPECT_EQ(h.found, marker);
  // The plugin's function is not the program's, nor libc's.
  EXPECT_EQ(HolderOf(reinterpret_cast<const void*>(&loaded_objects_test_marker),
                     "loaded_objects_plugin_marker")
                .found,
            nullptr);
  dlclose(plugin);
}

// An object linked at 0x4000000000000000 and mapped elsewhere: its load bias (where it is minus
// where it was linked) wraps around, 0xc0007f..., so it is larger than every address of the
// object. The first version took any address of the dynamic section below the bias for an
// unrelocated offset, added the bias a second time and read its symbol table at an unmapped
// address (SIGSEGV). In a child: that crash must not take the test binary down.
TEST(LoadedObjectsTest, AnObjectWhoseLoadBiasWrapsAroundIsReadAtItsRealAddresses) {
  std::string error;
  void* plugin = LoadPlugin("libloaded_objects_plugin_high.so", &error);
  ASSERT_NE(plugin, nullptr) << error;
  void* marker = dlsym(plugin, "loaded_objects_plugin_marker");
  ASSERT_NE(marker, nullptr);
  Dl_info info{};
  ASSERT_NE(dladdr(marker, &info), 0);
  const auto base = reinterpret_cast<uintptr_t>(info.dli_fbase);
  if (base >= 0x4000000000000000u) {
    dlclose(plugin);
    GTEST_SKIP() << "the loader mapped the plugin at its link address (no bias to test)";
  }
  const ChildResult r = RunInChild(
      [marker] {
        const Holder h = HolderOf(marker, "loaded_objects_plugin_marker");
        if (h.objects != 1) return 3;
        if (!EndsWith(h.path, "/libloaded_objects_plugin_high.so")) return 4;
        if (h.found != marker) return 5;
        using Fn = int (*)();
        return reinterpret_cast<Fn>(h.found)() == 42 ? 0 : 6;
      },
      30s);
  EXPECT_TRUE(r.ok()) << r.Describe()
                      << " (3: not one holder, 4: wrong object, 5: Find() is wrong, 6: wrong "
                         "function; a signal: read an unmapped address)";
  dlclose(plugin);
}

// The vDSO's dynamic section is read-only: the loader never relocates it, so its addresses are
// offsets from the bias however that compares with them.
TEST(LoadedObjectsTest, TheVdsoIsReadThroughItsUnrelocatedDynamicSection) {
  const auto vdso = reinterpret_cast<const void*>(getauxval(AT_SYSINFO_EHDR));
  if (vdso == nullptr) GTEST_SKIP() << "this process has no vDSO";
  const Holder h = HolderOf(vdso, "__vdso_clock_gettime");
  ASSERT_EQ(h.objects, 1);
  ASSERT_NE(h.found, nullptr) << "the vDSO's clock_gettime (" << h.path << ")";
  EXPECT_EQ(HolderOf(h.found).objects, 1);
  using ClockGettime = int (*)(clockid_t, timespec*);
  timespec ts{};
  EXPECT_EQ(reinterpret_cast<ClockGettime>(h.found)(CLOCK_MONOTONIC, &ts), 0);
  EXPECT_TRUE(ts.tv_sec != 0 || ts.tv_nsec != 0);
}

TEST(LoadedObjectsTest, AnAddressInNoObjectMapsToNone) {
  auto heap = std::make_unique<int>(1);
  EXPECT_EQ(HolderOf(heap.get()).objects, 0) << "a heap address";
  int local = 0;
  EXPECT_EQ(HolderOf(&local).objects, 0) << "a stack address";
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(page, MAP_FAILED);
  EXPECT_EQ(HolderOf(page).objects, 0) << "an anonymous mapping";
  munmap(page, 4096);
  EXPECT_EQ(HolderOf(nullptr).objects, 0) << "null";
  EXPECT_EQ(HolderOf(reinterpret_cast<const void*>(~uintptr_t{0} - 4096)).objects, 0)
      << "the top of the address space";
}

}  // namespace
}  // namespace forksafe::runtime::internal
