#include "tests/support/leak_check.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/resources.h"
#include "gtest/gtest.h"

namespace forksafe::testing {
namespace {

namespace rt = forksafe::runtime;

using Range = std::pair<uintptr_t, uintptr_t>;

// What this process holds at one instant.
struct Snapshot {
  std::map<int, std::string> fds;                          // fd -> target
  std::map<pid_t, std::pair<std::string, char>> children;  // pid -> (name, state)
  std::set<std::string> shm_names;                         // forksafe_<pid>_* in /dev/shm
  std::map<Range, std::string> mappings;                   // shared mappings -> path
};

std::string ReadLink(const std::string& path) {
  char buf[4096];
  const ssize_t n = readlink(path.c_str(), buf, sizeof(buf) - 1);
  if (n < 0) return "?";
  return std::string(buf, static_cast<size_t>(n));
}

void ReadFds(Snapshot& s) {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return;
  const int own = dirfd(d);
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = atoi(e->d_name);
    if (fd == own) continue;
    const std::string target = ReadLink(std::string("/proc/self/fd/") + e->d_name);
    if (target == "?") continue;  // closed meanwhile
    s.fds[fd] = target;
  }
  closedir(d);
}

// Children are found by their parent pid in /proc/<pid>/stat. (Reading the per-thread
// /proc/self/task/<tid>/children files while other threads run was measured to slow forked
// children that use pools down: the fork storm test took 96 s instead of 1 s.)
void ReadChildren(Snapshot& s) {
  const pid_t me = getpid();
  DIR* d = opendir("/proc");
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const pid_t pid = atoi(e->d_name);
    char path[64], line[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE* f = fopen(path, "re");
    if (f == nullptr) continue;
    const bool got = fgets(line, sizeof(line), f) != nullptr;
    fclose(f);
    if (!got) continue;
    // "pid (name) S ppid ...": the name may hold spaces and parentheses; the last ')' ends it.
    const char* open = strchr(line, '(');
    const char* close = strrchr(line, ')');
    if (open == nullptr || close == nullptr || strlen(close) < 5) continue;
    const pid_t ppid = static_cast<pid_t>(atoi(close + 4));
    if (ppid != me) continue;
    s.children[pid] = {std::string(open + 1, close), close[2]};
  }
  closedir(d);
}

uint64_t PidNamespaceId() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// False when /dev/shm entry `name` is a forksafe segment whose header (mp/internal/
// shared_arena.cc: magic, size, id, creator and live_refs, pid namespace) says another pid
// namespace made it: the same pid names another process there, and sandboxes share /dev/shm.
bool MaybeMadeHere(const std::string& name) {
  const int fd = open(("/dev/shm/" + name).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  struct stat st;
  uint64_t header[5] = {0, 0, 0, 0, 0};
  const bool full = fstat(fd, &st) == 0 && st.st_size >= 4096 &&
                    pread(fd, header, sizeof(header), 0) == static_cast<ssize_t>(sizeof(header));
  close(fd);
  return !full || header[0] != 0x66736172656e6131ull || header[4] == PidNamespaceId();
}

void ReadShmNames(Snapshot& s) {
  const std::string prefix = "forksafe_" + std::to_string(getpid()) + "_";
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    if (std::string(e->d_name).rfind(prefix, 0) == 0 && MaybeMadeHere(e->d_name)) {
      s.shm_names.insert(e->d_name);
    }
  }
  closedir(d);
}

// Lines of /proc/self/maps: "start-end perms offset dev inode   path".
void ReadMappings(Snapshot& s) {
  std::ifstream in("/proc/self/maps");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string range, perms, offset, dev, inode, path;
    f >> range >> perms >> offset >> dev >> inode;
    std::getline(f, path);
    const size_t start = path.find_first_not_of(' ');
    path = start == std::string::npos ? "" : path.substr(start);
    const bool shared = path.rfind("/dev/shm/", 0) == 0 || path.rfind("/memfd:", 0) == 0 ||
                        path.rfind("/SYSV", 0) == 0;
    if (!shared) continue;
    const size_t dash = range.find('-');
    if (dash == std::string::npos) continue;
    const Range r{std::stoull(range.substr(0, dash), nullptr, 16),
                  std::stoull(range.substr(dash + 1), nullptr, 16)};
    s.mappings[r] = path;
  }
}

