#include "forksafe/mp/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/server_auth.h"
#include "forksafe/mp/internal/shm_sync.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"

extern char** environ;

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;

// ---- start methods ----------------------------------------------------------------------------

namespace {

runtime::internal::Mutex g_method_mu;
StartMethod g_method FORKSAFE_GUARDED_BY(g_method_mu);  // kDefault = not set (default fork)
std::atomic<int> g_process_counter{0};

}  // namespace

std::vector<std::string> get_all_start_methods() { return {"fork", "spawn", "forkserver"}; }

StartMethod get_start_method() {
  runtime::internal::MutexLock lk(&g_method_mu);
  return g_method.is_default() ? StartMethod::kFork : g_method;
}

void set_start_method(StartMethod method, bool force) {
  if (method.is_default()) {
    throw Error(ErrorCode::kInvalidArgument,
                "set_start_method needs a start method; valid start methods are: fork, spawn, "
                "forkserver");
  }
  runtime::internal::MutexLock lk(&g_method_mu);
  if (!g_method.is_default() && !force && g_method != method) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("the start method was already set to \"", g_method.name(),
                             "\"; pass force=true to change it, or use get_context(\"",
                             method.name(), "\") for one process"));
  }
  g_method = method;
}

Context get_context(StartMethod method) { return Context(method.Resolved()); }

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  const char* desc = sigdescr_np(sig);
  return absl::StrCat(
      abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", sig), " (",
      desc != nullptr ? desc : "unknown", ")");
}

// ---- spawning this executable -----------------------------------------------------------------

namespace internal {

// posix_spawn()s /proc/self/exe (or `executable`) with `flag` as argv[1] and `fd_for_child` as
// its descriptor 3. posix_spawn does not run at-fork handlers: a fresh program needs no quiescing.
pid_t SpawnExecutable(const char* flag, int fd_for_child, int secret_fd,
                      const std::vector<std::pair<std::string, std::string>>* env,
                      const std::string* executable) {
  // Move the descriptors above 4 first, so that dup2 onto 3 and 4 always makes fresh,
  // inheritable ones (and neither source is overwritten by the other's dup2).
  // EINVAL: the limit of descriptors is 10 or less, so no descriptor 10 can exist.
  auto dup_high = [](int fd) {
    FileDescriptor d(fcntl(fd, F_DUPFD_CLOEXEC, 10));
    if (!d) {
      const int err = errno;
      ThrowCannotStartProcess("fcntl(F_DUPFD_CLOEXEC, 10) before spawning",
                              err == EINVAL ? EMFILE : err);
    }
    return d;
  };
  FileDescriptor src = dup_high(fd_for_child);
  FileDescriptor secret;
  if (secret_fd >= 0) secret = dup_high(secret_fd);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, src.get(), kBootstrapFd);
  if (secret) posix_spawn_file_actions_adddup2(&fa, secret.get(), kSecretFd);
  const char* path = executable != nullptr ? executable->c_str() : "/proc/self/exe";
  std::string argv0 = executable != nullptr ? *executable : Argv0();
  char* argv[] = {argv0.data(), const_cast<char*>(flag), nullptr};
  // The environment: ours, with `env`'s variables replacing or added.
  std::vector<std::string> entries;
  std::vector<char*> envp;
  char** child_environ = environ;
  if (env != nullptr && !env->empty()) {
    envp = EnvironmentWith(*env, entries);
    child_environ = envp.data();
  }
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, path, &fa, nullptr, argv, child_environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) ThrowCannotStartProcess(absl::StrCat("posix_spawn of ", path), rc);
  return pid;
}

}  // namespace internal

// ---- Process ------------------------------------------------------------------------------------

struct Process::Impl {
  ProcessOptions options;
  std::function<void()> local_target;
  std::function<void()> before_fork;
  const void* fn = nullptr;
  std::function<Message()> encode_args;

  enum class State { kNew, kStarted, kExited, kClosed } state = State::kNew;
  StartMethod method;  // resolved at start() (never kDefault afterwards)
  pid_t pid = 0;
  pid_t owner = 0;       // the process that started it
  FileDescriptor pidfd;  // waits without polling (fork and spawn), where the kernel has pidfds
  bool gone_at_start = false;  // exited and reaped by someone else before its pidfd was opened
  Connection result;           // child -> parent reports (and the fork server's "exit")
  bool said_hello = false;
  bool server_reported_exit = false;
  bool status_known = false;  // wait_status is the kernel's (or the child's own report)
  int wait_status = 0;
  std::optional<int> reported_exit_code;  // the child's own "exiting" report
  std::optional<ChildFailure> failure;

