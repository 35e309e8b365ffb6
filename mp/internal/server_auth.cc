#include "forksafe/mp/internal/server_auth.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "forksafe/mp/internal/child.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/fork_aware_once.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/random.h"

namespace forksafe::mp::internal {
namespace {
std::atomic<uint64_t> g_refused{0};
}  // namespace

std::string NewServerSecret() { return runtime::internal::RandomBytes(kSecretBytes); }

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

FileDescriptor SecretPipe(const std::string& secret) {
  int p[2];
  // Out of descriptors is kResourceExhausted naming the limit, as for every process start.
  if (pipe2(p, O_CLOEXEC) != 0) ThrowCannotStartProcess("pipe2 for a server's secret", errno);
  FileDescriptor read_end(p[0]), write_end(p[1]);
  // A pipe holds at least 4 KiB: the write completes at once, before the server exists.
  size_t put = 0;
  while (put < secret.size()) {
    const ssize_t w = ::write(write_end.get(), secret.data() + put, secret.size() - put);
    if (w < 0) {
      if (errno == EINTR) continue;
      runtime::ThrowSystemError("write of a server secret", errno);
    }
    put += static_cast<size_t>(w);
  }
  return read_end;
}

namespace {

// The handoff's state: its mutex is held by a live SecretHandoff and across every fork.
struct Handoffs {
  // Held by the live SecretHandoff for its whole life (its lock_, on mu.native(): the analysis
  // cannot follow a lock kept in a member, so its methods assert it).
  runtime::internal::Mutex mu;
  // The files of the live handoff (the pipe, and what Guard() added), so that copies made by
  // dup are found too.
  int open FORKSAFE_GUARDED_BY(mu) = 0;
  dev_t dev[2] FORKSAFE_GUARDED_BY(mu) = {0, 0};
  ino_t ino[2] FORKSAFE_GUARDED_BY(mu) = {0, 0};
};

Handoffs* MakeHandoffs() {
  auto* state = new Handoffs;  // lives for the process: a registration refers to its mutex
  runtime::HoldAcrossFork(&state->mu, "mp secret pipes", [state] {
    // The fork could not wait for a live handoff (its prepare gave up): close every copy of
    // the secret pipe this child got. Async-signal-safe calls only.
    state->mu.AssertHeld();  // the child's only thread: held, or free after a fork made alone
    if (!state->open) return;
    struct rlimit rl;
    int max_fd = 65536;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < static_cast<rlim_t>(max_fd)) {
      max_fd = static_cast<int>(rl.rlim_cur);
    }
    for (int fd = 0; fd < max_fd; ++fd) {
      struct stat st;
      if (fstat(fd, &st) != 0) continue;
      for (int i = 0; i < state->open; ++i) {
        if (st.st_dev == state->dev[i] && st.st_ino == state->ino[i]) ::close(fd);
      }
    }
    state->open = 0;
  });
  return state;
}

// Made on first use; not a function-local static (registering waits for a fork in progress:
// runtime/internal/fork_aware_once.h).
Handoffs& TheHandoffs() { return runtime::internal::ForkAwareOnce<Handoffs, &MakeHandoffs>(); }

}  // namespace

SecretHandoff::SecretHandoff(const std::string& secret) : lock_(TheHandoffs().mu.native()) {
  TheHandoffs().mu.AssertHeld();  // lock_ holds it
  TheHandoffs().open = 0;
  pipe_ = SecretPipe(secret);
  Guard(pipe_.get());
}

void SecretHandoff::Guard(int fd) {
  Handoffs& h = TheHandoffs();
  h.mu.AssertHeld();  // a live handoff's lock_ holds it
  struct stat st;
  if (h.open < 2 && fstat(fd, &st) == 0) {
    h.dev[h.open] = st.st_dev;
    h.ino[h.open] = st.st_ino;
    ++h.open;
  }
}

SecretHandoff::~SecretHandoff() {
  pipe_.reset();
  TheHandoffs().mu.AssertHeld();  // lock_ holds it until the members are destroyed
  TheHandoffs().open = 0;
}

Connection SpawnServer(const char* flag, pid_t* pid, const std::string* executable) {
  std::string secret = NewServerSecret();
  Connection ours;
  {
    SecretHandoff handoff(secret);  // no fork in between gets the pipe or the server's end
    auto [mine, theirs] = Pipe(true);
    handoff.Guard(theirs.fileno());
    *pid = SpawnExecutable(flag, theirs.fileno(), handoff.fd(), nullptr, executable);
    theirs.close();
    ours = mine;
  }
  SendServerHello(ours, secret);
  explicit_bzero(secret.data(), secret.size());
  return ours;
}

std::string ReadInheritedSecret(int fd) {
  std::string s(kSecretBytes, '\0');
  size_t got = 0;
  while (got < s.size()) {
    const ssize_t r = ::read(fd, s.data() + got, s.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  if (got != s.size()) return std::string();
  return s;
}

void SendServerHello(Connection& c, const std::string& secret) {
  c.send(std::string("hello"), secret);
}

bool CheckServerHello(Connection& c, const std::string& secret, const char* server,
                      std::chrono::duration<double> timeout) {
  bool ok = false;
  const size_t limit = c.closed() ? 0 : c.max_message_bytes();
  try {
    // A hello is tiny: a peer that sends more is refused without reading it.
    c.set_max_message_bytes(1024);
    Message m = c.RecvMessage(timeout);
    std::string kind, presented;
    Decode(m, kind, presented);
    // An empty secret (the server got none) never matches: nothing is served then.
    ok = kind == "hello" && !secret.empty() && ConstantTimeEqual(presented, secret);
  } catch (...) {
    ok = false;  // end-of-file, a timeout or a malformed message
  }
  if (ok) c.set_max_message_bytes(limit);
  if (!ok) {
    const uint64_t n = ++g_refused;
    fprintf(stderr,
            "forksafe: %s (pid %d) refused a connection that did not present its secret (%llu "
            "refused so far)\n",
            server, getpid(), static_cast<unsigned long long>(n));
  }
  return ok;
}

uint64_t RefusedConnections() { return g_refused.load(); }

}  // namespace forksafe::mp::internal
