// tests/fuzz/frame_fuzz.cc: Connection's message framing (mp/connection.cc,
// mp/internal/framing.h) on a stream written by another process.
// Input: one control byte, then the bytes of the stream. The low 2 bits of the control byte are
// how many descriptors (/dev/null) arrive with the first bytes; bits 2..5 pick this end's message
// size limit (16 B << 0..15). The stream goes through a real socketpair, whose writing end is
// closed, and Connection::RecvMessage reads messages until the stream ends or it refuses one.
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/framing.h"
#include "forksafe/mp/internal/scm_rights.h"
#include "tests/fuzz/fuzz_target.h"

namespace forksafe::fuzz {
namespace {

using runtime::Error;
using runtime::ErrorCode;

// Feeds `input` to a Connection and returns what it read: "msg(<bytes>,<fds>)" per message, then
// "end" or the error that stopped it. Traps on an error a peer's bytes must not cause.
std::string Run(std::string_view input) {
  if (input.empty()) return "end";
  const uint8_t control = static_cast<uint8_t>(input[0]);
  const std::string_view stream = input.substr(1);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return "no socketpair";
  mp::Connection reader(mp::FileDescriptor(sv[0]), true, false);
  reader.set_max_message_bytes(size_t{16} << ((control >> 2) & 15));
  {
    mp::FileDescriptor writer(sv[1]);
    const size_t nfds = control & 3;
    const mp::FileDescriptor null_fd = DevNull();
    std::vector<int> fds(nfds, null_fd.get());
    size_t off = 0;
    while (off < stream.size()) {
      iovec iov{const_cast<char*>(stream.data() + off), stream.size() - off};
      msghdr mh{};
      mh.msg_iov = &iov;
      mh.msg_iovlen = 1;
      std::vector<char> cbuf;
      if (off == 0 && !fds.empty()) mp::internal::AttachDescriptors(mh, cbuf, fds);
      const ssize_t n = sendmsg(writer.get(), &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n <= 0) break;  // the socket buffer is full: the rest is cut off, like a dead peer
      off += static_cast<size_t>(n);
    }
  }  // the writer is closed: the reader sees end-of-stream after the bytes
  std::ostringstream out;
  for (int i = 0; i < 64; ++i) {
    try {
      mp::Message m = reader.RecvMessage(std::chrono::duration<double>(5));
      out << "msg(" << m.bytes.size() << "," << m.fds.size() << ") ";
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kClosed && reader.closed()) {
        // The connection was closed after a bad header: nothing more to read.
        out << ErrorText(e);
        return out.str();
      }
      if (e.code() == ErrorCode::kClosed) {
        out << "end";
        return out.str();
      }
      if (e.code() != ErrorCode::kInvalidArgument && e.code() != ErrorCode::kResourceExhausted) {
        __builtin_trap();  // a deadline or an internal error: the decoder misbehaved
      }
      out << ErrorText(e);
      if (reader.closed()) return out.str();
      out << " ";
    }
  }
  out << "stopped";
  return out.str();
}

std::string Frame(const std::string& payload, uint32_t nfds) {
  mp::internal::FrameHeader h{mp::internal::kFrameMagic, nfds, payload.size()};
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h)) + payload;
}

}  // namespace

std::string Describe(std::string_view input) { return Run(input); }

std::vector<Seed> Seeds() {
  const char big = static_cast<char>(12 << 2);  // 64 KiB limit
  return {
      {"one_message", std::string(1, big) + Frame("hello", 0), "msg(5,0) end"},
      {"two_messages", std::string(1, big) + Frame("ab", 0) + Frame("", 0),
       "msg(2,0) msg(0,0) end"},
      {"with_descriptors", std::string(1, big | 2) + Frame("fd", 2), "msg(2,2) end"},
      {"codec_payload", std::string(1, big) + Frame(mp::Encode(std::string("x"), 7).bytes, 0),
       "msg(13,0) end"},
      {"over_limit", std::string(1, 0) + Frame(std::string(17, 'z'), 0),
       "error: resource_exhausted"},
  };
}

}  // namespace forksafe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)forksafe::fuzz::Run(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
