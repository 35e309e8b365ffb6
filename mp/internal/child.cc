#include "forksafe/mp/internal/child.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cxxabi.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "forksafe/device/registry.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/internal/mutex.h"

extern char** environ;

namespace forksafe::mp::internal {
namespace {

using runtime::Error;
using runtime::ErrorCode;

// ---- lifeline ----
struct Lifeline {
  runtime::internal::Mutex mu;
  int read_end FORKSAFE_GUARDED_BY(mu) = -1;
  int write_end FORKSAFE_GUARDED_BY(mu) = -1;
};

Lifeline& TheLifeline() {
  static auto* l = new Lifeline();  // leaked; its descriptors are closed in forked children
  return *l;
}

// Forked children must not hold their parent's lifeline: close it, start afresh lazily.
const bool g_lifeline_handler = [] {
  runtime::HoldAcrossFork(&TheLifeline().mu, "mp_lifeline", [] {
    Lifeline& l = TheLifeline();
    l.mu.AssertHeld();  // the child's only thread: held, or free after a fork made alone
    // Written only when open: each page a child writes costs it a copy-on-write fault.
    if (l.read_end >= 0) {
      ::close(l.read_end);
      l.read_end = -1;
    }
    if (l.write_end >= 0) {
      ::close(l.write_end);
      l.write_end = -1;
    }
  });
  runtime::internal::RegisterKeptResources("mp_lifeline", [](runtime::internal::KeptResources& k) {
    Lifeline& l = TheLifeline();
    runtime::internal::MutexLock lk(&l.mu);
    k.AddFd(l.read_end, "mp lifeline pipe (read end)");
    k.AddFd(l.write_end, "mp lifeline pipe (write end)");
  });
  return true;
}();

std::string& Argv0Storage() {
  static auto* s = new std::string("/proc/self/exe");
  return *s;
}

}  // namespace

std::string Demangle(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = (status == 0 && d != nullptr) ? d : name;
  free(d);
  return out;
}

void SetArgv0(const char* argv0) {
  if (argv0 != nullptr && *argv0 != '\0') Argv0Storage() = argv0;
}
const std::string& Argv0() { return Argv0Storage(); }

namespace {
std::atomic<bool> g_init_main_called{false};
}  // namespace
void MarkInitMainCalled() { g_init_main_called.store(true, std::memory_order_relaxed); }
bool InitMainCalled() { return g_init_main_called.load(std::memory_order_relaxed); }

FileDescriptor LifelineReadEnd() {
  Lifeline& l = TheLifeline();
  runtime::internal::MutexLock lk(&l.mu);
  if (l.read_end < 0) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
      ThrowCannotStartProcess("pipe2 for the children's lifeline", errno);
    }
    l.read_end = p[0];
    l.write_end = p[1];
  }
  return FileDescriptor::Dup(l.read_end);
}

namespace {

[[noreturn]] void DieWithParent() {
  ::kill(getpid(), SIGKILL);
  for (;;) pause();
}

// Kills this process once getppid() is no longer `parent` (the parent died; we were reparented).
[[noreturn]] void WatchParentPid(pid_t parent) {
  while (getppid() == parent) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  DieWithParent();
}

// Closes every descriptor of the calling thread's private table but `keep`, by system call: the
// sanitizers' close() interceptors track descriptors per process, and these copies are not the
// process's.
void CloseAllInPrivateTableBut(int keep) {
  bool ok = keep == 0 || syscall(SYS_close_range, 0u, static_cast<unsigned>(keep - 1), 0u) == 0;
  ok = ok && syscall(SYS_close_range, static_cast<unsigned>(keep + 1), ~0u, 0u) == 0;
  if (ok) return;
  rlimit rl{};  // kernels before 5.9: one by one, up to the table's limit
  long max = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
                 ? static_cast<long>(rl.rlim_cur)
                 : 65536;
  if (max > (1 << 20)) max = 1 << 20;
  for (long fd = 0; fd < max; ++fd) {
    if (fd != keep) syscall(SYS_close, fd);
  }
}

}  // namespace