Snapshot Take() {
  Snapshot s;
  ReadFds(s);
  ReadChildren(s);
  ReadShmNames(s);
  ReadMappings(s);
  return s;
}

// What the library keeps, by kind, with the keeper's name.
struct Kept {
  std::map<int, std::string> fds;
  std::map<pid_t, std::string> children;
  std::vector<std::pair<Range, std::string>> mappings;
  const std::string* MappingOwner(const Range& r) const {
    for (const auto& [k, owner] : mappings) {
      if (r.first < k.second && k.first < r.second) return &owner;
    }
    return nullptr;
  }
};

Kept QueryKept() {
  const rt::internal::KeptResources k = rt::internal::QueryKeptResources();
  Kept out;
  for (const auto& [fd, owner] : k.fds) out.fds[fd] = owner;
  for (const auto& [pid, owner] : k.children) out.children[pid] = owner;
  out.mappings = k.mappings;
  return out;
}

std::string StateName(char st) {
  switch (st) {
    case 'Z': return "zombie, not reaped";
    case 'R': return "running";
    case 'S': return "sleeping";
    case 'D': return "in uninterruptible sleep";
    case 'T':
    case 't': return "stopped";
    case 'X': return "dead";
    default: return std::string("state ") + st;
  }
}

std::string Hex(uintptr_t v) {
  char buf[32];
  snprintf(buf, sizeof(buf), "%lx", static_cast<unsigned long>(v));
  return buf;
}

// The leaks of a test, one line each ("" when none).
std::vector<std::string> Leaks(const Snapshot& before, const Kept& kept_before,
                               const Snapshot& after, const Kept& kept_after) {
  std::vector<std::string> out;
  for (const auto& [fd, target] : after.fds) {
    auto b = before.fds.find(fd);
    const bool existed = b != before.fds.end() && b->second == target;
    if (kept_after.fds.count(fd)) continue;
    if (!existed) {
      out.push_back("open file descriptor " + std::to_string(fd) + " -> " + target);
    } else if (auto k = kept_before.fds.find(fd); k != kept_before.fds.end()) {
      out.push_back("open file descriptor " + std::to_string(fd) + " -> " + target + ": the " +
                    k->second +
                    " that the library kept before this test, abandoned by it "
                    "(no longer reported as kept) but still open");
    }
  }
  for (const auto& [pid, st] : after.children) {
    if (kept_after.children.count(pid)) continue;
    const std::string what = "child process " + std::to_string(pid) + " (" + st.first + ", " +
                             StateName(st.second) + ")";
    if (!before.children.count(pid)) {
      out.push_back(what);
    } else if (auto k = kept_before.children.find(pid); k != kept_before.children.end()) {
      out.push_back(what + ": the " + k->second +
                    " that the library kept before this test, "
                    "abandoned by it (no longer reported as kept) but still there");
    }
  }
  for (const std::string& name : after.shm_names) {
    if (!before.shm_names.count(name)) out.push_back("/dev/shm entry " + name);
  }
  for (const auto& [range, path] : after.mappings) {
    auto b = before.mappings.find(range);
    if (b != before.mappings.end() && b->second == path) continue;
    if (kept_after.MappingOwner(range) != nullptr) continue;
    out.push_back("shared mapping " + Hex(range.first) + "-" + Hex(range.second) + " " + path);
  }
  return out;
}

std::mutex g_mu;
std::string g_expected_reason;  // set by ExpectLeak for the current test

std::string ExpectedReason() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_expected_reason;
}

