// tests/support/bounded_child.h: runs a piece of a test in a forked child whose memory is bounded,
// for tests that ask for absurd sizes (a terabyte) and expect a clean error. If a regression lets
// such a request through, the child is stopped long before the machine runs out of memory:
//   - RLIMIT_FSIZE (1 GiB), with SIGXFSZ ignored: memory files (memfd, /dev/shm) cannot be
//     truncated or fallocated past it (that memory never shows in the child's RSS);
//   - RLIMIT_AS (16 GiB), except under a sanitizer (ASan and TSan reserve terabytes of shadow);
//   - the parent polls the child's resident size every 2 ms and SIGKILLs it past 1 GiB;
//   - the parent waits at most `timeout`, then SIGKILLs and reaps it.
// No thread is started in the child (gcc's TSan aborts on threads after a multi-threaded fork).
#ifndef FORKSAFE_TESTS_SUPPORT_BOUNDED_CHILD_H_
#define FORKSAFE_TESTS_SUPPORT_BOUNDED_CHILD_H_

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

namespace forksafe::testing {

constexpr uint64_t kBoundedChildFileBytes = uint64_t{1} << 30;
constexpr uint64_t kBoundedChildAddressBytes = uint64_t{16} << 30;
constexpr uint64_t kBoundedChildRssBytes = uint64_t{1} << 30;

inline bool UnderSanitizer() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

/// Runs `body` in a bounded child (see above). Returns "" when body returned "" (success), else
/// what went wrong: body's own message, an exception, a signal, the memory bound or the timeout.
inline std::string RunBounded(const std::function<std::string()>& body,
                              std::chrono::seconds timeout = std::chrono::seconds(60)) {
  int pfd[2];
  if (pipe(pfd) != 0) return "pipe failed";
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    close(pfd[0]);
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit fsize = {kBoundedChildFileBytes, kBoundedChildFileBytes};
    setrlimit(RLIMIT_FSIZE, &fsize);
    if (!UnderSanitizer()) {
      struct rlimit as = {kBoundedChildAddressBytes, kBoundedChildAddressBytes};
      setrlimit(RLIMIT_AS, &as);
    }
    alarm(static_cast<unsigned>(timeout.count()) + 5);
    std::string out;
    try {
      out = body();
    } catch (const std::exception& e) {
      out = std::string("threw: ") + e.what();
    } catch (...) {
      out = "threw a non-std exception";
    }
    if (!out.empty()) (void)!write(pfd[1], out.data(), out.size());
    close(pfd[1]);
    _exit(out.empty() ? 0 : 1);
  }
  close(pfd[1]);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const long page = sysconf(_SC_PAGESIZE);
  std::string verdict;
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    std::ifstream statm("/proc/" + std::to_string(pid) + "/statm");
    uint64_t size_pages = 0, resident_pages = 0;
    if (statm >> size_pages >> resident_pages &&
        resident_pages * static_cast<uint64_t>(page) > kBoundedChildRssBytes) {
      verdict = "the child went over its memory bound (" + std::to_string(resident_pages * page) +
                " bytes resident): killed";
    } else if (std::chrono::steady_clock::now() > deadline) {
      verdict = "the child timed out: killed";
    }
    if (!verdict.empty()) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::string said;
  char buf[4096];
  ssize_t n;
  while ((n = read(pfd[0], buf, sizeof buf)) > 0) said.append(buf, static_cast<size_t>(n));
  close(pfd[0]);
  if (!verdict.empty()) return verdict + (said.empty() ? "" : "; it said: " + said);
  if (WIFSIGNALED(status))
    return "the child was killed by signal " + std::to_string(WTERMSIG(status));
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return said.empty() ? "the child exited with " + std::to_string(WEXITSTATUS(status)) : said;
}

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_BOUNDED_CHILD_H_
