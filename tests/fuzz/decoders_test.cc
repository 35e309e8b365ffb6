// tests/fuzz/decoders_test.cc: the checks the fuzz targets rely on, one by one: each input a peer
// could send that once crashed a decoder, allocated without bound or was trusted.
#include <cerrno>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/framing.h"
#include "forksafe/mp/internal/queue_record.h"
#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"

namespace forksafe::mp {
namespace {

using runtime::Error;
using runtime::ErrorCode;

template <class T>
std::string Raw(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
}

template <class Fn>
ErrorCode CodeOf(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "no error";
  return ErrorCode::kInternal;
}

TEST(Codec, ForgedLengthIsRefusedBeforeAllocating) {
  // A vector of 2^28 int64 (2 GiB) announced in 8 bytes.
  Message m;
  m.bytes = Raw(uint64_t{1} << 28);
  EXPECT_EQ(CodeOf([&] { DecodeAs<std::vector<int64_t>>(m); }), ErrorCode::kInvalidArgument);
  m.bytes = Raw(uint64_t{3} << 30) + "abc";
  EXPECT_EQ(CodeOf([&] { DecodeAs<std::string>(m); }), ErrorCode::kInvalidArgument);
  m.bytes = Raw(~uint64_t{0});
  EXPECT_EQ(CodeOf([&] { DecodeAs<std::vector<std::string>>(m); }), ErrorCode::kInvalidArgument);
}

TEST(Codec, LengthsThatFitStillDecode) {
  Message m = Encode(std::vector<std::string>{"a", "", "bc"}, std::vector<uint8_t>(1000, 7));
  std::vector<std::string> a;
  std::vector<uint8_t> b;
  Decode(m, a, b);
  EXPECT_EQ(a, (std::vector<std::string>{"a", "", "bc"}));
  EXPECT_EQ(b, std::vector<uint8_t>(1000, 7));
}

TEST(Codec, BoolMustBeZeroOrOne) {
  Message m;
  m.bytes = std::string(1, '\x02');
  EXPECT_EQ(CodeOf([&] { DecodeAs<bool>(m); }), ErrorCode::kInvalidArgument);
  m.bytes = std::string(1, '\x01');
  EXPECT_TRUE(DecodeAs<bool>(m));
}

TEST(Framing, HeaderChecks) {
  internal::FrameHeader ok{internal::kFrameMagic, 2, 100};
  EXPECT_EQ(internal::ParseFrameHeader(Raw(ok), 100, 253).length, 100u);
  internal::FrameHeader bad_magic{0x12345678, 0, 1};
  EXPECT_EQ(CodeOf([&] { internal::ParseFrameHeader(Raw(bad_magic), 100, 253); }),
            ErrorCode::kInvalidArgument);
  internal::FrameHeader many_fds{internal::kFrameMagic, 254, 1};
  EXPECT_EQ(CodeOf([&] { internal::ParseFrameHeader(Raw(many_fds), 100, 253); }),
            ErrorCode::kInvalidArgument);
  internal::FrameHeader too_long{internal::kFrameMagic, 0, ~uint64_t{0}};
  EXPECT_EQ(CodeOf([&] { internal::ParseFrameHeader(Raw(too_long), 100, 253); }),
            ErrorCode::kResourceExhausted);
  EXPECT_EQ(CodeOf([&] { internal::ParseFrameHeader("short", 100, 253); }),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { internal::CheckFrameDescriptors(ok, 1); }), ErrorCode::kInvalidArgument);
}

TEST(QueueRecord, RecordsMustLieInCommittedBytes) {
  std::vector<char> ring(256, '\0');
  internal::RecordHeader h{200, 0, 0};  // says 200 bytes, only 32 committed
  std::memcpy(ring.data(), &h, sizeof(h));
  EXPECT_EQ(CodeOf([&] { internal::ParseQueueRecord(ring.data(), 256, 32, 0, 253); }),
            ErrorCode::kInvalidArgument);
  // head behind tail, a ring size of 0, a spilled record without its memfd.
  EXPECT_EQ(CodeOf([&] { internal::ParseQueueRecord(ring.data(), 256, 0, 16, 253); }),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { internal::ParseQueueRecord(ring.data(), 0, 16, 0, 253); }),
            ErrorCode::kInvalidArgument);
  internal::RecordHeader spilled{0, internal::kSpilled, 1};
  std::memcpy(ring.data(), &spilled, sizeof(spilled));
  EXPECT_EQ(CodeOf([&] { internal::ParseQueueRecord(ring.data(), 256, 16, 0, 253); }),
            ErrorCode::kInvalidArgument);
  internal::RecordHeader good{5, 1, 3};
  std::memcpy(ring.data(), &good, sizeof(good));
  const internal::QueueRecord r = internal::ParseQueueRecord(ring.data(), 256, 24, 0, 253);
  EXPECT_EQ(r.length, 5u);
  EXPECT_EQ(r.span, 24u);
  EXPECT_EQ(internal::ClassifyBatch(3, 3), internal::BatchAction::kTake);
  EXPECT_EQ(internal::ClassifyBatch(2, 3), internal::BatchAction::kDiscard);
  EXPECT_EQ(CodeOf([&] { internal::ClassifyBatch(4, 3); }), ErrorCode::kInvalidArgument);
}