// The leaks since (before, kept_before), given a second to go away (threads that close
// descriptors as they finish, children being reaped); at once when a leak is expected.
std::vector<std::string> SettledLeaks(const Snapshot& before, const Kept& kept_before,
                                      bool expected) {
  std::vector<std::string> leaks;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  auto sleep = std::chrono::milliseconds(5);
  for (;;) {
    rt::ReleaseCachedResources();
    const Snapshot after = Take();
    leaks = Leaks(before, kept_before, after, QueryKept());
    if (leaks.empty() || expected || std::chrono::steady_clock::now() >= deadline) return leaks;
    std::this_thread::sleep_for(sleep);
    if (sleep < std::chrono::milliseconds(100)) sleep *= 2;
  }
}

std::string List(const std::vector<std::string>& leaks) {
  std::string list;
  for (const std::string& l : leaks) list += "\n  - " + l;
  return list;
}

class LeakCheckListener : public ::testing::EmptyTestEventListener {
 public:
  void OnTestStart(const ::testing::TestInfo&) override {
    {
      std::lock_guard<std::mutex> lk(g_mu);
      g_expected_reason.clear();
    }
    rt::ReleaseCachedResources();
    before_ = Take();
    kept_before_ = QueryKept();
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    ++checked_;
    const std::string reason = ExpectedReason();
    const std::vector<std::string> leaks = SettledLeaks(before_, kept_before_, !reason.empty());
    if (leaks.empty()) return;
    const std::string list = List(leaks);
    const std::string name = std::string(info.test_suite_name()) + "." + info.name();
    if (!reason.empty()) {
      ++expected_;
      fprintf(stderr, "forksafe leak check: %s left behind, as it expects (%s):%s\n", name.c_str(),
              reason.c_str(), list.c_str());
      return;
    }
    ++leaked_;
    ADD_FAILURE() << "forksafe leak check: " << name << " left behind " << leaks.size()
                  << " resource(s):" << list
                  << "\nRelease them in the test (join/close/reap, destroy the objects), or, if "
                     "the test leaks on purpose, call forksafe::testing::ExpectLeak(\"why\").";
  }

  void OnTestProgramEnd(const ::testing::UnitTest&) override {
    fprintf(stderr, "forksafe leak check: %d test(s) checked, %d leaked, %d leaked as expected\n",
            checked_, leaked_, expected_);
  }

 private:
  Snapshot before_;
  Kept kept_before_;
  int checked_ = 0, leaked_ = 0, expected_ = 0;
};

}  // namespace

void ExpectLeak(const std::string& reason) {
  if (reason.empty()) {
    ADD_FAILURE() << "ExpectLeak needs a reason: say why this test leaves resources behind";
    return;
  }
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_expected_reason = reason;
  }
  ::testing::Test::RecordProperty("leak_expected", reason);
}

struct ChildLeakScope::State {
  Snapshot before;
  Kept kept_before;
};

ChildLeakScope::ChildLeakScope() : state_(new State) {
  rt::ReleaseCachedResources();
  state_->before = Take();
  state_->kept_before = QueryKept();
}

ChildLeakScope::~ChildLeakScope() { delete state_; }

bool ChildLeakScope::Check() {
  const std::string reason = ExpectedReason();
  const std::vector<std::string> leaks =
      SettledLeaks(state_->before, state_->kept_before, !reason.empty());
  if (leaks.empty()) return true;
  if (!reason.empty()) {
    fprintf(stderr, "forksafe leak check: child %d left behind, as it expects (%s):%s\n", getpid(),
            reason.c_str(), List(leaks).c_str());
    return true;
  }
  fprintf(stderr,
          "forksafe leak check: the body of child %d (RunInChild) left behind %zu resource(s):%s\n"
          "Release them before the body returns, or call forksafe::testing::ExpectLeak(\"why\").\n",
          getpid(), leaks.size(), List(leaks).c_str());
  return false;
}

void InstallLeakCheck() {
  ::testing::UnitTest::GetInstance()->listeners().Append(new LeakCheckListener());
}

}  // namespace forksafe::testing
