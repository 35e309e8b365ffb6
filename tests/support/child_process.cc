#include "tests/support/child_process.h"

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
  if (timed_out) return "timed out (killed by the test)";
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
  ChildResult r;
  r.pid = pid;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto sleep = std::chrono::microseconds(50);
  int status = 0;
  for (;;) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) {
      r.exited = false;
      return r;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      PrintStacksOfHungChild(pid);
      kill(pid, SIGKILL);
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      r.timed_out = true;
      return r;
    }
    std::this_thread::sleep_for(sleep);
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