void WatchLifeline(FileDescriptor read_end) {
  if (!read_end) return;
  const int fd = read_end.get();
  struct stat st {};
  fstat(fd, &st);
  const pid_t parent = getppid();
  struct Handshake {
    runtime::internal::Mutex mu;
    runtime::internal::CondVar cv;
    int mode FORKSAFE_GUARDED_BY(mu) = 0;  // 1: private descriptor table, 2: the process's table
  };
  auto hs = std::make_shared<Handshake>();
  try {
    std::thread([fd, parent, hs, dev = st.st_dev, ino = st.st_ino] {
      // The program's signal handlers (a SIGCHLD handler, say) never run on this thread.
      sigset_t all;
      sigfillset(&all);
      pthread_sigmask(SIG_BLOCK, &all, nullptr);
      const bool private_table = unshare(CLONE_FILES) == 0;
      if (private_table) CloseAllInPrivateTableBut(fd);
      {
        runtime::internal::MutexLock lk(&hs->mu);
        hs->mode = private_table ? 1 : 2;
      }
      hs->cv.NotifyAll();
      if (private_table) {
        // By system call, as above: this copy of `fd` is the thread's alone, and the process's
        // copy is closed meanwhile, which the sanitizers (one table per process) would take for
        // a race.
        char c;
        while (syscall(SYS_read, fd, &c, 1) < 0 && errno == EINTR) {
        }
        DieWithParent();  // end-of-file: the parent is gone
      }
      // The process's table, which the program may change under us at any moment: never read
      // (the number may be someone else's file by then), only poll for the hang-up, and trust it
      // only if the descriptor is still the lifeline afterwards. Otherwise watch getppid(),
      // which is right both when the program took the number and when the parent died meanwhile.
      // (By system calls: the sanitizers would report the program's own open/close of that
      // number as a race with this thread, which is exactly the case handled here.)
      for (;;) {
        pollfd p{fd, POLLIN, 0};
        timespec period{0, 50 * 1000 * 1000};
        const long n = syscall(SYS_ppoll, &p, 1, &period, nullptr, 0);
        if (n < 0 && errno == EINTR) continue;
        struct stat now {};
        if (syscall(SYS_fstat, fd, &now) != 0 || now.st_dev != dev || now.st_ino != ino) {
          WatchParentPid(parent);
        }
        if (n > 0 && (p.revents & (POLLHUP | POLLERR))) DieWithParent();
        if (n > 0) WatchParentPid(parent);  // readable without a hang-up: not our pipe's doing
      }
    }).detach();
  } catch (const std::exception&) {
    // No thread to be had (a thread limit): the kernel's parent-death signal is the last resort.
    // It fires when the thread that started this process exits, which is why it is not the rule.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) DieWithParent();
    return;
  }
  runtime::internal::MutexLock lk(&hs->mu);
  while (hs->mode == 0) hs->cv.Wait(&lk);
  if (hs->mode == 1) {
    read_end.reset();  // the watcher holds its own copy; this table keeps none
  } else {
    (void)read_end.release();  // the watcher reads this very descriptor
  }
}

// ---- reaping our own children ----

namespace {

// PIDFD_GET_INFO (Linux 6.15+), its first version: what the kernel keeps of a process for its
// pidfds, including the exit status after someone else reaped it. Declared here because the C
// library's headers of this distribution predate it.
struct PidfdInfoV0 {
  uint64_t mask;
  uint64_t cgroupid;
  uint32_t pid, tgid, ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid;
  int32_t exit_code;
};
constexpr unsigned long kPidfdGetInfo = _IOWR(0xFF, 11, PidfdInfoV0);
constexpr uint64_t kPidfdInfoExit = uint64_t{1} << 3;
constexpr idtype_t kPPidfd = static_cast<idtype_t>(3);  // P_PIDFD (Linux 5.4+)

std::optional<int> PidfdExitStatus(int pidfd) {
  PidfdInfoV0 info{};
  info.mask = kPidfdInfoExit;
  if (ioctl(pidfd, kPidfdGetInfo, &info) != 0 || (info.mask & kPidfdInfoExit) == 0) {
    return std::nullopt;
  }
  return info.exit_code;
}

int WaitStatusOf(const siginfo_t& si) {
  switch (si.si_code) {
    case CLD_EXITED: return (si.si_status & 0xff) << 8;
    case CLD_KILLED: return si.si_status & 0x7f;
    case CLD_DUMPED: return (si.si_status & 0x7f) | 0x80;
    default: return 0;
  }
}

}  // namespace

