#include "forksafe/mp/connection.h"

#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/internal/framing.h"
#include "forksafe/mp/internal/scm_rights.h"
#include "forksafe/mp/internal/shm_sync.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::mp {
namespace {

using runtime::Error;
using runtime::ErrorCode;

using internal::FrameHeader;
using internal::kFrameMagic;

[[noreturn]] void ThrowPeerClosed(const char* what) {
  throw Error(ErrorCode::kClosed,
              absl::StrCat(what,
                           ": the other end of the connection was closed (the peer "
                           "process closed it or exited)"));
}

// Writes all of [data, data+len) on a stream socket, the first chunk with `fds` attached.
void SendAll(int sock, const char* data, size_t len, const std::vector<int>& fds) {
  size_t off = 0;
  bool fds_sent = fds.empty();
  std::vector<char> cbuf;
  while (off < len) {
    iovec iov{const_cast<char*>(data + off), len - off};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (!fds_sent) internal::AttachDescriptors(mh, cbuf, fds);
    const ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET) ThrowPeerClosed("send");
      if (errno == ETOOMANYREFS) {
        // The kernel counts descriptors in flight per user (sent by any of its processes, not yet
        // received) against the sender's RLIMIT_NOFILE, unless it has CAP_SYS_RESOURCE.
        rlimit rl{};
        getrlimit(RLIMIT_NOFILE, &rl);
        throw Error(ErrorCode::kResourceExhausted,
                    absl::StrCat("send: the descriptors this user has in flight (sent by any of "
                                 "its processes, not yet received) exceed this process's "
                                 "RLIMIT_NOFILE (",
                                 rl.rlim_cur,
                                 "); let the receivers read their messages first, or raise "
                                 "the limit (ulimit -n)"));
      }
      runtime::ThrowSystemError("send on a connection", errno);
    }
    fds_sent = true;
    off += static_cast<size_t>(n);
  }
}

bool PollFd(int fd, short events, Timeout timeout, const char* what);

// A message started but did not finish in time: the stream cannot be resumed (the caller closed
// the connection).
[[noreturn]] void ThrowTornTimeout(double seconds, size_t arrived, const std::string& of) {
  throw Error(ErrorCode::kDeadlineExceeded,
              absl::StrCat("recv: a message started but did not finish within ", seconds, " s (",
                           arrived, " of ", of,
                           " bytes arrived: the sender stalled, or died "
                           "while another process holds its end open); the connection was "
                           "closed, since the rest of the stream cannot be trusted"));
}

enum class Received { kAll, kEndOfStream, kTimedOut };

// Reads exactly `len` bytes; collects descriptors that arrive. kEndOfStream on EOF before the
// first byte (clean end of stream); throws on EOF in the middle. With a deadline, kTimedOut when
// it passes first (`*got` bytes were read by then).
Received RecvAll(int sock, char* data, size_t len, std::vector<FileDescriptor>* fds,
                 const internal::Deadline& deadline, size_t* got) {
  size_t& off = *got;
  off = 0;
  // With a deadline the socket is read without blocking, and polled (until the deadline) only
  // when it has nothing to give: no extra system call while data is there.
  const int flags = MSG_CMSG_CLOEXEC | (deadline.has_value() ? MSG_DONTWAIT : 0);
  while (off < len) {
    iovec iov{data + off, len - off};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * Connection::kMaxDescriptors)];
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof(cbuf);
    const ssize_t n = recvmsg(sock, &mh, flags);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        const double left = std::max(
            0.0, std::chrono::duration<double>(*deadline - internal::Clock::now()).count());
        if (!PollFd(sock, POLLIN, left, "recv")) return Received::kTimedOut;
        continue;
      }
      if (errno == ECONNRESET) ThrowPeerClosed("recv");
      runtime::ThrowSystemError("recv on a connection", errno);
    }
    internal::CollectDescriptors(mh, fds);
    if (n == 0) {
      if (off == 0) return Received::kEndOfStream;
      throw Error(ErrorCode::kClosed,
                  absl::StrCat("recv: the peer closed the connection in the middle of a message (",
                               off, " of ", len, " bytes arrived)"));
    }
    off += static_cast<size_t>(n);
  }
  return Received::kAll;
}

