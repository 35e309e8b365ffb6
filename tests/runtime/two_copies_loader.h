// tests/runtime/two_copies_loader.h: loads a copy of forksafe built as a shared object from
// two_copies_plugin.cc (a data dependency of the test), with dlopen(RTLD_NOW | RTLD_LOCAL), and
// looks up its C functions. Each copy is loaded once per process and never unloaded (a copy that
// took part in the process's forks pins itself: runtime/at_fork.h).
#ifndef FORKSAFE_TESTS_RUNTIME_TWO_COPIES_LOADER_H_
#define FORKSAFE_TESTS_RUNTIME_TWO_COPIES_LOADER_H_

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>

namespace forksafe::testing {

/// The C functions of one loaded copy (see two_copies_plugin.cc for what each does).
struct PluginCopy {
  std::string path;  ///< The absolute path it was loaded from.
  int (*role)() = nullptr;  ///< 0 primary, 1 nested, 2 separate.
  const char* (*primary_object)() = nullptr;
  const char* (*handler_names)() = nullptr;
  const char* (*last_report)() = nullptr;
  int (*count_events)(const char* kind, const char* subsystem_prefix) = nullptr;
  uint64_t (*fork_count)() = nullptr;
  int (*work)() = nullptr;
  int (*start)() = nullptr;
  void (*hold_for_ms)(int ms) = nullptr;
  void (*stop)() = nullptr;
};

/// Loads tests/runtime/<file> from the test's runfiles (the working directory of a Bazel test),
/// once per process. Returns nullptr and sets *error when it cannot.
inline PluginCopy* LoadCopy(const std::string& file, std::string* error) {
  static auto* loaded = new std::map<std::string, std::unique_ptr<PluginCopy>>();
  auto it = loaded->find(file);
  if (it != loaded->end()) return it->second.get();
  char cwd[4096];
  if (getcwd(cwd, sizeof cwd) == nullptr) {
    *error = "getcwd failed";
    return nullptr;
  }
  auto copy = std::make_unique<PluginCopy>();
  copy->path = std::string(cwd) + "/tests/runtime/" + file;
  void* h = dlopen(copy->path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    *error = std::string("dlopen: ") + dlerror();
    return nullptr;
  }
  bool ok = true;
  auto find = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (fn == nullptr) {
      ok = false;
      *error = std::string("dlsym ") + name + " failed";
    }
  };
  find(copy->role, "copy_role");
  find(copy->primary_object, "copy_primary_object");
  find(copy->handler_names, "copy_handler_names");
  find(copy->last_report, "copy_last_report");
  find(copy->count_events, "copy_count_events");
  find(copy->fork_count, "copy_fork_count");
  find(copy->work, "copy_work");
  find(copy->start, "copy_start");
  find(copy->hold_for_ms, "copy_hold_for_ms");
  find(copy->stop, "copy_stop");
  if (!ok) return nullptr;
  PluginCopy* result = copy.get();
  (*loaded)[file] = std::move(copy);
  return result;
}

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_RUNTIME_TWO_COPIES_LOADER_H_