ReapResult ReapChild(pid_t pid, int pidfd) {
  ReapResult r;
  if (pidfd >= 0) {
    siginfo_t si;
    memset(&si, 0, sizeof(si));
    int rc;
    do {
      rc = waitid(kPPidfd, static_cast<id_t>(pidfd), &si, WEXITED | WNOHANG);
    } while (rc < 0 && errno == EINTR);
    if (rc == 0) {
      if (si.si_pid == 0) return r;  // running
      r.state = ReapResult::kReaped;
      r.status_known = true;
      r.wait_status = WaitStatusOf(si);
      return r;
    }
    if (errno == ECHILD) {
      r.state = ReapResult::kReapedElsewhere;
      if (std::optional<int> st = PidfdExitStatus(pidfd)) {
        r.status_known = true;
        r.wait_status = *st;
      }
      return r;
    }
    if (errno != EINVAL) {
      runtime::ThrowSystemError(absl::StrCat("waitid(P_PIDFD) for pid ", pid), errno);
    }
    // EINVAL: a kernel without P_PIDFD; by pid, then.
  }
  int status = 0;
  pid_t w;
  do {
    w = waitpid(pid, &status, WNOHANG);
  } while (w < 0 && errno == EINTR);
  if (w == 0) return r;
  if (w == pid) {
    r.state = ReapResult::kReaped;
    r.status_known = true;
    r.wait_status = status;
    return r;
  }
  if (errno != ECHILD) runtime::ThrowSystemError(absl::StrCat("waitpid(", pid, ")"), errno);
  r.state = ReapResult::kReapedElsewhere;
  if (pidfd >= 0) {
    if (std::optional<int> st = PidfdExitStatus(pidfd)) {
      r.status_known = true;
      r.wait_status = *st;
    }
  }
  return r;
}

void SignalChild(pid_t pid, int pidfd, int sig) {
  if (pidfd >= 0) {
    if (syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0u) == 0 || errno != ENOSYS) return;
  }
  ::kill(pid, sig);
}

void ReapUntilGone(pid_t pid, int pidfd) {
  auto nap = std::chrono::microseconds(50);
  bool polled = false;
  while (ReapChild(pid, pidfd).state == ReapResult::kRunning) {
    if (pidfd >= 0 && !polled) {
      pollfd p{pidfd, POLLIN, 0};
      polled = ::poll(&p, 1, -1) > 0;  // readable once it exited
    } else {
      std::this_thread::sleep_for(nap);  // exited, not yet reapable; or no pidfd
      if (nap < std::chrono::milliseconds(5)) nap *= 2;
    }
  }
}

namespace {
std::string LimitText(int resource) {
  rlimit rl{};
  if (getrlimit(resource, &rl) != 0) return "unknown";
  return rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string(rl.rlim_cur);
}
}  // namespace

std::string DescriptorLimitNote() {
  return absl::StrCat("the limit is ", LimitText(RLIMIT_NOFILE),
                      " descriptors (RLIMIT_NOFILE, ulimit -n): raise the limit, or run fewer "
                      "processes at once (each running Process holds 2 descriptors in its "
                      "parent, 1 under forkserver)");
}

std::string ProcessLimitNote() {
  return absl::StrCat("this user may run ", LimitText(RLIMIT_NPROC),
                      " processes and threads (RLIMIT_NPROC, ulimit -u), and the system limits "
                      "them too (kernel.threads-max, kernel.pid_max, a cgroup's pids.max): raise "
                      "the limit that was reached, or run fewer processes at once");
}

[[noreturn]] void ThrowCannotStartProcess(const std::string& what, int err) {
  if (err == EAGAIN) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat(what, " failed: ", strerror(err),
                             " (a process or thread limit is reached); ", ProcessLimitNote()));
  }
  if (err == ENOMEM) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat(what,
                             " failed: out of memory; free memory, or run fewer processes "
                             "at once"));
  }
  if (err == EMFILE || err == ENFILE) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat(what, " failed: out of file descriptors; ", DescriptorLimitNote()));
  }
  runtime::ThrowSystemError(what, err);
}

void SendReport(Connection& c, const std::string& kind, const std::string& payload) {
  c.send(kind, payload);
}