bool PollFd(int fd, short events, Timeout timeout, const char* what) {
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, what);
  for (;;) {
    int ms = -1;
    if (deadline.has_value()) {
      const auto left = *deadline - internal::Clock::now();
      ms = left.count() <= 0
               ? 0
               : static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
    }
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      runtime::ThrowSystemError(what, errno);
    }
    return rc > 0;
  }
}

}  // namespace

// One end's state, shared by the copies of a Connection in this process.
struct Connection::State {
  // The socket. Closed (reset) under both mutexes by close(), under recv_mu alone by a receive
  // that cannot trust the rest of the stream; read without either by closed(), fileno() and
  // poll(), whose answer may be stale by the time it is used (as a descriptor number always is).
  // No one mutex guards it, so it carries no annotation.
  FileDescriptor fd;
  bool readable = false;  // set once, before the State is shared
  bool writable = false;
  size_t max_bytes = kDefaultMaxMessageBytes;
  runtime::internal::Mutex send_mu;  // one sender at a time: frames are never interleaved
  runtime::internal::Mutex recv_mu;  // one receiver at a time: frames are read whole
};

Connection::Connection(FileDescriptor socket, bool readable, bool writable)
    : state_(std::make_shared<State>()) {
  state_->fd = std::move(socket);
  state_->readable = readable;
  state_->writable = writable;
}

Connection::State& Connection::Live(const char* what) const {
  if (!state_ || !state_->fd) {
    throw Error(ErrorCode::kClosed, absl::StrCat(what, ": the connection is closed"));
  }
  return *state_;
}

void Connection::SendMessage(const Message& msg) {
  State& s = Live("send");
  if (!s.writable) {
    throw Error(ErrorCode::kFailedPrecondition,
                "send: this end of the pipe is read-only (Pipe(duplex=false) returns "
                "(reader, writer))");
  }
  if (msg.bytes.size() > s.max_bytes) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("send: message of ", msg.bytes.size(), " bytes exceeds the limit of ",
                             s.max_bytes,
                             " bytes; raise it with set_max_message_bytes() on both "
                             "ends, or send large data through shared memory"));
  }
  if (msg.fds.size() > kMaxDescriptors) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("send: a message may carry at most ", kMaxDescriptors,
                             " file descriptors, this one has ", msg.fds.size()));
  }
  std::vector<int> fds;
  fds.reserve(msg.fds.size());
  for (const FileDescriptor& f : msg.fds) fds.push_back(f.get());
  FrameHeader h{kFrameMagic, static_cast<uint32_t>(fds.size()), msg.bytes.size()};
  runtime::internal::MutexLock lk(&s.send_mu);
  const int sock = s.fd.get();
  if (msg.bytes.size() <= 64 * 1024) {
    // One write for header and payload: one system call for small messages.
    std::string frame(sizeof(h) + msg.bytes.size(), '\0');
    std::memcpy(frame.data(), &h, sizeof(h));
    std::memcpy(frame.data() + sizeof(h), msg.bytes.data(), msg.bytes.size());
    SendAll(sock, frame.data(), frame.size(), fds);
  } else {
    SendAll(sock, reinterpret_cast<const char*>(&h), sizeof(h), fds);
    SendAll(sock, msg.bytes.data(), msg.bytes.size(), {});
  }
}

namespace {
// RecvAll for RecvMessage: descriptors that could not be received (kResourceExhausted: this
// process is at its descriptor limit; scm_rights.h) leave the rest of the message in the stream,
// so the connection is closed, as for a torn timeout, and the error goes to the caller.
Received RecvAllOrClose(FileDescriptor& fd, char* data, size_t len,
                        std::vector<FileDescriptor>* fds, const internal::Deadline& deadline,
                        size_t* got) {
  try {
    return RecvAll(fd.get(), data, len, fds, deadline, got);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kResourceExhausted) fd.reset();
    throw;
  }
}
}  // namespace

