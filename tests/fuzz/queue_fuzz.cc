// tests/fuzz/queue_fuzz.cc: what a Queue reader takes from other processes (mp/queue.cc,
// mp/internal/queue_record.h): the records of the shared ring, the tags of descriptor batches on
// the side socket, and a spilled item's memfd.
// Input: [ring size selector u8][unused u8][head u64][tail u64][batch tag u64][wanted tag u64]
//        [spilled file size u32][ring bytes...]. The ring (64 B << 0..6) is filled from the ring
// bytes; records are read from tail towards head as Queue::get does (at most 64). The ring bytes
// are also written to a memfd of the given size (sparse past them) and read as a spilled item
// with a 64 KiB limit.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/queue_record.h"
#include "tests/fuzz/fuzz_target.h"

namespace forksafe::fuzz {
namespace {

using runtime::Error;
using runtime::ErrorCode;
namespace in = mp::internal;

constexpr size_t kFixed = 2 + 8 * 4 + 4;
constexpr size_t kSpillLimit = 64 * 1024;

uint64_t U64(std::string_view s, size_t at) {
  uint64_t v;
  std::memcpy(&v, s.data() + at, sizeof(v));
  return v;
}

void CheckCode(const Error& e) {
  if (e.code() != ErrorCode::kInvalidArgument && e.code() != ErrorCode::kResourceExhausted) {
    __builtin_trap();  // a peer's bytes must not cause any other kind of error
  }
}

std::string Run(std::string_view input) {
  if (input.size() < kFixed) return "short";
  const uint64_t cap = uint64_t{64} << (static_cast<uint8_t>(input[0]) % 7);
  uint64_t head = U64(input, 2), tail = U64(input, 10);
  const uint64_t got = U64(input, 18), want = U64(input, 26);
  uint32_t spill_size;
  std::memcpy(&spill_size, input.data() + 34, sizeof(spill_size));
  const std::string_view bytes = input.substr(kFixed);
  std::vector<char> ring(cap, '\0');
  std::memcpy(ring.data(), bytes.data(), std::min<size_t>(bytes.size(), cap));

  std::ostringstream out;
  try {
    for (int i = 0; i < 64 && tail != head; ++i) {
      const in::QueueRecord r =
          in::ParseQueueRecord(ring.data(), cap, head, tail, mp::Connection::kMaxDescriptors);
      const std::string payload = in::ReadQueuePayload(ring.data(), cap, tail, r);
      if (payload.size() != r.length || r.span > head - tail) __builtin_trap();
      out << "rec(" << r.length << "," << r.nfds << (r.spilled ? ",spilled" : "") << "," << r.seq
          << ") ";
      tail += r.span;
    }
    out << "end";
  } catch (const Error& e) {
    CheckCode(e);
    out << ErrorText(e);
  }
  out << "; batch ";
  try {
    out << (in::ClassifyBatch(got, want) == in::BatchAction::kTake ? "take" : "discard");
  } catch (const Error& e) {
    CheckCode(e);
    out << ErrorText(e);
  }
  out << "; spill ";
  const int fd = memfd_create("forksafe-fuzz", MFD_CLOEXEC);
  if (fd < 0) return out.str() + "no memfd";
  mp::FileDescriptor file(fd);
  if (!bytes.empty() &&
      write(fd, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) {
    return out.str() + "write failed";
  }
  if (ftruncate(fd, spill_size) != 0) return out.str() + "ftruncate failed";
  try {
    const std::string item = in::ReadSpilledPayload(fd, kSpillLimit);
    if (item.size() != spill_size) __builtin_trap();
    out << item.size();
  } catch (const Error& e) {
    CheckCode(e);
    out << ErrorText(e);
  }
  return out.str();
}

// An input whose ring holds the records `records` (payload, nfds, spilled, seq), put from 0.
struct Rec {
  std::string payload;
  uint32_t nfds;
  bool spilled;
  uint64_t seq;
};
std::string Input(uint8_t cap_sel, const std::vector<Rec>& records, uint64_t got, uint64_t want,
                  uint32_t spill_size) {
  const uint64_t cap = uint64_t{64} << cap_sel;
  std::vector<char> ring(cap, '\0');
  uint64_t head = 0;
  for (const Rec& r : records) {
    in::RecordHeader h{static_cast<uint32_t>(r.payload.size()),
                       r.nfds | (r.spilled ? in::kSpilled : 0u), r.seq};
    in::WriteRing(ring.data(), cap, head, &h, sizeof(h));
    in::WriteRing(ring.data(), cap, head + sizeof(h), r.payload.data(), r.payload.size());
    head += in::RecordSpan(r.payload.size());
  }
  std::string s(kFixed, '\0');
  s[0] = static_cast<char>(cap_sel);
  const uint64_t tail = 0;
  std::memcpy(&s[2], &head, 8);
  std::memcpy(&s[10], &tail, 8);
  std::memcpy(&s[18], &got, 8);
  std::memcpy(&s[26], &want, 8);
  std::memcpy(&s[34], &spill_size, 4);
  return s + std::string(ring.data(), ring.size());
}

}  // namespace

std::string Describe(std::string_view input) { return Run(input); }

std::vector<Seed> Seeds() {
  const std::string item = mp::Encode(std::string("item"), 1).bytes;
  return {
      {"one_record", Input(2, {{item, 0, false, 0}}, 1, 1, 0),
       "rec(16,0,0) end; batch take; spill 0"},
      {"three_records",
       Input(3, {{"a", 0, false, 0}, {"bc", 2, false, 1}, {"", 1, true, 2}}, 1, 2, 10),
       "rec(1,0,0) rec(2,2,1) rec(0,1,spilled,2) end; batch discard; spill 10"},
      {"empty_ring", Input(0, {}, 5, 5, 3), "end; batch take; spill 3"},
      {"newer_batch", Input(1, {{"xyz", 0, false, 0}}, 9, 4, 70000),
       "rec(3,0,0) end; batch error: invalid_argument; spill error: resource_exhausted"},
  };
}

}  // namespace forksafe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)forksafe::fuzz::Run(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
