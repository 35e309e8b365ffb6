#include "mp/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "mp/internal/child.h"
#include "mp/internal/server_auth.h"
#include "mp/internal/shm_sync.h"
#include "runtime/error.h"

extern char** environ;

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;

// ---- start methods ----------------------------------------------------------------------------

namespace {

std::mutex g_method_mu;
std::string g_method;  // "" = not set (default fork)
std::atomic<int> g_process_counter{0};

void CheckMethod(const std::string& m) {
  if (m == "fork" || m == "spawn" || m == "forkserver") return;
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("unknown start method \"", m,
                           "\"; valid start methods are: fork, spawn, forkserver"));
}

}  // namespace

std::vector<std::string> get_all_start_methods() { return {"fork", "spawn", "forkserver"}; }

std::string get_start_method() {
  std::lock_guard<std::mutex> lk(g_method_mu);
  return g_method.empty() ? "fork" : g_method;
}

void set_start_method(const std::string& method, bool force) {
  CheckMethod(method);
  std::lock_guard<std::mutex> lk(g_method_mu);
  if (!g_method.empty() && !force && g_method != method) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("the start method was already set to \"", g_method,
                             "\"; pass force=true to change it, or use get_context(\"", method,
                             "\") for one process"));
  }
  g_method = method;
}

Context get_context(const std::string& method) {
  if (method.empty()) return Context(get_start_method());
  CheckMethod(method);
  return Context(method);
}

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  const char* desc = sigdescr_np(sig);
  return absl::StrCat(abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", sig),
                      " (", desc != nullptr ? desc : "unknown", ")");
}

// ---- spawning this executable -----------------------------------------------------------------

namespace internal {

// posix_spawn()s /proc/self/exe with `flag` as argv[1] and `fd_for_child` as its descriptor 3.
// posix_spawn does not run at-fork handlers: a fresh program needs no quiescing.
pid_t SpawnExecutable(const char* flag, int fd_for_child, int secret_fd) {
  // Move the descriptors above 4 first, so that dup2 onto 3 and 4 always makes fresh,
  // inheritable ones (and neither source is overwritten by the other's dup2).
  FileDescriptor src(fcntl(fd_for_child, F_DUPFD_CLOEXEC, 10));
  if (!src) runtime::ThrowSystemError("fcntl(F_DUPFD_CLOEXEC)", errno);
  FileDescriptor secret;
  if (secret_fd >= 0) {
    secret.reset(fcntl(secret_fd, F_DUPFD_CLOEXEC, 10));
    if (!secret) runtime::ThrowSystemError("fcntl(F_DUPFD_CLOEXEC)", errno);
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, src.get(), kBootstrapFd);
  if (secret) posix_spawn_file_actions_adddup2(&fa, secret.get(), kSecretFd);
  std::string argv0 = Argv0();
  char* argv[] = {argv0.data(), const_cast<char*>(flag), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    if (rc == EAGAIN || rc == ENOMEM) {
      throw Error(ErrorCode::kResourceExhausted,
                  absl::StrCat("could not spawn a process: ", strerror(rc),
                               "; too many processes or too little memory"));
    }
    runtime::ThrowSystemError("posix_spawn of /proc/self/exe", rc);
  }
  return pid;
}

}  // namespace internal

// ---- Process ------------------------------------------------------------------------------------

namespace internal {
std::atomic<ShareTensorHook> g_share_tensor_hook{nullptr};
}  // namespace internal

struct Process::Impl {
  ProcessOptions options;
  std::function<void()> local_target;
  std::function<void()> before_fork;
  const void* fn = nullptr;
  std::function<Message()> encode_args;

  enum class State { kNew, kStarted, kExited, kClosed } state = State::kNew;
  std::string method;
  pid_t pid = 0;
  pid_t owner = 0;       // the process that started it
  FileDescriptor pidfd;  // waits without polling (fork and spawn), where the kernel has pidfds
  Connection result;     // child -> parent reports (and the fork server's "exit")
  bool said_hello = false;
  bool server_reported_exit = false;
  int wait_status = 0;
  std::optional<ChildFailure> failure;

