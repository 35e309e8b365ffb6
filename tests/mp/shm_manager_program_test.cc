// Which program serves as the file_system strategy's shm manager, in a program that did NOT call
// InitMain (this test's main is //tests:support's, which does not): a Python interpreter with
// forksafe loaded is such a program, and so is a C++ program that uses no spawn or forkserver.
//   - ChoosingTheProgram: $FORKSAFE_SHM_MANAGER, then this program only after InitMain, then
//     forksafe-shm-manager beside the library; none: a message that says what to do.
//   - WithoutAManager: this program is never spawned with the manager's flag (it would run its
//     main() again); the segments are still removed when freed; the message comes once.
//   - TheManagerProgram: forksafe-shm-manager (//mp:forksafe-shm-manager) removes the segments
//     of a creator killed with SIGKILL, then exits; a program that is not a manager is given up
//     on, said once, and reaped.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/mp/sharing.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using namespace std::chrono_literals;
using testing::RunInChild;
using testing::WaitChild;
using testing::WaitUntil;

// The manager program in this test's runfiles (a data dependency).
std::string ManagerProgram() {
  const char* srcdir = getenv("TEST_SRCDIR");
  const char* ws = getenv("TEST_WORKSPACE");
  return std::string(srcdir != nullptr ? srcdir : ".") + "/" + (ws != nullptr ? ws : "forksafe") +
         "/mp/forksafe-shm-manager";
}

// The /dev/shm entries this process created (its pid in the name, and its pid namespace and
// start time in the header: sandboxes of the test runner share /dev/shm and reuse pids).
std::vector<std::string> MySegments() {
  std::vector<std::string> out;
  const std::string prefix = "forksafe_" + std::to_string(getpid()) + "_";
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    const int fd = shm_open(("/" + name).c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) continue;
    internal::SegmentHeader h{};
    const bool read = pread(fd, &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h));
    close(fd);
    if (read && h.pid_ns == internal::PidNamespaceId() &&
        h.creator_start == internal::SelfStartTicks()) {
      out.push_back(name);
    }
  }
  closedir(d);
  return out;
}

bool Exists(const std::string& shm_name) {
  struct stat st;
  return stat(("/dev/shm/" + shm_name).c_str(), &st) == 0;
}

// Runs `body` in a forked child whose stderr goes to a pipe; returns the child's exit code (or
// -1) and, in `*err`, what it wrote to stderr.
int RunCapturingStderr(const std::function<int()>& body, std::string* err) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return -1;
  const testing::ChildResult r = RunInChild([&] {
    const int saved = dup(2);
    dup2(p[1], 2);
    const int code = body();
    dup2(saved, 2);  // descriptor 2 as it was (the leak check compares it)
    close(saved);
    return code;
  });
  close(p[1]);
  char buf[4096];
  ssize_t n;
  while ((n = read(p[0], buf, sizeof(buf))) > 0) err->append(buf, static_cast<size_t>(n));
  close(p[0]);
  return r.exited ? r.exit_code : -1;
}

