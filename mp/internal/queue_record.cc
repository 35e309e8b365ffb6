#include "forksafe/mp/internal/queue_record.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {

using runtime::Error;
using runtime::ErrorCode;

namespace {

[[noreturn]] void Corrupted(const std::string& why) {
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("Queue::get: the queue's shared memory is corrupted (", why,
                           "); a process wrote into the queue's segment outside Queue::put. "
                           "Recreate the queue"));
}

}  // namespace

void WriteRing(char* ring, uint64_t cap, uint64_t pos, const void* src, size_t n) {
  const size_t off = pos % cap;
  const size_t first = std::min<size_t>(n, cap - off);
  std::memcpy(ring + off, src, first);
  if (first < n) std::memcpy(ring, static_cast<const char*>(src) + first, n - first);
}

void ReadRing(const char* ring, uint64_t cap, uint64_t pos, void* dst, size_t n) {
  const size_t off = pos % cap;
  const size_t first = std::min<size_t>(n, cap - off);
  std::memcpy(dst, ring + off, first);
  if (first < n) std::memcpy(static_cast<char*>(dst) + first, ring, n - first);
}

QueueRecord ParseQueueRecord(const char* ring, uint64_t cap, uint64_t head, uint64_t tail,
                             size_t max_fds) {
  if (cap < sizeof(RecordHeader) || cap % 8 != 0)
    Corrupted(absl::StrCat("ring of ", cap, " bytes"));
  const uint64_t used = head - tail;  // both only grow; unsigned difference
  if (used > cap || used < sizeof(RecordHeader)) {
    Corrupted(absl::StrCat("head ", head, ", tail ", tail, " of a ", cap, "-byte ring"));
  }
  if (tail % 8 != 0)
    Corrupted(absl::StrCat("a record starts at byte ", tail, ", not a multiple of 8"));
  RecordHeader h;
  ReadRing(ring, cap, tail, &h, sizeof(h));
  QueueRecord r;
  r.length = h.length;
  r.spilled = (h.nfds & kSpilled) != 0;
  r.nfds = h.nfds & ~kSpilled;
  r.seq = h.seq;
  if (r.nfds > max_fds) Corrupted(absl::StrCat("a record announces ", r.nfds, " descriptors"));
  r.span = RecordSpan(r.length);
  if (r.span > used) {
    Corrupted(absl::StrCat("a record of ", r.length, " bytes but ", used, " bytes committed"));
  }
  if (r.spilled && (r.length != 0 || r.nfds == 0)) {
    Corrupted("an out-of-band record without its memfd, or with bytes in the ring");
  }
  return r;
}

std::string ReadQueuePayload(const char* ring, uint64_t cap, uint64_t tail,
                             const QueueRecord& rec) {
  std::string out(rec.length, '\0');
  ReadRing(ring, cap, tail + sizeof(RecordHeader), out.data(), rec.length);
  return out;
}

BatchAction ClassifyBatch(uint64_t got, uint64_t want) {
  if (got == want) return BatchAction::kTake;
  if (got < want) return BatchAction::kDiscard;
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("Queue::get: the descriptors of message ", want,
                           " are missing from the queue's side channel (the next batch is for "
                           "message ",
                           got, "); the queue is corrupted. Recreate it"));
}

std::string ReadSpilledPayload(int fd, size_t max_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) runtime::ThrowSystemError("reading a large queue item", errno);
  if (!S_ISREG(st.st_mode)) {
    throw Error(ErrorCode::kInvalidArgument,
                "Queue::get: an out-of-band item is not a memory file; the queue is corrupted");
  }
  if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) > max_bytes) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat("Queue::get: an out-of-band item of ", st.st_size,
                             " bytes exceeds the limit of ", max_bytes, " bytes"));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t off = 0;
  while (off < out.size()) {
    const ssize_t n = pread(fd, out.data() + off, out.size() - off, static_cast<off_t>(off));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) runtime::ThrowSystemError("reading a large queue item", errno);
    if (n == 0) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "Queue::get: an out-of-band item shrank while being read; the queue is corrupted");
    }
    off += static_cast<size_t>(n);
  }
  return out;
}

}  // namespace forksafe::mp::internal