  void CheckOwner(const char* what) const {
    if (owner != 0 && owner != getpid()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat(what, ": this Process was started by process ", owner,
                               ", not by this one (pid ", getpid(),
                               "); only the parent may wait for or signal it"));
    }
  }

  // Reads the reports that are available, waiting for the first one until `deadline` (no wait
  // when nullopt is not given... see callers). Stops at end-of-stream.
  void ReadReports(internal::Deadline deadline) {
    while (!result.closed()) {
      double left = 0;
      if (deadline.has_value()) {
        left = std::chrono::duration<double>(*deadline - internal::Clock::now()).count();
        if (left < 0) left = 0;
      }
      bool ready = false;
      try {
        ready = result.poll(std::chrono::duration<double>(left));
      } catch (...) {
        return;
      }
      if (!ready) return;
      internal::ChildReport report;
      try {
        Message m = result.RecvMessage(std::nullopt);
        report = internal::DecodeChildReport(m);
      } catch (...) {
        result.close();  // end-of-stream, or garbage from a dying child
        return;
      }
      if (report.kind == internal::ChildReport::kHello) {
        said_hello = true;
      } else if (report.kind == internal::ChildReport::kFailure && report.failure) {
        failure = std::move(report.failure);
      } else if (report.kind == internal::ChildReport::kExit && report.wait_status) {
        wait_status = *report.wait_status;
        server_reported_exit = true;
        result.close();
        return;
      }
    }
  }

  // Waits for the exit until `deadline`; returns whether the process exited.
  bool Wait(internal::Deadline deadline) {
    if (state == State::kExited) return true;
    if (method == "forkserver") {
      ReadReports(deadline);
      while (!server_reported_exit && !result.closed()) {
        if (deadline.has_value() && internal::Clock::now() >= *deadline) return false;
        ReadReports(deadline);
      }
      if (!server_reported_exit) {
        // The server died (killed) before reporting, and the child has closed its end of the
        // channel too: it has exited, with a status nobody can read now (it was not our child).
        // Record it as killed, and reap the server so that the next request starts a new one.
        wait_status = SIGKILL;  // WIFSIGNALED encoding: the low 7 bits hold the signal
        internal::ForkServerReapIfDead();
      }
      state = State::kExited;
      return true;
    }
    auto sleep = std::chrono::microseconds(50);
    for (;;) {
      int status = 0;
      const pid_t r = waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        wait_status = status;
        break;
      }
      if (r < 0 && errno != EINTR) {
        runtime::ThrowSystemError(absl::StrCat("waitpid(", pid, ")"), errno);
      }
      const auto now = internal::Clock::now();
      if (deadline.has_value() && now >= *deadline) return false;
      if (pidfd) {
        int ms = -1;
        if (deadline.has_value()) {
          ms = static_cast<int>(
              std::chrono::ceil<std::chrono::milliseconds>(*deadline - now).count());
        }
        pollfd p{pidfd.get(), POLLIN, 0};
        ::poll(&p, 1, ms);
      } else {
        std::this_thread::sleep_for(sleep);
        if (sleep < std::chrono::milliseconds(5)) sleep *= 2;
      }
    }
    state = State::kExited;
    ReadReports(internal::Clock::now() + std::chrono::milliseconds(100));
    return true;
  }

  void Signal(int sig) {
    if (state != State::kStarted) return;
    CheckOwner("terminate/kill");
    if (method == "forkserver") {
      ReadReports(std::nullopt);
      if (server_reported_exit) return;  // its pid may already be someone else's
    } else {
      int status = 0;
      const pid_t r = waitpid(pid, &status, WNOHANG);
      if (r == pid) {  // already gone: reap, do not signal a pid that may be reused
        wait_status = status;
        state = State::kExited;
        ReadReports(std::nullopt);
        return;
      }
    }
    ::kill(pid, sig);
  }

  void StartFork() {
    if (before_fork) before_fork();
    auto [parent_end, child_end] = Pipe(true);
    FileDescriptor lifeline = internal::LifelineReadEnd();
    std::fflush(nullptr);
    const pid_t p = fork();
    if (p < 0) {
      const int err = errno;
      throw Error(err == EAGAIN || err == ENOMEM ? ErrorCode::kResourceExhausted
                                                 : ErrorCode::kInternal,
                  absl::StrCat("fork failed: ", strerror(err)));
    }
    if (p == 0) {
      parent_end.close();
      internal::WatchLifeline(std::move(lifeline));
      internal::RunChildBody(local_target, child_end, options.name);
    }
    pid = p;
    result = parent_end;
  }

  void StartSpawn() {
    if (fn == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("process \"", options.name,
                               "\": only free functions registered with FORKSAFE_ENTRY_POINT can "
                               "run under the \"", method,
                               "\" start method (lambdas and functors work only with \"fork\")"));
    }
    const std::string entry = internal::EntryPointName(fn);
    if (entry.empty()) {
      throw Error(ErrorCode::kNotFound,
                  absl::StrCat("process \"", options.name,
                               "\": its target function is not registered; add "
                               "FORKSAFE_ENTRY_POINT(<function name>) at namespace scope so that "
                               "the \"", method, "\" start method can find it by name"));
    }
    if (!encode_args) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("process \"", options.name, "\" (entry point ", entry,
                               "): an argument type cannot be encoded; give it a cereal "
                               "serialize() function, or use the \"fork\" start method"));
    }
    Message args = encode_args();
    FileDescriptor lifeline = internal::LifelineReadEnd();
    auto [parent_end, child_end] = Pipe(true);
    if (method == "spawn") {
      pid = internal::SpawnExecutable(internal::kChildFlag, child_end.fileno(), -1);
      child_end.close();
      result = parent_end;
      result.SendMessage(
          internal::EncodeRunRequest(entry, options.name, std::move(args), -1, lifeline.get()));
    } else {
      pid = internal::ForkServerRun(internal::EncodeRunRequest(
          entry, options.name, std::move(args), child_end.fileno(), lifeline.get()));
      child_end.close();
      result = parent_end;
    }
  }
};