Message Connection::RecvMessage(Timeout timeout) {
  State& s = Live("recv");
  if (!s.readable) {
    throw Error(ErrorCode::kFailedPrecondition,
                "recv: this end of the pipe is write-only (Pipe(duplex=false) returns "
                "(reader, writer))");
  }
  runtime::internal::MutexLock lk(&s.recv_mu);
  const int sock = s.fd.get();
  // The timeout bounds the whole message, not only its first byte: a peer that sent part of a
  // message and stalls (or whose end another process keeps open) must not hang the reader.
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "recv");
  if (timeout.has_value() && !PollFd(sock, POLLIN, timeout, "recv")) {
    throw Error(ErrorCode::kDeadlineExceeded,
                absl::StrCat("recv: no message arrived within ", timeout->count(), " s"));
  }
  Message msg;
  char raw[sizeof(FrameHeader)];
  size_t got = 0;
  switch (RecvAllOrClose(s.fd, raw, sizeof(raw), &msg.fds, deadline, &got)) {
    case Received::kEndOfStream: ThrowPeerClosed("recv");
    case Received::kTimedOut:
      if (got == 0) {
        throw Error(ErrorCode::kDeadlineExceeded,
                    absl::StrCat("recv: no message arrived within ", timeout->count(), " s"));
      }
      s.fd.reset();
      ThrowTornTimeout(timeout->count(), got, absl::StrCat("at least ", sizeof(FrameHeader)));
    case Received::kAll: break;
  }
  FrameHeader h;
  try {
    h = internal::ParseFrameHeader(std::string_view(raw, sizeof(raw)), s.max_bytes,
                                   kMaxDescriptors);
  } catch (const Error&) {
    s.fd.reset();  // the rest of the stream cannot be trusted
    throw;
  }
  msg.bytes.resize(h.length);
  if (h.length > 0) {
    switch (RecvAllOrClose(s.fd, msg.bytes.data(), h.length, &msg.fds, deadline, &got)) {
      case Received::kEndOfStream:
        throw Error(ErrorCode::kClosed,
                    absl::StrCat("recv: the peer closed the connection in the middle of a "
                                 "message (",
                                 sizeof(h), " of ", sizeof(h) + h.length, " bytes arrived)"));
      case Received::kTimedOut:
        s.fd.reset();
        ThrowTornTimeout(timeout->count(), sizeof(h) + got, std::to_string(sizeof(h) + h.length));
      case Received::kAll: break;
    }
  }
  internal::CheckFrameDescriptors(h, msg.fds.size());
  return msg;
}

void Connection::send_bytes(std::string_view data) {
  Message m;
  m.bytes.assign(data.data(), data.size());
  SendMessage(m);
}

std::string Connection::recv_bytes() { return RecvMessage(std::nullopt).bytes; }

bool Connection::poll(Timeout timeout) const {
  State& s = Live("poll");
  return PollFd(s.fd.get(), POLLIN, timeout, "poll");
}

void Connection::close() {
  if (!state_) return;
  // Take both locks so no send/recv is midway through the descriptor.
  runtime::internal::MutexLock a(&state_->send_mu);
  runtime::internal::MutexLock b(&state_->recv_mu);
  state_->fd.reset();
}

bool Connection::readable() const { return state_ && state_->readable; }
bool Connection::writable() const { return state_ && state_->writable; }

bool Connection::closed() const { return !state_ || !state_->fd; }

int Connection::fileno() const { return state_ ? state_->fd.get() : -1; }

size_t Connection::max_message_bytes() const {
  return state_ ? state_->max_bytes : kDefaultMaxMessageBytes;
}

void Connection::set_max_message_bytes(size_t n) {
  if (n == 0) throw Error(ErrorCode::kInvalidArgument, "max_message_bytes must be > 0");
  Live("set_max_message_bytes").max_bytes = n;
}

std::pair<Connection, Connection> Pipe(bool duplex) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      throw Error(ErrorCode::kResourceExhausted,
                  "Pipe: out of file descriptors; close unused connections or raise the limit "
                  "(ulimit -n)");
    }
    runtime::ThrowSystemError("socketpair", err);
  }
  FileDescriptor a(sv[0]), b(sv[1]);
  if (duplex) return {Connection(std::move(a), true, true), Connection(std::move(b), true, true)};
  shutdown(a.get(), SHUT_WR);
  shutdown(b.get(), SHUT_RD);
  return {Connection(std::move(a), true, false), Connection(std::move(b), false, true)};
}

}  // namespace forksafe::mp