Message EncodeRunRequest(const std::string& entry, const std::string& name, Message args,
                         int result_fd, int lifeline_fd, const ChildEnvironment& env) {
  FileDescriptor result = result_fd >= 0 ? FileDescriptor::Dup(result_fd) : FileDescriptor();
  FileDescriptor lifeline = FileDescriptor::Dup(lifeline_fd);
  // The arguments' descriptors keep indices 0..n-1; the request's own come after them.
  Message m;
  m.fds = std::move(args.fds);
  EncodeInto(m, std::string("run"), entry, name, args.bytes, result, lifeline, env);
  return m;
}

RunRequest DecodeRunRequest(Message msg, bool need_result) {
  RunRequest r;
  std::string kind;
  Decode(msg, kind, r.entry, r.name, r.args.bytes, r.result, r.lifeline, r.env);
  if (kind != "run") internal::ThrowMalformed("unknown request kind");
  if (r.entry.empty()) internal::ThrowMalformed("a run request without an entry point");
  if (!r.lifeline) internal::ThrowMalformed("a run request without a lifeline");
  for (const auto& [k, v] : r.env) {
    if (!ValidEnvironmentEntry(k, v)) {
      internal::ThrowMalformed("a run request with a malformed environment variable");
    }
  }
  if (need_result && !r.result) internal::ThrowMalformed("a run request without a result channel");
  // What the request took is now empty; the arguments' descriptors keep their indices.
  r.args.fds = std::move(msg.fds);
  return r;
}

ChildReport DecodeChildReport(Message& msg) {
  std::string kind, payload;
  Decode(msg, kind, payload);
  ChildReport r;
  Message p;
  p.bytes = std::move(payload);
  if (kind == "hello") {
    r.kind = ChildReport::kHello;
  } else if (kind == "failure") {
    r.kind = ChildReport::kFailure;
    try {
      r.failure = DecodeAs<ChildFailure>(p);
    } catch (const Error&) {
    }
  } else if (kind == "exit") {
    r.kind = ChildReport::kExit;
    try {
      r.wait_status = DecodeAs<int32_t>(p);
    } catch (const Error&) {
    }
  } else if (kind == "exiting") {
    r.kind = ChildReport::kExiting;
    try {
      r.exit_code = DecodeAs<int32_t>(p);
    } catch (const Error&) {
    }
  }
  return r;
}

pid_t DecodeForkServerReply(Message& msg) {
  const int32_t pid = DecodeAs<int32_t>(msg);
  if (pid > 0) return pid;
  if (pid == -1) throw Error(ErrorCode::kInternal, "the fork server rejected a malformed request");
  if (pid == -EMFILE) {
    // Its table had no room for the request's descriptors (it keeps the RLIMIT_NOFILE it
    // started with, and holds one descriptor per process it runs).
    ThrowCannotStartProcess("the fork server, receiving the request's descriptors,", EMFILE);
  }
  if (pid < 0 && pid > -4096) ThrowCannotStartProcess("the fork server's fork()", -pid);
  throw Error(ErrorCode::kInvalidArgument, absl::StrCat("the fork server replied ", pid,
                                                        ", which is neither a pid nor an "
                                                        "error number"));
}

namespace {

// The result channel as the child found it. A report goes out only while its descriptor is still
// that socket: a target may close every descriptor and reuse the numbers, and a report must never
// land in someone else's file.
struct ReportChannel {
  Connection conn;
  dev_t dev = 0;
  ino_t ino = 0;

  explicit ReportChannel(Connection c) : conn(std::move(c)) {
    struct stat st {};
    if (!conn.closed() && fstat(conn.fileno(), &st) == 0) {
      dev = st.st_dev;
      ino = st.st_ino;
    }
  }
  void Send(const std::string& kind, const std::string& payload) {
    if (conn.closed() || ino == 0) return;
    struct stat st {};
    if (fstat(conn.fileno(), &st) != 0 || st.st_dev != dev || st.st_ino != ino) return;
    try {
      SendReport(conn, kind, payload);
    } catch (...) {
      // The parent is gone or closed the channel; the lifeline decides.
    }
  }
};

ReportChannel* g_report = nullptr;  // this child's, for exit() called by the target
pid_t g_report_pid = 0;             // whose it is: not a process the target forked by itself

// on_exit handler: exit(n) called by the target is reported as "exiting" n. Registered in the
// parent (RegisterExitReport): a process where it is not this child's does nothing.
void ReportExit(int status, void*) {
  if (g_report == nullptr || g_report_pid != getpid()) return;
  g_report->Send("exiting", Encode(static_cast<int32_t>(status & 0xff)).bytes);
}

}  // namespace

