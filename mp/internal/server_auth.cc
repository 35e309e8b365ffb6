#include "forksafe/mp/internal/server_auth.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>

#include "forksafe/mp/internal/child.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {
namespace {
std::atomic<uint64_t> g_refused{0};
}  // namespace

std::string NewServerSecret() { return RandomBytes(kSecretBytes); }

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
