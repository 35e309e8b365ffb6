// tests/support/fd_passing.h: one descriptor plus a small fixed-size payload over an AF_UNIX
// socket (SCM_RIGHTS), for tests and benchmarks that hand raw device/ipc.h handles to another
// process without going through mp/'s codec.
#ifndef FORKSAFE_TESTS_SUPPORT_FD_PASSING_H_
#define FORKSAFE_TESTS_SUPPORT_FD_PASSING_H_

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstring>

namespace forksafe::testing {

/// Sends `n` bytes at `data` (n >= 1) with `fd` attached. True when all of it went.
inline bool SendWithFd(int sock, int fd, const void* data, size_t n) {
  iovec iov{const_cast<void*>(data), n};
  alignas(cmsghdr) char buf[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = buf;
  msg.msg_controllen = sizeof buf;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  return sendmsg(sock, &msg, 0) == static_cast<ssize_t>(n);
}

/// Receives exactly `n` bytes into `data` and the descriptor sent with them (close-on-exec).
/// Returns the descriptor, or -1 on a short read or when none came.
inline int ReceiveWithFd(int sock, void* data, size_t n) {
  iovec iov{data, n};
  alignas(cmsghdr) char buf[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = buf;
  msg.msg_controllen = sizeof buf;
  if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL) != static_cast<ssize_t>(n)) return -1;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (c == nullptr || c->cmsg_type != SCM_RIGHTS) return -1;
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_FD_PASSING_H_