  void CheckOwner(const char* what) const {
    if (owner != 0 && owner != getpid()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat(what, ": this Process was started by process ", owner,
                               ", not by this one (pid ", getpid(),
                               "); only the parent may wait for or signal it"));
    }
  }

  void CheckNotClosed(const char* what) const {
    if (state == State::kClosed) {
      throw Error(ErrorCode::kClosed,
                  absl::StrCat(what, ": process \"", options.name,
                               "\" is closed (as Python's \"process object is closed\"); a "
                               "Process runs once: make a new one to run the target again"));
    }
  }

  // Reads the reports on the result channel until end-of-stream or the fork server's "exit",
  // waiting for each next one until `until`: nullopt waits as long as it takes, a time point in
  // the past reads only what is already there.
  void ReadReports(internal::Deadline until) {
    while (!result.closed()) {
      Timeout wait = std::nullopt;
      if (until.has_value()) {
        wait = std::chrono::duration<double>(
            std::max(internal::Clock::duration::zero(), *until - internal::Clock::now()));
      }
      bool ready = false;
      try {
        ready = result.poll(wait);
      } catch (...) {
        // poll() itself failed (ENOMEM, say): nap, so that a caller that loops on this (a wait
        // without deadline, the destructor) retries at a bounded rate instead of spinning.
        auto nap =
            std::chrono::duration_cast<internal::Clock::duration>(std::chrono::milliseconds(10));
        if (until.has_value()) {
          nap = std::min(
              nap, std::max(internal::Clock::duration::zero(), *until - internal::Clock::now()));
        }
        std::this_thread::sleep_for(nap);
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
      } else if (report.kind == internal::ChildReport::kExiting && report.exit_code) {
        reported_exit_code = *report.exit_code;
      } else if (report.kind == internal::ChildReport::kExit && report.wait_status) {
        wait_status = *report.wait_status;
        status_known = true;
        server_reported_exit = true;
        result.close();
        return;
      }
    }
  }

  // The process has exited: reads its last reports and settles what is known of its status.
  void RecordExit(const internal::ReapResult& r) {
    state = State::kExited;
    status_known = r.status_known;
    wait_status = r.wait_status;
    ReadReports(internal::Clock::now() + std::chrono::milliseconds(100));
    if (!status_known && reported_exit_code.has_value()) {
      // Someone else took the kernel's status: the child's own report is the next best thing.
      wait_status = (*reported_exit_code & 0xff) << 8;
      status_known = true;
    }
  }

  bool WaitForkServer(internal::Deadline deadline) {
    // The server reports the exit on the result channel. Read what is there first, then look at
    // the deadline: a deadline in the past (is_alive, join(0)) must still see an exit that was
    // reported. Each read sleeps in poll() (until the deadline, or for as long as it takes), so
    // this loop never spins.
    for (;;) {
      ReadReports(deadline);
      if (server_reported_exit || result.closed()) break;
      if (deadline.has_value() && internal::Clock::now() >= *deadline) return false;
    }
    state = State::kExited;
    if (!server_reported_exit) {
      // The server died (killed) before reporting, and the child has closed its end of the
      // channel too: it has exited, with a status nobody can read now (it was not our child).
      // Its own report says how it ended if it got that far; otherwise the status is unknown,
      // exactly as under fork and spawn (exitcode() throws, naming the cause). Reap the server
      // so that the next request starts a new one.
      status_known = reported_exit_code.has_value();
      wait_status = reported_exit_code ? (*reported_exit_code & 0xff) << 8 : 0;
      internal::ForkServerReapIfDead();
    }
    return true;
  }

  // Waits for the exit until `deadline`; returns whether the process exited. Sleeps in poll() on
  // the pidfd (or in short, growing naps where there is none): never spins.
  bool Wait(internal::Deadline deadline) {
    if (state == State::kExited) return true;
    if (method == StartMethod::kForkServer) return WaitForkServer(deadline);
    auto nap = std::chrono::microseconds(50);
    bool woke = false;
    for (;;) {
      internal::ReapResult r;
      if (gone_at_start) {
        r.state = internal::ReapResult::kReapedElsewhere;
      } else {
        r = internal::ReapChild(pid, pidfd.get());
      }
      if (r.state != internal::ReapResult::kRunning) {
        RecordExit(r);
        return true;
      }
      const auto now = internal::Clock::now();
      if (deadline.has_value() && now >= *deadline) return false;
      if (pidfd && !woke) {
        int ms = -1;
        if (deadline.has_value()) {
          ms = static_cast<int>(std::min<int64_t>(
              std::chrono::ceil<std::chrono::milliseconds>(*deadline - now).count(),
              24 * 3600 * 1000));
        }
        pollfd p{pidfd.get(), POLLIN, 0};
        // Readable once it exited; it may take the kernel a moment more to make it reapable
        // (or to release it, when SIGCHLD is ignored): then naps below, not a spin.
        woke = ::poll(&p, 1, ms) > 0;
      } else {
        auto d = std::chrono::duration_cast<internal::Clock::duration>(nap);
        if (deadline.has_value()) d = std::min(d, *deadline - now);
        std::this_thread::sleep_for(d);
        if (nap < std::chrono::milliseconds(5)) nap *= 2;
      }
    }
  }

  std::string UnknownStatusMessage() const {
    if (method == StartMethod::kForkServer) {
      return absl::StrCat(
          "process \"", options.name, "\" (pid ", pid,
          ") has exited, but its exit status is lost: the fork server that started it died "
          "(killed, or out of memory) before it could report the status, and the process ended "
          "without reporting one (a signal killed it, or it called _exit()). A new fork server "
          "starts with the next process; keep the fork server alive to get every status");
    }
    return absl::StrCat(
        "process \"", options.name, "\" (pid ", pid,
        ") has exited, but its exit status is lost: another part of this program reaped it "
        "first (SIGCHLD is ignored, or a SIGCHLD handler calls wait() or waitpid(-1, ...)), "
        "this kernel keeps no exit status for pidfds (Linux 6.15 or newer does), and the "
        "process ended without reporting one (a signal killed it, or it called _exit()). Leave "
        "SIGCHLD at its default, or reap only the pids your own code started, to get every "
        "status");
  }

  void Signal(int sig) {
    if (state != State::kStarted) return;
    CheckOwner("terminate/kill");
    if (method == StartMethod::kForkServer) {
      ReadReports(internal::Clock::now());
      if (server_reported_exit) return;  // its pid may already be someone else's
      ::kill(pid, sig);
      return;
    }
    // Already gone: settle it, and never signal a pid that may be reused.
    if (Wait(internal::Clock::now())) return;
    internal::SignalChild(pid, pidfd.get(), sig);
  }

  void StartFork() {
    if (before_fork) before_fork();
    internal::RegisterExitReport();  // here, in the parent: never in the child (see child.h)
    auto [parent_end, child_end] = Pipe(true);
    FileDescriptor lifeline = internal::LifelineReadEnd();
    std::fflush(nullptr);
    const pid_t p = fork();
    if (p < 0) internal::ThrowCannotStartProcess("fork()", errno);
    if (p == 0) {
      parent_end.close();
      internal::WatchLifeline(std::move(lifeline));
      internal::RunChildBody(local_target, child_end, options.name, options.env);
    }
    pid = p;
    result = parent_end;
  }

  void StartSpawn() {
    if (fn == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("process \"", options.name,
                               "\": only free functions registered with FORKSAFE_ENTRY_POINT can "
                               "run under the \"",
                               method.name(),
                               "\" start method (lambdas and functors work only with \"fork\")"));
    }
    const std::string entry = internal::EntryPointName(fn);
    if (entry.empty()) {
      throw Error(ErrorCode::kNotFound,
                  absl::StrCat("process \"", options.name,
                               "\": its target function is not registered; add "
                               "FORKSAFE_ENTRY_POINT(<function name>) at namespace scope so that "
                               "the \"",
                               method.name(), "\" start method can find it by name"));
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
    if (method == StartMethod::kSpawn) {
      // Everything that can run out of descriptors happens before the child exists.
      Message request = internal::EncodeRunRequest(entry, options.name, std::move(args), -1,
                                                   lifeline.get(), options.env);
      const pid_t child =
          internal::SpawnExecutable(internal::kChildFlag, child_end.fileno(), -1, &options.env);
      child_end.close();
      try {
        parent_end.SendMessage(request);
      } catch (...) {
        // It would wait for its request in vain: end it and reap it. Through its pidfd where
        // there is one (never a recycled pid); a child someone else reaped is not signalled.
        const long fd = syscall(SYS_pidfd_open, child, 0);
        FileDescriptor child_fd(fd >= 0 ? static_cast<int>(fd) : -1);
        try {
          if (internal::ReapChild(child, child_fd.get()).state == internal::ReapResult::kRunning) {
            internal::SignalChild(child, child_fd.get(), SIGKILL);
            internal::ReapUntilGone(child, child_fd.get());
          }
        } catch (const Error&) {
          // Not ours to wait for after all; the request's error is the one to report.
        }
        throw;
      }
      pid = child;
      result = parent_end;
    } else {
      pid = internal::ForkServerRun(internal::EncodeRunRequest(
          entry, options.name, std::move(args), child_end.fileno(), lifeline.get(), options.env));
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
  p.CheckNotClosed("Process::start");
  if (p.state != Impl::State::kNew) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("process \"", p.options.name, "\" was already started (pid ", p.pid,
                             "); a Process can be started only once"));
  }
  p.method = p.options.start_method.Resolved();
  internal::CheckChildEnvironment(p.options.env, p.options.name);
  try {
    if (p.method == StartMethod::kFork) {
      p.StartFork();
    } else {
      p.StartSpawn();
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kResourceExhausted) throw;
    // Name the process and the limit (a Pipe or a dup that ran out says only "ulimit -n").
    const bool names_limit = e.message().find("RLIMIT_") != std::string::npos;
    const bool descriptors = e.message().find("descriptor") != std::string::npos;
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat("process \"", p.options.name, "\" could not start: ", e.message(),
                             !names_limit && descriptors
                                 ? absl::StrCat("; ", internal::DescriptorLimitNote())
                                 : ""));
  }
  p.owner = getpid();
  p.state = Impl::State::kStarted;
  if (p.method != StartMethod::kForkServer) {
    const long fd = syscall(SYS_pidfd_open, p.pid, 0);
    if (fd >= 0) {
      fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);
      p.pidfd.reset(static_cast<int>(fd));
    } else if (errno == ESRCH) {
      // Already exited and reaped by someone else (SIGCHLD ignored, or a handler that reaps
      // every child): its pid must not be waited for or signalled again.
      p.gone_at_start = true;
    }
    // Other failures (no pidfds on this kernel, out of descriptors): wait by pid.
  }
}

