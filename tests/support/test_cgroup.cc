#include "tests/support/test_cgroup.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/runtime/internal/cgroup.h"
#include "gtest/gtest.h"

namespace forksafe::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// How long Remove waits for what it killed to leave, and for the kernel to let the directory go.
constexpr auto kRemoveWait = 10s;

bool WriteText(const std::string& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const ssize_t n = write(fd, text.data(), text.size());
  const int err = errno;
  close(fd);
  errno = err;
  return n == static_cast<ssize_t>(text.size());
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

bool HasWord(const std::string& text, const std::string& word) {
  std::istringstream in(text);
  std::string w;
  while (in >> w) {
    if (w == word) return true;
  }
  return false;
}

std::string Errno(int err) { return std::string(strerror(err)); }

// The pid in a name of the scheme "forksafe_test_<pid>[_...]" or "forksafe_cpu_test_<pid>[_...]";
// 0 for any other name.
int PidOfTestCgroupName(const std::string& name) {
  for (const char* prefix : {"forksafe_test_", "forksafe_cpu_test_"}) {
    const size_t n = strlen(prefix);
    if (name.compare(0, n, prefix) != 0) continue;
    size_t i = n;
    long pid = 0;
    while (i < name.size() && name[i] >= '0' && name[i] <= '9' && pid < (1L << 30)) {
      pid = pid * 10 + (name[i++] - '0');
    }
    if (i == n || (i < name.size() && name[i] != '_')) return 0;
    return static_cast<int>(pid);
  }
  return 0;
}

bool Alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

// The directories right under `dir` (names only).
std::vector<std::string> SubDirs(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (stat((dir + "/" + name).c_str(), &st) == 0 && S_ISDIR(st.st_mode)) out.push_back(name);
  }
  closedir(d);
  return out;
}

// `dir` and every cgroup below it, deepest first.
void DeepestFirst(const std::string& dir, std::vector<std::string>* out) {
  for (const std::string& sub : SubDirs(dir)) DeepestFirst(dir + "/" + sub, out);
  out->push_back(dir);
}

// Removes the (empty) cgroup `dir`, retrying while the kernel still counts a process that is
// leaving; "" or why it could not.
std::string RemoveDir(const std::string& dir, Clock::time_point deadline) {
  for (;;) {
    if (rmdir(dir.c_str()) == 0 || errno == ENOENT) return "";
    const int err = errno;
    if (err != EBUSY || Clock::now() >= deadline) {
      return "rmdir " + dir + ": " + Errno(err);
    }
    std::this_thread::sleep_for(10ms);
  }
}

}  // namespace

std::vector<int> CgroupPids(const std::string& dir) {
  std::vector<int> out;
  std::istringstream in(runtime::internal::ReadSmallFile(dir + "/cgroup.procs"));
  int pid = 0;
  while (in >> pid) out.push_back(pid);
  return out;
}

std::vector<std::string> RemoveStaleTestCgroups(const std::string& hierarchy) {
  std::vector<std::string> removed;
  for (const std::string& name : SubDirs(hierarchy)) {
    const int pid = PidOfTestCgroupName(name);
    if (pid == 0 || Alive(pid)) continue;  // not ours, or its run is still going
    std::vector<std::string> dirs;
    DeepestFirst(hierarchy + "/" + name, &dirs);
    const bool busy = std::any_of(dirs.begin(), dirs.end(),
                                  [](const std::string& d) { return !CgroupPids(d).empty(); });
    if (busy) continue;  // processes use it: not ours to take away
    bool ok = true;
    for (const std::string& d : dirs) ok = ok && rmdir(d.c_str()) == 0;
    if (ok) removed.push_back(hierarchy + "/" + name);
  }
  return removed;
}

