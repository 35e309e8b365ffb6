// tests/mp/hostile_program.h: what hostile_process_test.cc plays the program around the library
// with: SIGCHLD ignored or reaped by a handler, seccomp filters (unshare refused, fork failing with
// EAGAIN, PIDFD_GET_INFO missing as before Linux 6.15), small descriptor limits; and the harness
// that runs each case in a bounded, leak-checked child of the test (ExpectChildPasses), whose body
// returns 0 for success and CHECK()s its way through (a failed CHECK prints itself and returns
// the line number).
#ifndef FORKSAFE_TESTS_MP_HOSTILE_PROGRAM_H_
#define FORKSAFE_TESTS_MP_HOSTILE_PROGRAM_H_

#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

// Defined (strongly) only where UBSan's runtime is linked.
extern "C" void __ubsan_handle_type_mismatch_v1(void*, void*) __attribute__((weak));

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      return __LINE__ % 90 + 2; /* 2..91: not 0, nor RunInChild's 100/101 */   \
    }                                                                          \
  } while (0)

namespace forksafe::mp {

// UBSan's vptr check opens a pipe to probe memory: in a process that has used up its descriptors
// it fails, and UBSan reports a valid object as a bad one. Tests that use up every descriptor on
// purpose skip under UBSan.
inline bool UnderUbsan() { return &__ubsan_handle_type_mismatch_v1 != nullptr; }
inline constexpr const char* kUbsanNeedsDescriptors =
    "UBSan's vptr check needs free descriptors (it probes memory through a pipe), and this test "
    "uses them all up";

inline constexpr int kSkip = 77;  // a child body that cannot run here (no seccomp): the test skips

inline bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// ---- what the program around us does ----
enum class Sigchld { kIgnored, kReapingHandler };

inline void ReapEverything(int) {
  const int saved = errno;
  while (waitpid(-1, nullptr, WNOHANG) > 0) {
  }
  errno = saved;
}

inline void SetSigchld(Sigchld how) {
  struct sigaction sa {};
  sigemptyset(&sa.sa_mask);
  if (how == Sigchld::kIgnored) {
    sa.sa_handler = SIG_IGN;
  } else {
    sa.sa_handler = ReapEverything;
    sa.sa_flags = SA_RESTART;
  }
  sigaction(SIGCHLD, &sa, nullptr);
}

// Installs a seccomp filter: `unshare` fails with EPERM (deny_unshare); new processes fail with
// EAGAIN, as under RLIMIT_NPROC (deny_fork: fork(), and clone() without CLONE_THREAD, also with
// CLONE_VM (posix_spawn) when deny_vfork; clone3 gives ENOSYS so that the C library falls back to
// clone(), whose flags the filter can read); ioctl(PIDFD_GET_INFO) fails with ENOTTY, as on
// kernels before 6.15 (deny_pidfd_info: matched by the ioctl's type 0xFF and number 11, whatever
// the size of the structure). Threads are always allowed. False where the kernel refuses it.
inline bool InstallFilter(bool deny_unshare, bool deny_fork, bool deny_vfork,
                          bool deny_pidfd_info = false) {
  std::vector<sock_filter> f = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
  };
  if (deny_unshare) {
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_unshare, 0, 1));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM));
  }
  if (deny_fork) {
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS));
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_fork, 1, 0));
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_vfork, 0, 1));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EAGAIN));
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 5));
    f.push_back(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_THREAD, 2, 0));
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, deny_vfork ? 0u : CLONE_VM, 1, 0));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EAGAIN));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  }
  if (deny_pidfd_info) {
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_ioctl, 0, 4));
    f.push_back(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[1])));  // low half
    f.push_back(BPF_STMT(BPF_ALU | BPF_AND | BPF_K, 0xffff));
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0xff0b, 0, 1));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOTTY));
  }
  f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  sock_fprog prog{static_cast<unsigned short>(f.size()), f.data()};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

// Installs a seccomp filter on the calling thread only (threads started later by it inherit it):
// each system call of `calls` fails with its errno. False where the kernel refuses the filter.
inline bool FailOnThisThread(const std::vector<std::pair<long, int>>& calls) {
  std::vector<sock_filter> f = {BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr))};
  for (const auto& [nr, err] : calls) {
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | static_cast<uint32_t>(err)));
  }
  f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  sock_fprog prog{static_cast<unsigned short>(f.size()), f.data()};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

inline double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

inline double CpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

// Runs `body` in a forked child of the test with a bound, and turns its result into the test's.
inline void ExpectChildPasses(const std::function<int()>& body,
                              std::chrono::seconds limit = std::chrono::seconds(60)) {
  const testing::ChildResult r =
      testing::RunInChild(body, limit, static_cast<unsigned>(limit.count()));
  if (r.exited && r.exit_code == kSkip) GTEST_SKIP() << "seccomp filters are refused here";
  EXPECT_TRUE(r.ok()) << r.Describe() << " (see the child's stderr above)";
}

inline bool SetNofile(rlim_t n) {
  rlimit rl{n, n};
  return setrlimit(RLIMIT_NOFILE, &rl) == 0;
}

// A clear error: kResourceExhausted naming the limit and what to do.
inline bool ClearLimitError(const runtime::Error& e, const char* limit) {
  fprintf(stderr, "error: %s\n", e.what());
  return e.code() == runtime::ErrorCode::kResourceExhausted && Contains(e.message(), limit) &&
         Contains(e.message(), "raise the limit");
}

// The parent of `pid` (for a forkserver process: the fork server), from /proc; 0 if unknown.
inline pid_t ParentOf(pid_t pid) {
  FILE* f = fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "re");
  if (f == nullptr) return 0;
  char buf[1024] = {};
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  const std::string stat(buf, n);
  const size_t close_paren = stat.rfind(')');
  int ppid = 0;
  if (close_paren == std::string::npos ||
      sscanf(stat.c_str() + close_paren + 1, " %*c %d", &ppid) != 1) {
    return 0;
  }
  return ppid;
}

}  // namespace forksafe::mp

#endif  // FORKSAFE_TESTS_MP_HOSTILE_PROGRAM_H_