bool Process::join(Timeout timeout) {
  Impl& p = *impl_;
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "Process::join");
  p.CheckNotClosed("Process::join");
  if (p.state == Impl::State::kNew) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("process \"", p.options.name, "\" cannot be joined before start()"));
  }
  p.CheckOwner("Process::join");
  return p.Wait(deadline);
}

bool Process::is_alive() {
  Impl& p = *impl_;
  p.CheckNotClosed("Process::is_alive");
  if (p.state != Impl::State::kStarted) return false;
  p.CheckOwner("Process::is_alive");
  return !p.Wait(internal::Clock::now());
}

pid_t Process::pid() const { return impl_->pid; }

std::optional<int> Process::exitcode() {
  Impl& p = *impl_;
  p.CheckNotClosed("Process::exitcode");
  if (p.state == Impl::State::kStarted && p.owner == getpid()) p.Wait(internal::Clock::now());
  if (p.state != Impl::State::kExited) return std::nullopt;
  if (!p.status_known) throw Error(ErrorCode::kFailedPrecondition, p.UnknownStatusMessage());
  if (WIFSIGNALED(p.wait_status)) return -WTERMSIG(p.wait_status);
  return WEXITSTATUS(p.wait_status);
}

void Process::terminate() {
  impl_->CheckNotClosed("Process::terminate");
  impl_->Signal(SIGTERM);
}
void Process::kill() {
  impl_->CheckNotClosed("Process::kill");
  impl_->Signal(SIGKILL);
}

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
  if (p.state == Impl::State::kStarted && p.owner == getpid())
    p.ReadReports(internal::Clock::now());
  return p.failure.has_value();
}

