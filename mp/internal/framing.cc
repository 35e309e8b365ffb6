#include "forksafe/mp/internal/framing.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {

using runtime::Error;
using runtime::ErrorCode;

FrameHeader ParseFrameHeader(std::string_view bytes, size_t max_bytes, size_t max_fds) {
  FrameHeader h{};
  if (bytes.size() != sizeof(h)) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("recv: a frame header is ", sizeof(h), " bytes, got ", bytes.size()));
  }
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (h.magic != kFrameMagic || h.nfds > max_fds) {
    throw Error(ErrorCode::kInvalidArgument,
                "recv: the stream is not a forksafe message stream (bad frame header); the "
                "connection was closed");
  }
  if (h.length > max_bytes) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat("recv: incoming message of ", h.length, " bytes exceeds the limit of ",
                             max_bytes,
                             " bytes; the connection was closed. Raise the limit "
                             "with set_max_message_bytes() on both ends"));
  }
  return h;
}

void CheckFrameDescriptors(const FrameHeader& h, size_t received) {
  if (received != h.nfds) {
    throw Error(ErrorCode::kInvalidArgument, absl::StrCat("recv: message announced ", h.nfds,
                                                          " descriptors but carried ", received));
  }
}

}  // namespace forksafe::mp::internal