Process::Process(ProcessOptions options, int) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  if (impl_->options.name.empty()) {
    impl_->options.name = absl::StrCat("Process-", ++g_process_counter);
  }
}

void Process::SetTargets(std::function<void()> local, const void* fn,
                         std::function<Message()> encode, std::function<void()> before_fork) {
  impl_->before_fork = std::move(before_fork);
  impl_->local_target = std::move(local);
  impl_->fn = fn;
  impl_->encode_args = std::move(encode);
}

Process::Process(Process&&) noexcept = default;
Process& Process::operator=(Process&&) noexcept = default;

Process::~Process() {
  if (!impl_ || impl_->state != Impl::State::kStarted || impl_->owner != getpid()) return;
  try {
    if (impl_->options.daemon) {
      impl_->Signal(SIGTERM);
      if (!impl_->Wait(internal::Clock::now() + std::chrono::seconds(1))) {
        impl_->Signal(SIGKILL);
        impl_->Wait(std::nullopt);
      }
    } else {
      impl_->Wait(std::nullopt);
    }
  } catch (...) {
  }
}

void Process::start() {
  Impl& p = *impl_;
  if (p.state == Impl::State::kClosed) {
    throw Error(ErrorCode::kClosed, absl::StrCat("process \"", p.options.name, "\" is closed"));
  }
  if (p.state != Impl::State::kNew) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("process \"", p.options.name, "\" was already started (pid ", p.pid,
                             "); a Process can be started only once"));
  }
  p.method = p.options.start_method.empty() ? get_start_method() : p.options.start_method;
  CheckMethod(p.method);
  if (p.method == "fork") {
    p.StartFork();
  } else {
    p.StartSpawn();
  }
  p.owner = getpid();
  p.state = Impl::State::kStarted;
  if (p.method != "forkserver") {
    const long fd = syscall(SYS_pidfd_open, p.pid, 0);
    if (fd >= 0) {
      fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);
      p.pidfd.reset(static_cast<int>(fd));
    }
  }
}

bool Process::join(Timeout timeout) {
  Impl& p = *impl_;
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "Process::join");
  if (p.state == Impl::State::kNew) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("process \"", p.options.name, "\" cannot be joined before start()"));
  }
  if (p.state == Impl::State::kClosed) {
    throw Error(ErrorCode::kClosed, absl::StrCat("process \"", p.options.name, "\" is closed"));
  }
  p.CheckOwner("Process::join");
  return p.Wait(deadline);
}

bool Process::is_alive() {
  Impl& p = *impl_;
  if (p.state != Impl::State::kStarted) return false;
  p.CheckOwner("Process::is_alive");
  return !p.Wait(internal::Clock::now());
}

pid_t Process::pid() const { return impl_->pid; }

std::optional<int> Process::exitcode() {
  Impl& p = *impl_;
  if (p.state == Impl::State::kStarted && p.owner == getpid()) p.Wait(internal::Clock::now());
  if (p.state != Impl::State::kExited) return std::nullopt;
  if (WIFSIGNALED(p.wait_status)) return -WTERMSIG(p.wait_status);
  return WEXITSTATUS(p.wait_status);
}

void Process::terminate() { impl_->Signal(SIGTERM); }
void Process::kill() { impl_->Signal(SIGKILL); }

void Process::close() {
  Impl& p = *impl_;
  if (p.state == Impl::State::kStarted && !p.Wait(internal::Clock::now())) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("process \"", p.options.name, "\" (pid ", p.pid,
                             ") is still running; join() or terminate() it before close()"));
  }
  p.result.close();
  p.pidfd.reset();
  p.state = Impl::State::kClosed;
}

bool Process::reported_failure() {
  Impl& p = *impl_;
  if (p.state == Impl::State::kStarted && p.owner == getpid()) p.ReadReports(internal::Clock::now());
  return p.failure.has_value();
}

int Process::report_fd() const {
  if (impl_->state == Impl::State::kNew || impl_->state == Impl::State::kClosed) return -1;
  return impl_->result.closed() ? -1 : impl_->result.fileno();
}

int Process::wait_fd() const {
  if (impl_->state != Impl::State::kStarted) return -1;
  return impl_->method == "forkserver" ? impl_->result.fileno() : impl_->pidfd.get();
}

const std::string& Process::name() const { return impl_->options.name; }
bool Process::daemon() const { return impl_->options.daemon; }
std::string Process::start_method() const {
  if (!impl_->method.empty()) return impl_->method;
  return impl_->options.start_method.empty() ? get_start_method() : impl_->options.start_method;
}

std::optional<ChildFailure> Process::failure() {
  exitcode();  // reaps and reads the reports if it has exited
  if (!impl_->failure && impl_->state == Impl::State::kExited && !impl_->said_hello &&
      impl_->method == "spawn" && WIFEXITED(impl_->wait_status)) {
    return ChildFailure{"forksafe::mp::SpawnError",
                        "the spawned child never reached forksafe::mp::InitMain(); call it first "
                        "thing in main() of programs that use the spawn or forkserver start "
                        "method",
                        ""};
  }
  return impl_->failure;
}

}  // namespace forksafe::mp