TEST(SharedArena, BlockPlacement) {
  internal::CheckBlockPlacement(4160, 64, 8192);
  EXPECT_EQ(CodeOf([&] { internal::CheckBlockPlacement(4161, 1, 8192); }),  // misaligned
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { internal::CheckBlockPlacement(64, 1, 8192); }),  // in the header
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { internal::CheckBlockPlacement(4160, ~uint64_t{0}, 8192); }),
            ErrorCode::kInvalidArgument);
  internal::SharedBlock::Handle h;
  h.kind = internal::SegmentKind::kNamed;
  h.name = std::string("/forksafe_1\0x", 13);
  EXPECT_EQ(CodeOf([&] { internal::CheckHandle(h); }), ErrorCode::kInvalidArgument);
  Message m;
  m.bytes = std::string(1, '\x05');  // kind 5
  EXPECT_EQ(CodeOf([&] { DecodeAs<internal::SharedBlock::Handle>(m); }),
            ErrorCode::kInvalidArgument);
}

TEST(ChildMessages, ForkServerReplyIsAPidOrAnErrno) {
  Message m = Encode(int32_t{77});
  EXPECT_EQ(internal::DecodeForkServerReply(m), 77);
  m = Encode(int32_t{-1});  // the server's "malformed request"
  EXPECT_EQ(CodeOf([&] { internal::DecodeForkServerReply(m); }), ErrorCode::kInternal);
  m = Encode(int32_t{-EAGAIN});  // its fork() hit a process limit: says which
  EXPECT_EQ(CodeOf([&] { internal::DecodeForkServerReply(m); }), ErrorCode::kResourceExhausted);
  m = Encode(int32_t{-EMFILE});  // no room for the request's descriptors: names the limit
  try {
    internal::DecodeForkServerReply(m);
    ADD_FAILURE() << "-EMFILE was taken for a pid";
  } catch (const runtime::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kResourceExhausted);
    EXPECT_NE(e.message().find("RLIMIT_NOFILE"), std::string::npos) << e.what();
    EXPECT_NE(e.message().find("request's descriptors"), std::string::npos) << e.what();
  }
  m = Encode(int32_t{-EPERM});  // any other errno stays a system error
  EXPECT_EQ(CodeOf([&] { internal::DecodeForkServerReply(m); }), ErrorCode::kInternal);
  m = Encode(int32_t{INT_MIN});  // -pid would overflow
  EXPECT_EQ(CodeOf([&] { internal::DecodeForkServerReply(m); }), ErrorCode::kInvalidArgument);
}

TEST(ChildMessages, RunRequestNeedsItsDescriptors) {
  Message m = Encode(std::string("run"), std::string("E"), std::string("n"), std::string(),
                     FileDescriptor(), FileDescriptor());
  EXPECT_EQ(CodeOf([&] { internal::DecodeRunRequest(std::move(m)); }), ErrorCode::kInvalidArgument);
}

TEST(ChildMessages, TrackRequestNamesStayInsideForksafe) {
  Message m = Encode(std::string("track"), std::string("forksafe_1_a"));
  EXPECT_EQ(internal::DecodeTrackRequest(m), std::optional<std::string>("forksafe_1_a"));
  m = Encode(std::string("track"), std::string("forksafe_1\0other", 16));
  EXPECT_EQ(internal::DecodeTrackRequest(m), std::nullopt);
  m = Encode(std::string("track"), std::string("forksafe_/x"));
  EXPECT_EQ(internal::DecodeTrackRequest(m), std::nullopt);
}

}  // namespace
}  // namespace forksafe::mp
