// tests/runtime/two_copies_loader.h: loads a copy of forksafe built as a shared object from
// two_copies_plugin.cc (a data dependency of the test), with dlopen(RTLD_NOW | RTLD_LOCAL), and
// looks up its C functions. Each copy is loaded once per process and never unloaded (a copy that
// took part in the process's forks pins itself: runtime/at_fork.h).
#ifndef FORKSAFE_TESTS_RUNTIME_TWO_COPIES_LOADER_H_
#define FORKSAFE_TESTS_RUNTIME_TWO_COPIES_LOADER_H_

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <type_traits>

namespace forksafe::testing {

/// The C functions of one loaded copy (see two_copies_plugin.cc for what each does).
struct PluginCopy {
  std::string path;         ///< The absolute path it was loaded from.
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
  void (*set_throwing_framework_lock)() = nullptr;
  void (*set_listener)() = nullptr;
  int (*listener_calls)() = nullptr;
  int (*fork_from_worker)() = nullptr;
  void (*hold_framework_lock_for_ms)(int ms) = nullptr;
  int64_t (*framework_lock_released_ns)() = nullptr;
  int (*framework_lock_held_here)() = nullptr;
};

/// Loads tests/runtime/<file> from the test's runfiles (the working directory of a Bazel test),
/// once per process, with dlopen(RTLD_NOW | `scope`) (RTLD_LOCAL unless told). Returns nullptr
/// and sets *error when it cannot.
inline PluginCopy* LoadCopy(const std::string& file, std::string* error, int scope = RTLD_LOCAL) {
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
  void* h = dlopen(copy->path.c_str(), RTLD_NOW | scope);
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
  find(copy->set_throwing_framework_lock, "copy_set_throwing_framework_lock");
  find(copy->set_listener, "copy_set_listener");
  find(copy->listener_calls, "copy_listener_calls");
  find(copy->fork_from_worker, "copy_fork_from_worker");
  find(copy->hold_framework_lock_for_ms, "copy_hold_framework_lock_for_ms");
  find(copy->framework_lock_released_ns, "copy_framework_lock_released_ns");
  find(copy->framework_lock_held_here, "copy_framework_lock_held_here");
  if (!ok) return nullptr;
  PluginCopy* result = copy.get();
  (*loaded)[file] = std::move(copy);
  return result;
}

/// Runs `body` with this process's stderr (descriptor 2) sent to a temporary file, and returns
/// what was written there (a copy that loads says what went wrong on stderr).
template <typename F>
std::string CaptureStderr(F&& body) {
  std::fflush(stderr);
  FILE* file = std::tmpfile();
  const int saved = dup(2);
  if (file == nullptr || saved < 0) {
    if (file != nullptr) std::fclose(file);
    if (saved >= 0) close(saved);
    body();
    return "(stderr could not be captured)";
  }
  dup2(fileno(file), 2);
  body();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::string text;
  std::rewind(file);
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, file)) > 0) text.append(buf, n);
  std::fclose(file);
  return text;
}

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_RUNTIME_TWO_COPIES_LOADER_H_
