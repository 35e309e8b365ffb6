// mp/internal/fork_server.cc: NOT FOR USERS. The fork server (a process spawned from this
// executable, single-threaded, that forks a child per request and reports each child's exit
// status to whoever asked for it), the body of a spawned child, and InitMain, which takes over
// either. Declarations in mp/internal/child.h.
//
// The server is the library's own process, and keeps serving through what the program around it
// does (mp/internal/child.h): it sets its own SIGCHLD disposition, and a request that does not fit
// its descriptor table (RLIMIT_NOFILE, inherited from its creator) is refused with -EMFILE, which
// the parent turns into Error(kResourceExhausted) naming the limit, instead of ending the server
// (and with it the exit reports of every child it runs).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <string_view>
#include <vector>

#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/framing.h"
#include "forksafe/mp/internal/server_auth.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::mp::internal {
namespace {

using runtime::Error;
using runtime::ErrorCode;

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

// Room for `n` more descriptors in this process's table: probed by taking them (and giving them
// back). The server is single-threaded, so the room is still there when the request arrives.
bool HasRoomFor(size_t n, int any_fd) {
  std::vector<FileDescriptor> probe;
  for (size_t i = 0; i < n; ++i) {
    FileDescriptor d(fcntl(any_fd, F_DUPFD_CLOEXEC, 0));
    if (!d) return false;
    probe.push_back(std::move(d));
  }
  return true;
}

// Reads exactly `len` bytes of the stream without taking any descriptors that come with them
// (with no room for control data the kernel drops them); false at end-of-stream or on an error.
bool SkipBytes(int fd, uint64_t len) {
  char buf[4096];
  while (len > 0) {
    iovec iov{buf, static_cast<size_t>(std::min<uint64_t>(len, sizeof(buf)))};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    const ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    len -= static_cast<uint64_t>(n);
  }
  return true;
}

enum class Received { kRequest, kNoRoom, kEnd };

// Receives the next request. A request whose descriptors would not fit in this process's table
// (RLIMIT_NOFILE, which it inherited from its creator, and every running child holds one status
// channel here) is read whole without its descriptors (kNoRoom), so that the stream stays in step
// and the server lives on; the kernel would otherwise drop the descriptors that did not fit.
Received ReceiveRequest(Connection& requests, Message* msg) {
  const int fd = requests.fileno();
  char raw[sizeof(FrameHeader)];
  for (;;) {
    const ssize_t n = recv(fd, raw, sizeof(raw), MSG_PEEK | MSG_WAITALL);
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof(raw))) return Received::kEnd;
    break;
  }
  FrameHeader h;
  try {
    h = ParseFrameHeader(std::string_view(raw, sizeof(raw)), requests.max_message_bytes(),
                         Connection::kMaxDescriptors);
  } catch (const Error&) {
    return Received::kEnd;  // not our creator's framing: nothing more can be read in step
  }
  if (!HasRoomFor(h.nfds, fd)) {
    return SkipBytes(fd, sizeof(raw) + h.length) ? Received::kNoRoom : Received::kEnd;
  }
  try {
    *msg = requests.RecvMessage(std::nullopt);
    return Received::kRequest;
  } catch (...) {
    return Received::kEnd;  // the creator closed the request socket: nothing more to serve
  }
}

