// mp/connection.h: Connection and Pipe — framed messages between two processes.
//
// What it offers
//   A Connection is one end of an AF_UNIX stream socket. send()/recv() move values through the
//   codec (mp/codec.h); send_bytes()/recv_bytes() move raw bytes; file descriptors travel beside
//   the bytes with SCM_RIGHTS (send a FileDescriptor, or any object that owns one, such as another
//   Connection). Pipe(duplex) returns two connected ends, as Python's multiprocessing.Pipe does.
//
// Guarantees
//   - Messages are framed: a recv returns exactly one whole message, never a part or two merged.
//   - send() returns once the whole message is in the kernel: nothing is buffered in the process,
//     so nothing is lost if the process exits or is killed right after a send returns.
//   - Copies of a Connection share one socket. send and recv are each serialized by a mutex, so
//     several threads may send (or receive) on the same connection without interleaving.
//   - Fork: a forked child inherits the connection and may use it; spawned children receive it as
//     a Process argument (it serializes its descriptor out of band).
//   - Errors: a peer that closed its end -> Error(kClosed), also in the middle of a message (the
//     error says how much of it arrived); use after close() -> Error(kClosed);
//     a message over max_message_bytes() -> Error(kInvalidArgument) at the sender (nothing is sent)
//     or Error(kResourceExhausted) at the receiver (the connection is then closed, since the rest
//     of the stream cannot be trusted); negative timeouts -> Error(kInvalidArgument).
//
// Hazard: two processes that both recv() on the same end compete for messages; use a Queue for
// many consumers.
#ifndef FORKSAFE_MP_CONNECTION_H_
#define FORKSAFE_MP_CONNECTION_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/timeout.h"

namespace forksafe::mp {

/// One end of a message channel between processes.
class Connection {
 public:
  /// Default size limit of one message: 1 GiB.
  static constexpr size_t kDefaultMaxMessageBytes = size_t{1} << 30;
  /// Most descriptors one message may carry (the kernel's SCM_MAX_FD).
  static constexpr size_t kMaxDescriptors = 253;

  /// A closed connection.
  Connection() = default;
  /// Wraps a connected AF_UNIX stream socket.
  Connection(FileDescriptor socket, bool readable, bool writable);

  /// Sends values through the codec, as one message.
  template <class... Ts>
  void send(const Ts&... values) {
    SendMessage(Encode(values...));
  }
  /// Receives one message and decodes a T from it. Blocks until a message arrives.
  template <class T>
  T recv() {
    Message m = RecvMessage(std::nullopt);
    return DecodeAs<T>(m);
  }
  /// Sends raw bytes as one message.
  void send_bytes(std::string_view data);
  /// Receives one message's raw bytes (descriptors sent with it are closed).
  std::string recv_bytes();

  /// Sends a prepared message (bytes + descriptors).
  void SendMessage(const Message& msg);
  /// Receives one message, waiting at most `timeout` for all of it; Error(kDeadlineExceeded) on
  /// timeout. When part of a message had arrived by then (the sender stalled mid-message), the
  /// connection is also closed: the rest of the stream cannot be trusted.
  Message RecvMessage(Timeout timeout);

  /// True when a message (or end-of-stream) can be read without blocking, waiting at most
  /// `timeout` (default: do not wait; nullopt: forever).
  bool poll(Timeout timeout = 0.0) const;

  /// Closes this end for every copy in this process. Idempotent.
  void close();
  bool closed() const;
  bool readable() const;
  bool writable() const;
  /// The socket descriptor (-1 when closed).
  int fileno() const;

  size_t max_message_bytes() const;
  void set_max_message_bytes(size_t n);

  template <class Archive>
  void save(Archive& ar) const {
    FileDescriptor dup = closed() ? FileDescriptor() : FileDescriptor::Dup(fileno());
    ar(dup, readable(), writable());
  }
  template <class Archive>
  void load(Archive& ar) {
    FileDescriptor fd;
    bool r = false, w = false;
    ar(fd, r, w);
    *this = fd ? Connection(std::move(fd), r, w) : Connection();
  }

 private:
  struct State;  // connection.cc
  State& Live(const char* what) const;
  std::shared_ptr<State> state_;
};

/// Returns two connected ends. With duplex, both ends send and receive; otherwise the first end
/// only receives and the second only sends (as in Python).
std::pair<Connection, Connection> Pipe(bool duplex = true);

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_CONNECTION_H_
