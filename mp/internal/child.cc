#include "mp/internal/child.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cxxabi.h>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "device/registry.h"
#include "mp/internal/server_auth.h"
#include "mp/internal/shm_manager.h"
#include "runtime/at_fork.h"
#include "runtime/error.h"
#include "runtime/internal/kept_resources.h"

extern char** environ;

namespace forksafe::mp::internal {
namespace {

using runtime::Error;
using runtime::ErrorCode;

// ---- lifeline ----
struct Lifeline {
  std::mutex mu;
  int read_end = -1;
  int write_end = -1;
};

Lifeline& TheLifeline() {
  static auto* l = new Lifeline();  // leaked; its descriptors are closed in forked children
  return *l;
}

// Forked children must not hold their parent's lifeline: close it, start afresh lazily.
const bool g_lifeline_handler = [] {
  runtime::HoldAcrossFork(&TheLifeline().mu, "mp_lifeline", [] {
    Lifeline& l = TheLifeline();
    if (l.read_end >= 0) ::close(l.read_end);
    if (l.write_end >= 0) ::close(l.write_end);
    l.read_end = l.write_end = -1;
  });
  runtime::internal::RegisterKeptResources("mp_lifeline", [](runtime::internal::KeptResources& k) {
    Lifeline& l = TheLifeline();
    std::lock_guard<std::mutex> lk(l.mu);
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

FileDescriptor LifelineReadEnd() {
  Lifeline& l = TheLifeline();
  std::lock_guard<std::mutex> lk(l.mu);
  if (l.read_end < 0) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
      const int err = errno;
      if (err == EMFILE || err == ENFILE) {
        throw Error(ErrorCode::kResourceExhausted,
                    "out of file descriptors creating the children's lifeline pipe; raise the "
                    "limit (ulimit -n)");
      }
      runtime::ThrowSystemError("pipe2 for the lifeline", err);
    }
    l.read_end = p[0];
    l.write_end = p[1];
  }
  return FileDescriptor::Dup(l.read_end);
}

void WatchLifeline(FileDescriptor read_end) {
  if (!read_end) return;
  std::thread([fd = read_end.release()] {
    char c;
    for (;;) {
      const ssize_t n = ::read(fd, &c, 1);
      if (n < 0 && errno == EINTR) continue;
      break;  // end-of-file (or an error): the parent is gone
    }
    ::kill(getpid(), SIGKILL);
  }).detach();
}

void SendReport(Connection& c, const std::string& kind, const std::string& payload) {
  c.send(kind, payload);
}

Message EncodeRunRequest(const std::string& entry, const std::string& name, Message args,
                         int result_fd, int lifeline_fd) {
  FileDescriptor result = result_fd >= 0 ? FileDescriptor::Dup(result_fd) : FileDescriptor();
  FileDescriptor lifeline = FileDescriptor::Dup(lifeline_fd);
  // The arguments' descriptors keep indices 0..n-1; the request's own come after them.
  Message m;
  m.fds = std::move(args.fds);
  EncodeInto(m, std::string("run"), entry, name, args.bytes, result, lifeline);
  return m;
}

RunRequest DecodeRunRequest(Message msg, bool need_result) {
  RunRequest r;
  std::string kind;
  Decode(msg, kind, r.entry, r.name, r.args.bytes, r.result, r.lifeline);
  if (kind != "run") internal::ThrowMalformed("unknown request kind");
  if (r.entry.empty()) internal::ThrowMalformed("a run request without an entry point");
  if (!r.lifeline) internal::ThrowMalformed("a run request without a lifeline");
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
  }
  return r;
}

pid_t DecodeForkServerReply(Message& msg) {
  const int32_t pid = DecodeAs<int32_t>(msg);
  if (pid > 0) return pid;
  if (pid == -1) throw Error(ErrorCode::kInternal, "the fork server rejected a malformed request");
  if (pid < 0 && pid > -4096) {
    throw Error(ErrorCode::kInternal,
                absl::StrCat("the fork server could not fork: ", strerror(-pid)));
  }
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("the fork server replied ", pid, ", which is neither a pid nor an "
                           "error number"));
}

void RunChildBody(const std::function<void()>& target, Connection result, const std::string& name) {
  if (!name.empty()) prctl(PR_SET_NAME, name.substr(0, 15).c_str());
  int code = 0;
  try {
    if (!result.closed()) SendReport(result, "hello", std::string());
  } catch (...) {
    // The parent is gone or closed the channel; run anyway, the lifeline decides.
  }
  EnableThrowTraceCapture(true);
  try {
    target();
  } catch (const std::exception& e) {
    code = 1;
    ChildFailure f{Demangle(typeid(e).name()), e.what(), LastThrowTrace()};
    try {
      if (!result.closed()) SendReport(result, "failure", Encode(f).bytes);
    } catch (...) {
    }
    fprintf(stderr, "forksafe: process %s (pid %d) failed: %s: %s\n", name.c_str(), getpid(),
            f.type.c_str(), f.message.c_str());
  } catch (...) {
    code = 1;
    const std::type_info* t = abi::__cxa_current_exception_type();
    ChildFailure f{t != nullptr ? Demangle(t->name()) : "unknown", "(not a std::exception)",
                   LastThrowTrace()};
    try {
      if (!result.closed()) SendReport(result, "failure", Encode(f).bytes);
    } catch (...) {
    }
  }
  EnableThrowTraceCapture(false);
  // Device work this child queued (a kernel writing a tensor it sent) finishes before it exits,
  // so receivers read complete data (device/ipc.h).
  device::FinishQueuedWork();
  fflush(nullptr);
  _exit(code);
}

// ---------------------------------------------------------------------------------------------
// Fork server: a process spawned from this executable, single-threaded, that forks a child per
// request and reports each child's exit status to whoever asked for it.

namespace {

// The body a child runs for `req`: its entry point with its arguments, or, for a name this
// program does not know, a throw that reports it to the parent.
std::function<void()> TargetOf(RunRequest& req) {
  try {
    const EntryInvoker& invoke = FindEntryPoint(req.entry);
    return [&invoke, &req] { invoke(req.args); };
  } catch (const Error& e) {
    const std::string what = e.what();
    return [what] { throw Error(ErrorCode::kNotFound, what); };
  }
}

[[noreturn]] void ServeForever(int sock) {
  // Nothing is served before the creator proved it holds the secret it handed us on kSecretFd
  // (see mp/internal/server_auth.h for the threat model). A refused connection is closed unread
  // and, being the only one this server has, ends it.
  std::string secret = ReadInheritedSecret(kSecretFd);
  // SIGCHLD through a signalfd, so the loop can wait on requests, deaths and the lifeline at once.
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  sigprocmask(SIG_BLOCK, &mask, nullptr);
  const int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) _exit(120);
  Connection requests(FileDescriptor(sock), true, true);
  if (!CheckServerHello(requests, secret, "the fork server")) _exit(0);
  std::map<pid_t, Connection> status_channels;
  FileDescriptor lifeline;  // from the first request: the server dies with its parent too
  for (;;) {
    pollfd fds[3] = {{requests.fileno(), POLLIN, 0}, {sfd, POLLIN, 0}, {lifeline.get(), POLLIN, 0}};
    const int nfds = lifeline ? 3 : 2;
    if (::poll(fds, nfds, -1) < 0) {
      if (errno == EINTR) continue;
      _exit(121);
    }
    if (nfds == 3 && (fds[2].revents & (POLLIN | POLLHUP))) _exit(0);  // parent died
    if (fds[1].revents & POLLIN) {
      signalfd_siginfo si;
      while (::read(sfd, &si, sizeof(si)) > 0) {
      }
      int status = 0;
      pid_t pid;
      while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        auto it = status_channels.find(pid);
        if (it == status_channels.end()) continue;
        try {
          SendReport(it->second, "exit", Encode(static_cast<int32_t>(status)).bytes);
        } catch (...) {
        }
        status_channels.erase(it);
      }
    }
    if (fds[0].revents & (POLLIN | POLLHUP)) {
      Message msg;
      try {
        msg = requests.RecvMessage(std::nullopt);
      } catch (...) {
        _exit(0);  // the parent closed the request socket: nothing more to serve
      }
      RunRequest req;
      try {
        req = DecodeRunRequest(std::move(msg), /*need_result=*/true);
      } catch (...) {
        requests.send(static_cast<int32_t>(-1));
        continue;
      }
      if (!lifeline) lifeline = FileDescriptor::Dup(req.lifeline.get());
      const pid_t pid = fork();
      if (pid == 0) {
        explicit_bzero(secret.data(), secret.size());  // user code runs here: leave it no secret
        ::close(sfd);
        sigprocmask(SIG_UNBLOCK, &mask, nullptr);
        requests.close();
        status_channels.clear();
        WatchLifeline(std::move(req.lifeline));
        Connection result(std::move(req.result), true, true);
        RunChildBody(TargetOf(req), std::move(result), req.name);
      }
      if (pid < 0) {
        requests.send(static_cast<int32_t>(-errno));
        continue;
      }
      status_channels.emplace(pid, Connection(std::move(req.result), true, true));
      requests.send(static_cast<int32_t>(pid));
    }
  }
}

