// mp/internal/framing.h: NOT FOR USERS. The frame header of Connection's message stream, as a
// pure decoder (bytes in, header or runtime::Error out), shared by mp/connection.cc and the fuzz
// target tests/fuzz/frame_fuzz.cc.
//
// A frame on the stream: FrameHeader (16 bytes, host byte order), then `length` payload bytes;
// the message's `nfds` descriptors arrive (SCM_RIGHTS) with the header or payload bytes.
#ifndef FORKSAFE_MP_INTERNAL_FRAMING_H_
#define FORKSAFE_MP_INTERNAL_FRAMING_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace forksafe::mp::internal {

inline constexpr uint32_t kFrameMagic = 0x464D5350;  // "FSMP"

struct FrameHeader {
  uint32_t magic;
  uint32_t nfds;
  uint64_t length;
};
static_assert(sizeof(FrameHeader) == 16, "the frame header is 16 bytes on the wire");

/// Checks the header in `bytes` (exactly sizeof(FrameHeader) bytes) from the peer against this
/// end's limits. Throws Error(kInvalidArgument) for a wrong size, a bad magic or more than
/// `max_fds` descriptors, Error(kResourceExhausted) for a payload over `max_bytes`. Never trusts
/// a field before checking it.
FrameHeader ParseFrameHeader(std::string_view bytes, size_t max_bytes, size_t max_fds);

/// Checks that a frame brought the descriptors its header announced; Error(kInvalidArgument)
/// otherwise.
void CheckFrameDescriptors(const FrameHeader& h, size_t received);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_FRAMING_H_
