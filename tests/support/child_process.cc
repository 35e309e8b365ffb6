#include "tests/support/child_process.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

#include "tests/support/leak_check.h"

namespace forksafe::testing {

std::string ChildResult::Describe() const {
  if (timed_out) {
    std::string d = "timed out (killed by the test";
    if (exited_late) d += "; it had exited with " + std::to_string(late_exit_code) + " by then";
    if (stalled.count() > 0)
      d += "; the waiting thread stalled " + std::to_string(stalled.count()) + " ms";
    return d + ")";
  }
  if (exited) return "exited with " + std::to_string(exit_code);
  if (signal != 0) {
    return "killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  }
  return "did not end";
}

namespace {

std::atomic<int> g_expecting_hangs{0};
std::atomic<int> g_stack_dumps{0};
constexpr int kMaxStackDumps = 4;

// gdb on PATH, else /usr/bin/gdb; empty when there is none.
std::string FindGdb() {
  std::vector<std::string> dirs;
  if (const char* path = getenv("PATH")) {
    std::string p = path;
    for (size_t start = 0; start <= p.size();) {
      const size_t end = p.find(':', start);
      dirs.push_back(p.substr(start, end == std::string::npos ? std::string::npos : end - start));
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  dirs.push_back("/usr/bin");
  for (const std::string& d : dirs) {
    if (d.empty()) continue;
    const std::string candidate = d + "/gdb";
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// One line per thread of `pid` (state, wait channel) and its kernel stack where /proc gives it
// (root): what gdb cannot show for a zombie or for a thread stuck in the kernel.
void PrintTaskStates(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    fprintf(stderr, "  task list of %d unreadable: %s\n", pid, strerror(errno));
    return;
  }
  auto read_file = [](const std::string& path) {
    std::string out;
    if (FILE* f = fopen(path.c_str(), "r")) {
      char buf[512];
      size_t n;
      while ((n = fread(buf, 1, sizeof buf, f)) > 0 && out.size() < 4096) out.append(buf, n);
      fclose(f);
    }
    return out;
  };
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string t = dir + "/" + e->d_name;
    const std::string stat = read_file(t + "/stat");
    const size_t paren = stat.rfind(')');
    const char state =
        paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : '?';
    const std::string comm = read_file(t + "/comm");
    fprintf(stderr, "  task %s (%s) state %c wchan %s\n", e->d_name,
            comm.substr(0, comm.find('\n')).c_str(), state, read_file(t + "/wchan").c_str());
    const std::string stack = read_file(t + "/stack");
    size_t start = 0;
    for (int line = 0; line < 12 && start < stack.size(); ++line) {
      const size_t end = stack.find('\n', start);
      fprintf(stderr, "    [k] %s\n", stack.substr(start, end - start).c_str());
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  closedir(d);
}

}  // namespace

ExpectingHangs::ExpectingHangs() { g_expecting_hangs.fetch_add(1); }
ExpectingHangs::~ExpectingHangs() { g_expecting_hangs.fetch_sub(1); }

bool PrintStacksOfHungChild(pid_t pid) {
  if (g_expecting_hangs.load() > 0) return false;
  const int n = g_stack_dumps.fetch_add(1);
  if (n >= kMaxStackDumps) {
    if (n == kMaxStackDumps) {
      fprintf(stderr, "(stacks of hung child %d not printed: %d were already)\n", pid,
              kMaxStackDumps);
    }
    return false;
  }
  static const std::string gdb = FindGdb();
  if (gdb.empty()) {
    fprintf(stderr, "(stacks of hung child %d not printed: no gdb on PATH or in /usr/bin)\n", pid);
    return false;
  }
  // posix_spawn, not fork: glibc's spawn runs no at-fork handler (a test's forksafe registry
  // would otherwise prepare a fork of a process that may be in trouble itself).
  const std::string pid_text = std::to_string(pid);
  std::vector<std::string> args = {gdb,
                                   "-p",
                                   pid_text,
                                   "-batch",
                                   "-nx",
                                   "-ex",
                                   "set pagination off",
                                   "-ex",
                                   "info threads",
                                   "-ex",
                                   "thread apply all bt 25"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  fflush(stdout);
  fprintf(stderr, "=== stacks of hung child %d (%s)\n", pid, gdb.c_str());
  PrintTaskStates(pid);
  fflush(stderr);
  pid_t gdb_pid = -1;
  const int rc = posix_spawn(&gdb_pid, gdb.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    fprintf(stderr, "(gdb did not start: %s)\n=== end of stacks of hung child %d\n", strerror(rc),
            pid);
    return false;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int status = 0;
  for (;;) {
    const pid_t w = waitpid(gdb_pid, &status, WNOHANG);
    if (w == gdb_pid || (w < 0 && errno != EINTR)) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(gdb_pid, SIGKILL);
      while (waitpid(gdb_pid, &status, 0) < 0 && errno == EINTR) {
      }
      fprintf(stderr, "(gdb ran past 30 s and was killed)\n");
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  fprintf(stderr, "=== end of stacks of hung child %d\n", pid);
  return true;
}

ChildResult WaitChild(pid_t pid, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  ChildResult r;
  r.pid = pid;
  const auto start = Clock::now();
  auto deadline = start + timeout;
  const auto latest = start + 2 * timeout;  // stalls extend the wait at most this far
  Clock::duration stalled{0};
  auto prev = start;         // the last poll
  Clock::duration slept{0};  // the sleep since then
  auto sleep = std::chrono::microseconds(50);
  int status = 0;
  for (;;) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) {
      r.exited = false;
      return r;
    }
    // A poll far later than its sleep: this thread did not run (the machine stalled, a virtual
    // machine paused, a host's CPU quota), and the child most likely did not either. That time
    // does not count against it.
    const auto now = Clock::now();
    const auto overslept = now - prev - slept;
    if (overslept > std::chrono::milliseconds(250)) {
      stalled += overslept;
      deadline = std::min(latest, deadline + overslept);
    }
    prev = now;
    if (now >= deadline) {
      r.stalled = std::chrono::duration_cast<std::chrono::milliseconds>(stalled);
      fprintf(stderr,
              "child %d still running after %lld ms (this thread stalled for %lld ms of them)\n",
              pid,
              static_cast<long long>(
                  std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()),
              static_cast<long long>(r.stalled.count()));
      PrintStacksOfHungChild(pid);
      kill(pid, SIGKILL);
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      r.timed_out = true;
      if (WIFEXITED(status)) {
        r.exited_late = true;
        r.late_exit_code = WEXITSTATUS(status);
      }
      return r;
    }
    std::this_thread::sleep_for(sleep);
    slept = sleep;
    if (sleep < std::chrono::milliseconds(5)) sleep *= 2;
  }
  if (WIFEXITED(status)) {
    r.exited = true;
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
  return r;
}

int ThreadsOfThisProcess() {
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

bool WaitUntil(const std::function<bool()>& cond, std::chrono::milliseconds limit,
               std::chrono::milliseconds poll) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(poll);
  }
  return cond();
}

ChildResult RunInChild(const std::function<int()>& body, std::chrono::milliseconds timeout,
                       unsigned child_alarm_s) {
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    return ChildResult{};
  }
  if (pid == 0) {
    alarm(child_alarm_s);
    int code = 0;
    try {
#if defined(__SANITIZE_ADDRESS__)
      // gcc 12's ASan allocator is not locked around fork(): a child forked while another thread
      // of a multi-threaded test is inside malloc hangs in its first allocation. The child-body
      // leak check allocates (it reads /proc) in every child, which made that hazard frequent
      // (two children hung in one CI run), so ASan builds skip it; the plain and ubsan runs
      // check every child body.
      code = body();
#else
      ChildLeakScope leak_scope;
      code = body();
      if (!leak_scope.Check() && code == 0) code = kChildLeakExitCode;
#endif
    } catch (const std::exception& e) {
      fprintf(stderr, "child %d threw: %s\n", getpid(), e.what());
      code = 100;
    } catch (...) {
      fprintf(stderr, "child %d threw a non-std exception\n", getpid());
      code = 100;
    }
    fflush(stdout);
    fflush(stderr);
    _exit(code);
  }
  return WaitChild(pid, timeout);
}

}  // namespace forksafe::testing
