// mp/internal/server_auth.h: NOT FOR USERS. The secret that the library's helper servers (the
// fork server of mp/internal/child.cc and the shm manager of mp/internal/shm_manager.cc) check
// before they serve a connection, and random names.
//
// Threat model
//   - Other users: the servers bind nothing (no socket path, no abstract name): each is reached
//     only through the socketpair its creator handed it at spawn, so a process of another user
//     cannot connect at all. Shared memory is created owner-only (0600; memfds too) and named
//     /dev/shm objects carry 128 random bits from getrandom(), so they cannot be guessed either.
//   - Processes of the same user that do not hold the secret: a server reads a 32-byte secret
//     (getrandom) from descriptor kSecretFd, a pipe its creator filled and that no other process
//     holds, and closes it at once. The secret is in no environment variable, file or argument.
//     The first message on a connection must carry it; it is compared in constant time. A
//     connection that fails (a wrong or missing secret, or nothing within kHelloTimeout) is
//     closed before anything it sent is acted on, and counted (RefusedConnections(), and a line
//     on stderr). Each server has exactly one client connection, so a refused one ends that
//     server; the creator's other servers and every other client are unaffected.
//   - Out of scope: a process that can ptrace the creator or the server (same user, ptrace
//     allowed) can read the secret from memory or take the descriptor (pidfd_getfd); so can
//     root. Running untrusted code as the same user needs a sandbox (ptrace_scope, namespaces).
#ifndef FORKSAFE_MP_INTERNAL_SERVER_AUTH_H_
#define FORKSAFE_MP_INTERNAL_SERVER_AUTH_H_

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/shared_segment.h"

namespace forksafe::mp::internal {

/// The descriptor on which a spawned server finds its secret (a pipe's read end).
inline constexpr int kSecretFd = 4;
/// Bytes of a server secret.
inline constexpr size_t kSecretBytes = 32;
/// How long a server waits for a connection's first message (the secret).
inline constexpr std::chrono::seconds kHelloTimeout{30};

/// A new server secret (kSecretBytes random bytes).
std::string NewServerSecret();
/// Equal length and bytes, in time that depends only on the length (no early exit).
bool ConstantTimeEqual(const std::string& a, const std::string& b);

/// A close-on-exec pipe read end from which `secret` can be read (the write end is closed).
FileDescriptor SecretPipe(const std::string& secret);
/// The secret pipe of a server about to be spawned, which no forked child of this process can
/// inherit (a fork by another thread between SecretPipe() and the spawn would otherwise hand the
/// child a readable secret; so would the server's end of its socket, where the hello arrives):
/// while a handoff exists, fork() waits for it (runtime::HoldAcrossFork), and a fork that could
/// not wait closes the pipe (and what Guard() added) in the child. One at a time in a process.
/// Create it, spawn the server with fd(), let it go right after the spawn.
class SecretHandoff {
 public:
  explicit SecretHandoff(const std::string& secret);
  /// Closes the pipe, then lets forks proceed.
  ~SecretHandoff();
  SecretHandoff(const SecretHandoff&) = delete;
  SecretHandoff& operator=(const SecretHandoff&) = delete;
  /// The pipe's read end, for SpawnExecutable.
  int fd() const { return pipe_.get(); }
  /// Also keeps `fd`'s file (the server's end of its bootstrap socket, made after this handoff)
  /// from forked children; the caller closes it before the handoff ends.
  void Guard(int fd);

 private:
  std::unique_lock<std::mutex> lock_;
  FileDescriptor pipe_;
};

/// In a server: reads the secret from `fd` and closes it; "" when there is none.
std::string ReadInheritedSecret(int fd);

/// Client side: the first message of a connection to a server.
void SendServerHello(Connection& c, const std::string& secret);
/// Server side: reads the first message within `timeout` and checks it carries `secret`. On
/// failure the caller must close the connection; RefusedConnections() is already counted.
bool CheckServerHello(Connection& c, const std::string& secret, const char* server,
                      std::chrono::duration<double> timeout = kHelloTimeout);
/// Connections this process (a server) refused.
uint64_t RefusedConnections();

/// Starts a helper server: spawns `executable` (nullptr: this executable) with `flag`
/// (SpawnExecutable) on one end of a new socketpair and a fresh secret (through a SecretHandoff,
/// so no forked child gets either), sends the hello on the other end and returns it; `*pid` is
/// the server's.
Connection SpawnServer(const char* flag, pid_t* pid, const std::string* executable = nullptr);

/// Spawns this executable (/proc/self/exe, argv[0] as InitMain saw it), or `executable` when
/// given (argv[0] its path), with `flag`, `fd_for_child` as descriptor 3 and, when >= 0,
/// `secret_fd` as kSecretFd (mp/process.cc); with this process's environment, in which `env`'s
/// (name, value) pairs, when given, replace or add variables (so the new program's static
/// initializers see them).
pid_t SpawnExecutable(const char* flag, int fd_for_child, int secret_fd,
                      const std::vector<std::pair<std::string, std::string>>* env = nullptr,
                      const std::string* executable = nullptr);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SERVER_AUTH_H_