int Process::report_fd() const {
  if (impl_->state == Impl::State::kNew || impl_->state == Impl::State::kClosed) return -1;
  return impl_->result.closed() ? -1 : impl_->result.fileno();
}

int Process::wait_fd() const {
  if (impl_->state != Impl::State::kStarted) return -1;
  return impl_->method == StartMethod::kForkServer ? impl_->result.fileno() : impl_->pidfd.get();
}

const std::string& Process::name() const { return impl_->options.name; }
bool Process::daemon() const { return impl_->options.daemon; }
StartMethod Process::start_method() const {
  if (!impl_->method.is_default()) return impl_->method;
  return impl_->options.start_method.Resolved();
}

std::optional<ChildFailure> Process::failure() {
  Impl& p = *impl_;
  // Reaps and reads the reports if it has exited (after close(): what was recorded).
  if (p.state == Impl::State::kStarted && p.owner == getpid()) p.Wait(internal::Clock::now());
  if (!p.failure && p.state == Impl::State::kExited && !p.said_hello &&
      p.method == StartMethod::kSpawn && p.status_known && WIFEXITED(p.wait_status)) {
    return ChildFailure{"forksafe::mp::SpawnError",
                        "the spawned child never reached forksafe::mp::InitMain(); call it first "
                        "thing in main() of programs that use the spawn or forkserver start "
                        "method",
                        ""};
  }
  return impl_->failure;
}

}  // namespace forksafe::mp
