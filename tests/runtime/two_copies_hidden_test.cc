// A copy of forksafe whose instance symbol is hidden (a shared object linked with a version script
// `local: *;`, here libforksafe_copy_d.so, which keeps only the test's copy_* functions) is still
// found by the copies loaded after it, through the ELF note every copy carries
// (runtime/internal/process_instance.h, "Finding a copy"): loaded first, it is the primary and
// copy a nests in it. Before the note, copy a could not see it and both ran as primaries, each
// with its own pthread_atfork registration. This binary links no copy of the runtime itself.
#include <dlfcn.h>

#include <string>

#include "gtest/gtest.h"
#include "tests/runtime/two_copies_loader.h"
#include "tests/support/child_process.h"

namespace forksafe::testing {
namespace {

using namespace std::chrono_literals;

TEST(HiddenSymbolCopyTest, ACopyWithAHiddenSymbolIsFoundThroughItsNote) {
  std::string error;
  PluginCopy* d = LoadCopy("libforksafe_copy_d.so", &error);
  ASSERT_NE(d, nullptr) << error;
  void* handle = dlopen(d->path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  ASSERT_NE(handle, nullptr);
  EXPECT_EQ(dlsym(handle, "forksafe_process_instance_v1"), nullptr)
      << "the version script should hide the instance symbol of " << d->path;
  dlclose(handle);
  EXPECT_EQ(d->role(), 0) << "0 primary, 1 nested, 2 separate";

  PluginCopy* a = LoadCopy("libforksafe_copy_a.so", &error);
  ASSERT_NE(a, nullptr) << error;
  EXPECT_EQ(a->role(), 1) << "copy a did not find copy d (0 primary, 1 nested, 2 separate)";
  EXPECT_EQ(std::string(a->primary_object()), d->path);
  const std::string handlers = d->handler_names();
  EXPECT_NE(handlers.find("forksafe copy in " + a->path), std::string::npos) << handlers;

  ASSERT_EQ(d->work(), 0);
  ASSERT_EQ(a->work(), 0);
  const uint64_t forks = a->fork_count();
  const ChildResult r =
      RunInChild([&] { return d->work() == 0 && a->work() == 0 ? 0 : 1; }, 30s, 30);
  ASSERT_TRUE(r.ok()) << "the child " << r.Describe();
  EXPECT_EQ(a->fork_count(), forks + 1);
}

}  // namespace
}  // namespace forksafe::testing