[[noreturn]] void RunSpawnedChild() {
  Connection boot(FileDescriptor(kBootstrapFd), true, true);
  RunRequest req;
  try {
    req = DecodeRunRequest(boot.RecvMessage(std::chrono::duration<double>(60)));
  } catch (const std::exception& e) {
    fprintf(stderr, "forksafe: spawned child could not read its bootstrap message: %s\n", e.what());
    _exit(122);
  }
  WatchLifeline(std::move(req.lifeline));
  Connection result = req.result ? Connection(std::move(req.result), true, true) : boot;
  RunChildBody(TargetOf(req), std::move(result), req.name);
}

struct ForkServer {
  std::mutex mu;
  pid_t pid = 0;
  Connection requests;
};

ForkServer& TheServer() {
  static auto* s = new ForkServer();
  return *s;
}

const bool g_server_handler = [] {
  // The server belongs to the parent; a forked child starts its own if it needs one. Its mutex
  // was held across the fork, so no thread was using the socket: closing it is safe.
  runtime::HoldAcrossFork(&TheServer().mu, "mp_forkserver", [] {
    ForkServer& s = TheServer();
    s.requests.close();
    s.requests = Connection();
    s.pid = 0;
  });
  runtime::internal::RegisterKeptResources("mp_forkserver", [](runtime::internal::KeptResources& k) {
    ForkServer& s = TheServer();
    std::lock_guard<std::mutex> lk(s.mu);
    k.AddChild(s.pid, "mp fork server");
    if (!s.requests.closed()) k.AddFd(s.requests.fileno(), "mp fork server socket");
  });
  return true;
}();