[[noreturn]] void ServeForever(int sock) {
  // Nothing is served before the creator proved it holds the secret it handed us on kSecretFd
  // (see mp/internal/server_auth.h for the threat model). A refused connection is closed unread
  // and, being the only one this server has, ends it.
  std::string secret = ReadInheritedSecret(kSecretFd);
  // This process is the library's own: it sets its dispositions instead of inheriting the
  // program's. An ignored SIGCHLD (inherited across exec) would make the kernel reap our children
  // before we can report their status; the children start with SIGCHLD at its default, as
  // Python's forkserver children do.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigaction(SIGCHLD, &dfl, nullptr);
  RegisterExitReport();  // once, here: never in a forked child (see RegisterExitReport)
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
  // The creator's lifeline, taken from its first request (every request carries the same pipe):
  // the server dies with its creator too. Kept by moving, never by a dup that could fail.
  FileDescriptor lifeline;
  // A reply that cannot be sent means the creator is gone: nothing more to serve.
  auto reply = [&requests](int32_t v) {
    try {
      requests.send(v);
    } catch (...) {
      _exit(0);
    }
  };
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
      const Received got = ReceiveRequest(requests, &msg);
      if (got == Received::kEnd) _exit(0);
      if (got == Received::kNoRoom) {
        reply(-EMFILE);  // the parent throws kResourceExhausted naming the limit
        continue;
      }
      RunRequest req;
      try {
        req = DecodeRunRequest(std::move(msg), /*need_result=*/true);
      } catch (...) {
        reply(-1);
        continue;
      }
      const pid_t pid = fork();
      if (pid == 0) {
        explicit_bzero(secret.data(), secret.size());  // user code runs here: leave it no secret
        ::close(sfd);
        sigprocmask(SIG_UNBLOCK, &mask, nullptr);
        requests.close();
        status_channels.clear();
        WatchLifeline(req.lifeline ? std::move(req.lifeline) : std::move(lifeline));
        Connection result(std::move(req.result), true, true);
        RunChildBody(TargetOf(req), std::move(result), req.name, req.env);
      }
      if (pid < 0) {
        reply(-errno);
        continue;
      }
      if (!lifeline) lifeline = std::move(req.lifeline);
      status_channels.emplace(pid, Connection(std::move(req.result), true, true));
      reply(pid);
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
  RegisterExitReport();
  WatchLifeline(std::move(req.lifeline));
  Connection result = req.result ? Connection(std::move(req.result), true, true) : boot;
  RunChildBody(TargetOf(req), std::move(result), req.name, req.env);
}

struct ForkServer {
  runtime::internal::Mutex mu;  // one request at a time: a request and its reply are a pair
  pid_t pid FORKSAFE_GUARDED_BY(mu) = 0;
  Connection requests FORKSAFE_GUARDED_BY(mu);
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
    s.mu.AssertHeld();  // the child's only thread: held, or free after a fork made alone
    // Written only when set: each page the child writes costs it a copy-on-write fault.
    if (!s.requests.closed()) {
      s.requests.close();
      s.requests = Connection();
    }
    if (s.pid != 0) s.pid = 0;
  });
  runtime::internal::RegisterKeptResources(
      "mp_forkserver", [](runtime::internal::KeptResources& k) {
        ForkServer& s = TheServer();
        runtime::internal::MutexLock lk(&s.mu);
        k.AddChild(s.pid, "mp fork server");
        if (!s.requests.closed()) k.AddFd(s.requests.fileno(), "mp fork server socket");
      });
  return true;
}();

// Forgets the server: closes its socket, kills it (a no-op when it is dead already) and reaps it.
// It is our child and not reaped yet, so its pid cannot belong to another process. Holds s.mu.
void ForgetServerLocked(ForkServer& s) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
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
void ForgetServerIfDeadLocked(ForkServer& s) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  if (s.pid == 0) return;
  pid_t r;
  do {
    r = waitpid(s.pid, nullptr, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return;  // running
  s.pid = 0;           // reaped just now (or by someone else): never signal that pid again
  ForgetServerLocked(s);
}

}  // namespace

void ForkServerReapIfDead() {
  ForkServer& s = TheServer();
  runtime::internal::MutexLock lk(&s.mu);
  ForgetServerIfDeadLocked(s);
}

pid_t ForkServerRun(Message request) {
  ForkServer& s = TheServer();
  runtime::internal::MutexLock lk(&s.mu);
  ForgetServerIfDeadLocked(s);
  for (int attempt = 0;; ++attempt) {
    if (s.pid == 0) {
      s.requests = SpawnServer(kServerFlag, &s.pid);
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
    throw Error(ErrorCode::kProcessFailed,
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
  internal::MarkInitMainCalled();
  if (argc >= 2 && std::strcmp(argv[1], internal::kChildFlag) == 0) internal::RunSpawnedChild();
  if (argc >= 2 && std::strcmp(argv[1], internal::kServerFlag) == 0) {
    internal::ServeForever(internal::kBootstrapFd);
  }
  if (argc >= 2 && std::strcmp(argv[1], internal::kShmManagerFlag) == 0) {
    internal::RunShmManager(internal::kBootstrapFd);
  }
}

}  // namespace forksafe::mp
