// runtime/internal/kept_resources.h: NOT FOR USERS. Where the library says what it keeps for the
// life of the process, and which caches ReleaseCachedResources() empties.
//
// A component that holds a descriptor, a child process or a shared mapping on purpose beyond the
// call that created it (the lifeline pipe, the fork server, the shm manager) registers a reporter
// once (at static initialization). The test suite's leak check asks QueryKeptResources() after
// every test: what is reported here is not that test's leak; a resource that was reported before
// a test and no longer is, but is still there, is (the library lost track of it).
//
// Thread safety: every function may be called from any thread; reporters and releasers run under
// the registry's lock, one at a time, and take their component's own lock. Reporters never throw.
// Fork: the registry's lock is not held across fork(); a child forked while another thread was
// inside one of these calls must not call them (only the tests' leak check calls them).
#ifndef FORKSAFE_RUNTIME_INTERNAL_KEPT_RESOURCES_H_
#define FORKSAFE_RUNTIME_INTERNAL_KEPT_RESOURCES_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace forksafe::runtime::internal {

/// What the library keeps now, each entry with the name of the component that keeps it.
struct KeptResources {
  std::vector<std::pair<int, std::string>> fds;         ///< Descriptor number.
  std::vector<std::pair<pid_t, std::string>> children;  ///< Child pid (running or not yet reaped).
  /// Shared mappings [start, end) of this process.
  std::vector<std::pair<std::pair<uintptr_t, uintptr_t>, std::string>> mappings;

  void AddFd(int fd, const std::string& owner) {
    if (fd >= 0) fds.emplace_back(fd, owner);
  }
  void AddChild(pid_t pid, const std::string& owner) {
    if (pid > 0) children.emplace_back(pid, owner);
  }
};

/// Registers a component: `report` adds what it keeps now (may be null), `release` empties its
/// caches (may be null). Registering the same `owner` twice replaces the first registration.
void RegisterKeptResources(const std::string& owner, std::function<void(KeptResources&)> report,
                           std::function<void()> release = nullptr);
/// Removes a registration (for tests).
void UnregisterKeptResources(const std::string& owner);

/// What every registered component keeps now.
KeptResources QueryKeptResources();

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_KEPT_RESOURCES_H_