// Forgets the server: closes its socket, kills it (a no-op when it is dead already) and reaps it.
// It is our child and not reaped yet, so its pid cannot belong to another process. Holds s.mu.
void ForgetServerLocked(ForkServer& s) {
  s.requests.close();
  s.requests = Connection();
  if (s.pid > 0) {
    pid_t r;
    do {
      r = waitpid(s.pid, nullptr, WNOHANG);
    } while (r < 0 && errno == EINTR);
    if (r == 0) {  // still running (it may be exiting): end it
      ::kill(s.pid, SIGKILL);
      while (waitpid(s.pid, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
  }
  s.pid = 0;
}

// Reaps and forgets the server if it has exited (killed by the OOM killer or by hand), so that the
// next request starts a fresh one instead of failing on its closed socket. Holds s.mu.
void ForgetServerIfDeadLocked(ForkServer& s) {
  if (s.pid == 0) return;
  pid_t r;
  do {
    r = waitpid(s.pid, nullptr, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return;  // running
  s.pid = 0;  // reaped just now (or by someone else): never signal that pid again
  ForgetServerLocked(s);
}

}  // namespace

void ForkServerReapIfDead() {
  ForkServer& s = TheServer();
  std::lock_guard<std::mutex> lk(s.mu);
  ForgetServerIfDeadLocked(s);
}

pid_t ForkServerRun(Message request) {
  ForkServer& s = TheServer();
  std::lock_guard<std::mutex> lk(s.mu);
  ForgetServerIfDeadLocked(s);
  for (int attempt = 0;; ++attempt) {
    if (s.pid == 0) {
      auto [ours, theirs] = Pipe(true);
      std::string secret = NewServerSecret();
      FileDescriptor secret_pipe = SecretPipe(secret);
      s.pid = SpawnExecutable(kServerFlag, theirs.fileno(), secret_pipe.get());
      secret_pipe.reset();
      theirs.close();
      s.requests = ours;
      SendServerHello(s.requests, secret);
      explicit_bzero(secret.data(), secret.size());
    }
    try {
      s.requests.SendMessage(request);
      break;
    } catch (const Error& e) {
      // The server died before it could read the request (after the check above): nothing was
      // forked for it, so a fresh server may take it, once.
      ForgetServerLocked(s);
      if (e.code() != ErrorCode::kClosed || attempt > 0) throw;
    }
  }
  Message reply;
  try {
    reply = s.requests.RecvMessage(std::chrono::duration<double>(30));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kClosed) throw;
    // It died with the request: whether it forked the child is unknown, so do not retry.
    ForgetServerLocked(s);
    throw Error(ErrorCode::kUnavailable,
                "the fork server died while it was starting the process (killed, or out of "
                "memory); the process may not have started. Start it again: a new fork server "
                "is started on the next request");
  }
  return DecodeForkServerReply(reply);
}

}  // namespace forksafe::mp::internal

namespace forksafe::mp {

void InitMain(int argc, char** argv) {
  if (argc > 0) internal::SetArgv0(argv[0]);
  if (argc >= 2 && std::strcmp(argv[1], internal::kChildFlag) == 0) internal::RunSpawnedChild();
  if (argc >= 2 && std::strcmp(argv[1], internal::kServerFlag) == 0) {
    internal::ServeForever(internal::kBootstrapFd);
  }
  if (argc >= 2 && std::strcmp(argv[1], internal::kShmManagerFlag) == 0) {
    internal::RunShmManager(internal::kBootstrapFd);
  }
}

}  // namespace forksafe::mp
