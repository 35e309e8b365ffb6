// mp/internal/queue_record.h: NOT FOR USERS. The pure decoders of what a Queue reads from other
// processes (mp/queue.cc), shared with the fuzz target tests/fuzz/queue_fuzz.cc:
//   - a record in the shared ring: RecordHeader (16 bytes) then `length` payload bytes, padded
//     to 8; the producer wrote it and any process mapping the segment could have scribbled on it;
//   - the sequence tag of a descriptor batch on the side socket;
//   - a spilled (out-of-band) payload: a memfd the producer sent.
// None of them trusts a length, count or descriptor from the peer: bad input is
// Error(kInvalidArgument) (kResourceExhausted for a spilled item over the limit).
#ifndef FORKSAFE_MP_INTERNAL_QUEUE_RECORD_H_
#define FORKSAFE_MP_INTERNAL_QUEUE_RECORD_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace forksafe::mp::internal {

inline constexpr uint32_t kSpilled = 1u << 31;  // record flag: payload is out of band

struct RecordHeader {
  uint32_t length;  // payload bytes in the ring (0 when spilled)
  uint32_t nfds;    // descriptors on the side socket (kSpilled set: +1 memfd holding the payload)
  uint64_t seq;     // sequence number of its descriptors (when nfds > 0)
};
static_assert(sizeof(RecordHeader) == 16, "a record header is 16 bytes in the ring");

/// A record as read from the ring, checked.
struct QueueRecord {
  uint32_t length = 0;  // payload bytes in the ring
  uint32_t nfds = 0;    // descriptors on the side socket, the spill memfd included
  bool spilled = false;
  uint64_t seq = 0;
  uint64_t span = 0;  // ring bytes the record takes (header + payload, rounded up to 8)
};

/// Bytes a record with `payload` bytes takes in the ring.
inline uint64_t RecordSpan(uint64_t payload) {
  return (sizeof(RecordHeader) + payload + 7) & ~uint64_t{7};
}

/// Reads the record at byte `tail` of a ring of `cap` bytes whose producers have committed up to
/// `head`, and checks it: it must lie within the committed bytes, announce at most `max_fds`
/// descriptors, and a spilled record must have no payload in the ring and carry its memfd.
/// Error(kInvalidArgument) ("the queue's shared memory is corrupted") otherwise.
QueueRecord ParseQueueRecord(const char* ring, uint64_t cap, uint64_t head, uint64_t tail,
                             size_t max_fds);

/// Copies the payload of `rec` (at `tail`) out of the ring.
std::string ReadQueuePayload(const char* ring, uint64_t cap, uint64_t tail, const QueueRecord& rec);

/// What to do with a descriptor batch tagged `got` when the record wants batch `want`.
enum class BatchAction {
  kTake,     ///< It is the record's batch.
  kDiscard,  ///< An older batch whose record was never committed (its producer died): close it.
};
/// Throws Error(kInvalidArgument) when `got` is newer than `want`: the record's own batch is lost.
BatchAction ClassifyBatch(uint64_t got, uint64_t want);

/// Reads a spilled payload from the memfd `fd` sent by the producer: it must be a regular file
/// of at most `max_bytes` bytes (Error(kInvalidArgument) / Error(kResourceExhausted) otherwise).
std::string ReadSpilledPayload(int fd, size_t max_bytes);

void WriteRing(char* ring, uint64_t cap, uint64_t pos, const void* src, size_t n);
void ReadRing(const char* ring, uint64_t cap, uint64_t pos, void* dst, size_t n);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_QUEUE_RECORD_H_