void RegisterExitReport() {
  static const bool registered = on_exit(ReportExit, nullptr) == 0;
  (void)registered;
}

bool ValidEnvironmentEntry(const std::string& name, const std::string& value) {
  return !name.empty() && name.find('=') == std::string::npos &&
         name.find('\0') == std::string::npos && value.find('\0') == std::string::npos;
}

void CheckChildEnvironment(const ChildEnvironment& env, const std::string& process) {
  for (const auto& [k, v] : env) {
    if (!ValidEnvironmentEntry(k, v)) {
      throw Error(
          ErrorCode::kInvalidArgument,
          absl::StrCat("process \"", process, "\": ProcessOptions::env has a bad entry \"", k,
                       "\" (a name must be non-empty and hold no '=' or NUL; a value "
                       "no NUL)"));
    }
  }
}

std::vector<char*> EnvironmentWith(const ChildEnvironment& env, std::vector<std::string>& storage) {
  storage.clear();
  for (const auto& [k, v] : env) storage.push_back(k + "=" + v);
  std::vector<char*> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    bool replaced = false;
    for (const auto& [k, v] : env) {
      if (std::strncmp(*e, k.c_str(), k.size()) == 0 && (*e)[k.size()] == '=') replaced = true;
    }
    if (!replaced) out.push_back(*e);
  }
  for (std::string& s : storage) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// The child's environment for the rest of its life, held by globals so that it stays reachable:
// a target that leaves with exit() would otherwise have LeakSanitizer report the two vectors and
// abort the child (SIGABRT where its own exit code was expected; CI's asan run). External
// linkage, so that the compiler cannot drop the stores as never read.
extern std::vector<std::string>* g_child_env_storage;
extern std::vector<char*>* g_child_env_array;
std::vector<std::string>* g_child_env_storage = nullptr;
std::vector<char*>* g_child_env_array = nullptr;

void ApplyChildEnvironment(const ChildEnvironment& env) {
  if (env.empty()) return;
  g_child_env_storage = new std::vector<std::string>;
  g_child_env_array = new std::vector<char*>(EnvironmentWith(env, *g_child_env_storage));
  environ = g_child_env_array->data();
}

void RunChildBody(const std::function<void()>& target, Connection result, const std::string& name,
                  const ChildEnvironment& env) {
  ApplyChildEnvironment(env);
  if (!name.empty()) prctl(PR_SET_NAME, name.substr(0, 15).c_str());
  int code = 0;
  // Leaked on purpose: exit() from the target runs ReportExit after this frame is gone.
  g_report = new ReportChannel(std::move(result));
  g_report_pid = getpid();
  ReportChannel& report = *g_report;
  report.Send("hello", std::string());
  // ReportExit was registered before the fork (RegisterExitReport): calling on_exit() here would
  // take the C library's exit-handler lock, which another thread of the parent may have held at
  // the fork, and hang this child for good.
  EnableThrowTraceCapture(true);
  try {
    target();
  } catch (const std::exception& e) {
    code = 1;
    ChildFailure f{Demangle(typeid(e).name()), e.what(), LastThrowTrace()};
    report.Send("failure", Encode(f).bytes);
    fprintf(stderr, "forksafe: process %s (pid %d) failed: %s: %s\n", name.c_str(), getpid(),
            f.type.c_str(), f.message.c_str());
  } catch (...) {
    code = 1;
    const std::type_info* t = abi::__cxa_current_exception_type();
    ChildFailure f{t != nullptr ? Demangle(t->name()) : "unknown", "(not a std::exception)",
                   LastThrowTrace()};
    report.Send("failure", Encode(f).bytes);
  }
  EnableThrowTraceCapture(false);
  // Device work this child queued (a kernel writing a tensor it sent) finishes before it exits,
  // so receivers read complete data (device/ipc.h).
  device::FinishQueuedWork();
  fflush(nullptr);
  report.Send("exiting", Encode(static_cast<int32_t>(code)).bytes);
  _exit(code);
}

}  // namespace forksafe::mp::internal