int Count(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (size_t at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

// ---- ChoosingTheProgram ---------------------------------------------------------------------

TEST(ChoosingTheProgram, InOrderEnvironmentThenInitMainThenBesideTheLibrary) {
  const testing::ChildResult r = RunInChild([] {
    std::string why;
    // Nothing: this test's folder has no forksafe-shm-manager and main() skipped InitMain.
    unsetenv("FORKSAFE_SHM_MANAGER");
    if (auto p = internal::ShmManagerExecutable(&why)) {
      fprintf(stderr, "chose '%s' where there is none\n", p->c_str());
      return 1;
    }
    if (why.find("InitMain") == std::string::npos ||
        why.find("FORKSAFE_SHM_MANAGER") == std::string::npos) {
      fprintf(stderr, "the message does not say what to do: %s\n", why.c_str());
      return 2;
    }
    // The variable, when it names an executable.
    setenv("FORKSAFE_SHM_MANAGER", ManagerProgram().c_str(), 1);
    auto p = internal::ShmManagerExecutable(&why);
    if (!p || *p != ManagerProgram()) return 3;
    // A variable that names no executable is an error that names it (never a fallback that
    // spawns something the user did not mean).
    setenv("FORKSAFE_SHM_MANAGER", "/nonexistent/manager", 1);
    why.clear();
    if (internal::ShmManagerExecutable(&why)) return 4;
    if (why.find("FORKSAFE_SHM_MANAGER=/nonexistent/manager") == std::string::npos) return 5;
    // After InitMain, this program serves the flag itself ("").
    unsetenv("FORKSAFE_SHM_MANAGER");
    internal::MarkInitMainCalled();
    p = internal::ShmManagerExecutable(&why);
    if (!p || !p->empty()) return 6;
    return 0;
  });
  EXPECT_TRUE(r.ok()) << r.Describe();
}

// ---- WithoutAManager ------------------------------------------------------------------------

TEST(WithoutAManager, ThisProgramIsNeverSpawnedAndSegmentsGoWhenFreed) {
  std::string err;
  const int code = RunCapturingStderr(
      [] {
        unsetenv("FORKSAFE_SHM_MANAGER");
        set_sharing_strategy("file_system");
        set_sharing_cache_enabled(false);  // a segment of its own for each tensor
        std::vector<std::string> seen;
        {
          device::Tensor a = SharedEmpty({1024});
          device::Tensor b = SharedEmpty({1024});
          seen = MySegments();
          if (seen.size() != 2) return 1;
          // No process was started: before, this program was spawned with the flag and ran
          // its main() (here: every test) again.
          if (internal::ShmManagerPid() != 0) return 2;
        }
        for (const std::string& n : seen) {
          if (Exists(n)) return 3;  // freed: unlinked by its creator
        }
        return 0;
      },
      &err);
  EXPECT_EQ(code, 0) << err;
  EXPECT_EQ(Count(err, "shm manager is unavailable"), 1) << err;
  EXPECT_NE(err.find("InitMain"), std::string::npos) << err;
}

// ---- TheManagerProgram ----------------------------------------------------------------------

// A creator that uses forksafe-shm-manager makes a segment, reports its name and its manager's
// pid, and waits to be killed.
TEST(TheManagerProgram, RemovesTheSegmentsOfACreatorKilledWithSigkill) {
  ASSERT_EQ(access(ManagerProgram().c_str(), X_OK), 0) << ManagerProgram();
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(30);
    close(p[0]);
    setenv("FORKSAFE_SHM_MANAGER", ManagerProgram().c_str(), 1);
    set_sharing_strategy("file_system");
    set_sharing_cache_enabled(false);
    device::Tensor t = SharedEmpty({4096});
    const std::vector<std::string> mine = MySegments();
    std::string report = std::to_string(internal::ShmManagerPid()) + " " +
                         (mine.size() == 1 ? mine[0] : std::string("none"));
    (void)!write(p[1], report.data(), report.size());
    close(p[1]);
    pause();
    _exit(0);
  }
  close(p[1]);
  char buf[512];
  std::string report;
  ssize_t n;
  while ((n = read(p[0], buf, sizeof(buf))) > 0) report.append(buf, static_cast<size_t>(n));
  close(p[0]);
  const size_t space = report.find(' ');
  ASSERT_NE(space, std::string::npos) << "the creator reported nothing";
  const pid_t manager = static_cast<pid_t>(atoi(report.substr(0, space).c_str()));
  const std::string segment = report.substr(space + 1);
  ASSERT_GT(manager, 0) << "no manager was started";
  ASSERT_NE(segment, "none");
  // The manager is the program, not this test binary.
  char exe[4096] = {};
  const ssize_t len =
      readlink(("/proc/" + std::to_string(manager) + "/exe").c_str(), exe, sizeof(exe) - 1);
  ASSERT_GT(len, 0);
  char want[4096];
  ASSERT_NE(realpath(ManagerProgram().c_str(), want), nullptr);
  EXPECT_STREQ(exe, want);
  ASSERT_TRUE(Exists(segment));

  kill(pid, SIGKILL);
  const testing::ChildResult r = WaitChild(pid, 30s);
  EXPECT_EQ(r.signal, SIGKILL) << r.Describe();
  EXPECT_TRUE(WaitUntil([&] { return !Exists(segment); }, 10s))
      << segment << " of the killed creator is still in /dev/shm";
  // Its work done, the manager exits (it is not this process's child: setsid, reparented).
  EXPECT_TRUE(WaitUntil([&] { return kill(manager, 0) != 0 && errno == ESRCH; }, 10s))
      << "the manager " << manager << " still runs";
}

TEST(TheManagerProgram, RunByHandItDoesNothingAndSaysWhatItIs) {
  std::string err;
  const int code = RunCapturingStderr(
      [] {
        execl(ManagerProgram().c_str(), "forksafe-shm-manager", "--help", nullptr);
        return 99;
      },
      &err);
  EXPECT_EQ(code, 2) << err;
  EXPECT_NE(err.find("not run by hand"), std::string::npos) << err;
}

// A program that is not a manager (it exits at once) is given up on once the socket says so:
// said once, never retried, reaped; the segments still go when freed.
TEST(TheManagerProgram, AProgramThatIsNotAManagerIsGivenUpOnAndReaped) {
  std::string err;
  const int code = RunCapturingStderr(
      [] {
        setenv("FORKSAFE_SHM_MANAGER", "/bin/true", 1);
        set_sharing_strategy("file_system");
        set_sharing_cache_enabled(false);
        // Each segment is told to the manager; one of these finds its end closed.
        const auto until = std::chrono::steady_clock::now() + 10s;
        int made = 0;
        while (std::chrono::steady_clock::now() < until) {
          device::Tensor t = SharedEmpty({1024});
          ++made;
          if (made > 1 && internal::ShmManagerPid() == 0) break;
          usleep(2000);
        }
        if (internal::ShmManagerPid() != 0) return 1;  // never noticed
        {
          device::Tensor t = SharedEmpty({1024});  // no new manager, no new message
          if (internal::ShmManagerPid() != 0) return 2;
        }
        if (!MySegments().empty()) return 3;  // freed: unlinked by their creator
        return 0;
      },
      &err);
  // RunInChild's leak check fails the child (101) if the dead manager were left a zombie.
  EXPECT_EQ(code, 0) << err;
  EXPECT_EQ(Count(err, "shm manager is unavailable"), 1) << err;
}

}  // namespace
}  // namespace forksafe::mp