std::unique_ptr<TestCgroup> TestCgroup::Make(const std::string& controller, std::string* why) {
  // Where: v2 where the root offers the controller, else its v1 hierarchy.
  const std::vector<runtime::internal::CgroupPlace> places =
      runtime::internal::LocateCgroups(controller);
  const runtime::internal::CgroupPlace* place = nullptr;
  for (const auto& p : places) {
    if (p.v2 && HasWord(runtime::internal::ReadSmallFile(p.mount_point + "/cgroup.controllers"),
                        controller)) {
      place = &p;
      break;
    }
  }
  for (const auto& p : places) {
    if (place == nullptr && !p.v2) place = &p;
  }
  if (place == nullptr) {
    *why = "no cgroup hierarchy offers the \"" + controller +
           "\" controller (neither v2's cgroup.controllers nor a v1 mount, from "
           "/proc/self/mountinfo)";
    return nullptr;
  }
  std::unique_ptr<TestCgroup> cg(new TestCgroup());
  cg->controller_ = controller;
  cg->v2_ = place->v2;
  cg->hierarchy_ = place->mount_point;

  // One test at a time on this hierarchy (see the banner): a POSIX record lock, which a forked
  // child does not inherit (an flock would stay held by any descendant that outlives the test).
  const std::string lock_file = cg->hierarchy_ + "/cgroup.procs";
  cg->lock_fd_ = open(lock_file.c_str(), O_WRONLY | O_CLOEXEC);
  if (cg->lock_fd_ < 0) {
    *why = "cannot open " + lock_file + ": " + Errno(errno) +
           ": this test needs root and a writable /sys/fs/cgroup";
    return nullptr;
  }
  const auto lock_deadline = Clock::now() + kLockWait;
  struct flock whole = {};
  whole.l_type = F_WRLCK;
  whole.l_whence = SEEK_SET;  // l_start = l_len = 0: the whole file
  while (fcntl(cg->lock_fd_, F_SETLK, &whole) != 0) {
    if (errno != EAGAIN && errno != EACCES && errno != EINTR) {
      *why = "cannot lock " + lock_file + ": " + Errno(errno);
      return nullptr;  // the destructor closes the descriptor
    }
    if (Clock::now() >= lock_deadline) {
      *why = "another test has held a cgroup on " + cg->hierarchy_ + " for " +
             std::to_string(kLockWait.count()) + " s (its lock on " + lock_file + ")";
      return nullptr;
    }
    std::this_thread::sleep_for(50ms);
  }

  // What earlier runs left behind (killed before their destructor ran).
  for (const std::string& d : RemoveStaleTestCgroups(cg->hierarchy_)) {
    fprintf(stderr, "test_cgroup: removed %s, left behind by an earlier run\n", d.c_str());
  }

  if (cg->v2_) {
    const std::string control = cg->hierarchy_ + "/cgroup.subtree_control";
    if (!HasWord(runtime::internal::ReadSmallFile(control), controller)) {
      if (!WriteText(control, "+" + controller)) {
        *why = "cannot enable the " + controller + " controller (" + control + ": " + Errno(errno) +
               "): this test needs root and a writable /sys/fs/cgroup";
        return nullptr;
      }
      cg->enabled_controller_ = true;  // to be disabled again by Remove
    }
  }
  const std::string dir =
      cg->hierarchy_ + "/forksafe_test_" + std::to_string(getpid()) + "_" + controller;
  if (mkdir(dir.c_str(), 0755) != 0) {
    *why = "cannot make a " + controller + " cgroup (mkdir " + dir + ": " + Errno(errno) +
           "): this test needs root and a writable /sys/fs/cgroup";
    return nullptr;  // the destructor restores subtree_control
  }
  cg->dir_ = dir;
  return cg;
}

TestCgroup::~TestCgroup() {
  const std::string left = Remove();
  if (!left.empty()) ADD_FAILURE() << "the test's cgroup was not undone: " << left;
}

std::string TestCgroup::MakeSub(const std::string& name) {
  const std::string sub = dir_ + "/" + name;
  return mkdir(sub.c_str(), 0755) == 0 ? sub : "";
}

bool TestCgroup::Write(const std::string& name, const std::string& text) const {
  return WriteText(dir_ + "/" + name, text);
}

bool TestCgroup::Join(const std::string& dir) const {
  return WriteText((dir.empty() ? dir_ : dir) + "/cgroup.procs", std::to_string(getpid()));
}

std::string TestCgroup::Remove() {
  std::string left;
  const auto add = [&left](const std::string& what) {
    if (!what.empty()) left += (left.empty() ? "" : "; ") + what;
  };
  if (!dir_.empty() && Exists(dir_)) {
    const auto deadline = Clock::now() + kRemoveWait;
    std::vector<std::string> dirs;
    DeepestFirst(dir_, &dirs);  // the subs first, then the cgroup
    // What is still inside (a grandchild that outlived the child that joined): only the test's
    // own descendants can be there.
    for (;;) {
      bool empty = true;
      for (const std::string& d : dirs) {
        for (const int pid : CgroupPids(d)) {
          empty = false;
          kill(pid, SIGKILL);
        }
      }
      if (empty) break;
      if (Clock::now() >= deadline) {
        add("processes still in " + dir_ + " after SIGKILL");
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    for (const std::string& d : dirs) add(RemoveDir(d, deadline));
  }
  dir_.clear();
  if (enabled_controller_) {
    const std::string control = hierarchy_ + "/cgroup.subtree_control";
    if (!WriteText(control, "-" + controller_)) {
      add("cannot restore " + control + " (\"-" + controller_ + "\"): " + Errno(errno));
    }
    enabled_controller_ = false;
  }
  if (lock_fd_ >= 0) {
    close(lock_fd_);  // releases the lock
    lock_fd_ = -1;
  }
  return left;
}

}  // namespace forksafe::testing
