#include "forksafe/mp/queue.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/internal/queue_record.h"
#include "forksafe/mp/internal/queue_spin.h"
#include "forksafe/mp/internal/scm_rights.h"
#include "forksafe/mp/internal/shared_segment.h"
#include "forksafe/mp/internal/shm_sync.h"
#include "forksafe/runtime/internal/memory_bounds.h"

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;

namespace internal {

// Descriptor batches (the side socket). Each batch is one sendmsg: an 8-byte sequence tag with
// the descriptors attached. The kernel charges every batch in flight to the socket's buffer
// (about 768 bytes each, so a default buffer held ~278), whatever its size: a batch per message
// stalled puts long before the ring or the descriptor limit was reached. So a message whose
// descriptors are the same open files as the newest batch's (same file and access mode, as the
// codec tells descriptors apart; consecutive tensors from one arena
// segment: the common case) shares that batch instead of sending one: readers peek at it
// (MSG_PEEK installs the descriptors without consuming them) and the last of its messages to be
// got consumes it. Only descriptors that a message borrows from their owner (forksafe's shared
// segments) and that are regular files are shared; anything else (a Connection, a spilled item)
// gets a batch of its own. At most kMaxBatches batches are in flight, and the socket's buffer is
// raised to hold them where the system allows; a put beyond either limit waits for readers and,
// past its timeout, says why (Full).
constexpr int kBatchKeys = 4;      // a batch shared by later messages has at most this many fds
constexpr int kMaxBatches = 4096;  // batches in flight at once
constexpr int kKeyWords = 3;       // a descriptor's key: (dev, inode, access mode)

// The shared header at the start of a queue's segment; the ring follows it.
struct QueueShared {
  RobustMutex mu;
  uint32_t get_sleepers;  // getters asleep on the bell (an upper bound: a dead one inflates it)
  SharedCond not_full;
  SharedCond all_done;
  uint64_t ring_bytes;
  uint64_t head;       // bytes ever written (committed)
  uint64_t tail;       // bytes ever read
  int64_t count;       // messages in the ring; written atomically under the lock (a getter's
                       // spin reads it without the lock)
  int64_t maxsize;     // <= 0: unbounded
  int64_t unfinished;  // JoinableQueue
  uint64_t next_seq;   // sequence number of the next descriptor batch
  uint64_t taken_seq;  // highest sequence whose descriptors a reader has taken off the socket
  uint64_t magic;
  // Descriptor batches shared by consecutive messages (see "Descriptor batches" below).
  uint64_t last_batch;       // sequence of the newest batch sent
  uint32_t last_batch_keys;  // how many (dev, inode, access mode) keys it has; 0: not shareable
  uint32_t max_item_bytes;   // QueueOptions::max_item_bytes (read clamped: see ItemLimit)
  uint64_t last_keys[kKeyWords * kBatchKeys];
  uint32_t batch_users[kMaxBatches];  // by sequence % kMaxBatches: committed messages not yet got
  uint64_t released;  // the tail when ring pages were last given back (ReleaseConsumedPages)
};

constexpr uint64_t kQueueMagic = 0x6673717565756535ull;  // "fsqueue5"

// Giving back a large ring's pages. A ring's pages are memory once touched, and the putter
// touches every page of the ring as it goes round, so a ring of 64 MiB that has carried 64 MiB
// would hold 64 MiB however little it holds now. A ring of kReleaseFrom bytes or more gives the
// pages that its got messages alone occupied back to the system (a hole in the segment's file,
// MADV_REMOVE) each time kReleaseEvery more bytes were got: such a ring costs about the memory of
// what it holds plus kReleaseEvery, and a put into a given-back page takes a zero page (one page
// fault per 4 KiB of traffic). Smaller rings (QueueOptions' 1 MiB default) keep their pages.
constexpr uint64_t kReleaseFrom = uint64_t{8} << 20;
constexpr uint64_t kReleaseEvery = uint64_t{1} << 20;

}  // namespace internal

struct Queue::State {
  internal::SharedSegment seg;
  FileDescriptor fd_w;    // side socket: descriptors in
  FileDescriptor fd_r;    // side socket: descriptors out
  FileDescriptor bell_r;  // doorbell pipe, read end: an empty queue's getters sleep on it
  FileDescriptor bell_w;  // doorbell pipe, write end: a put rings it when getters sleep
  // The ring's size, from this process's own mapping: never re-read from shared memory, which
  // another process could overwrite.
  uint64_t cap = 0;
  uint64_t carrier = 0;  // the queue's identity: its segment's inode (mp/internal/shm_manager.h)
  // close() in this process; read by every operation without a lock (nothing else goes with it,
  // so an atomic, not a mutex).
  std::atomic<bool> closed{false};
  // How long this process's getters spin before they sleep (mp/internal/queue_spin.h).
  internal::GetterSpin spin;

  internal::QueueShared* hdr() const { return static_cast<internal::QueueShared*>(seg.data()); }
  char* ring() const { return static_cast<char*>(seg.data()) + sizeof(internal::QueueShared); }
};

namespace {

// The queue's identity as a carrier of in-flight references: its segment's inode, which every
// process holding the queue maps or has a descriptor of (mp/internal/shm_manager.h, ScanProc).
uint64_t CarrierOf(int seg_fd) {
  struct stat st;
  return fstat(seg_fd, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Gives back the pages of [begin, end) that lie wholly inside it (their bytes are free).
void ReleasePages(char* begin, char* end) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + page - 1) & ~(page - 1);
  const uintptr_t last = reinterpret_cast<uintptr_t>(end) & ~(page - 1);
  // A failure leaves the pages as they were: memory, never a change to what the ring holds.
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_REMOVE);
}

// Under the queue's lock, after a get moved the tail: gives back the pages that the bytes got
// since the last release occupied (internal::kReleaseFrom above). Bytes got are free unless the
// putter has gone round the ring into them again (head > their position + cap): those are left.
// Edge pages shared with bytes outside the range stay until a later release covers them whole.
void ReleaseConsumedPages(internal::QueueShared* h, char* ring, uint64_t cap) {
  if (cap < internal::kReleaseFrom) return;
  const uint64_t tail = h->tail;
  uint64_t from = h->released;
  if (from > tail || tail - from > cap) from = tail > cap ? tail - cap : 0;  // unset or corrupt
  if (tail - from < internal::kReleaseEvery) return;
  h->released = tail;
  if (h->head > cap) from = std::max(from, h->head - cap);
  if (from >= tail) return;
  const uint64_t a = from % cap;
  const uint64_t b = tail % cap;
  if (a < b) {
    ReleasePages(ring + a, ring + b);
  } else {  // the range wraps (or is the whole ring)
    ReleasePages(ring + a, ring + cap);
    ReleasePages(ring, ring + b);
  }
}

// The bounds of QueueOptions::ring_bytes (mp/queue.h).
constexpr size_t kMinRingBytes = 4096;
constexpr size_t kMaxRingBytes = size_t{4} << 30;

// Sends `fds` tagged with `seq` on the side socket without blocking. Returns false on EAGAIN.
bool SendFds(int sock, uint64_t seq, const std::vector<int>& fds) {
  iovec iov{&seq, sizeof(seq)};
  std::vector<char> cbuf;
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  internal::AttachDescriptors(mh, cbuf, fds);
  for (;;) {
    const ssize_t n = sendmsg(sock, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == sizeof(seq)) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETOOMANYREFS)) {
      return false;  // ETOOMANYREFS: more descriptors in flight than RLIMIT_NOFILE allows
    }
    runtime::ThrowSystemError("queue: sending descriptors", n < 0 ? errno : EIO);
  }
}

// Receives the descriptor batch tagged `seq`, discarding older batches (left by a producer that
// died between sending descriptors and committing its message). With `peek`, the batch stays on
// the socket for the other messages that share it (its descriptors are installed all the same).
std::vector<FileDescriptor> RecvFds(int sock, uint64_t seq, bool peek) {
  for (;;) {
    uint64_t got = 0;
    iovec iov{&got, sizeof(got)};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * Connection::kMaxDescriptors)];
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof(cbuf);
    // The batch was sent before its message was committed, so it is normally there already:
    // try without waiting first, and wait (bounded) only if it is not.
    ssize_t n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT | (peek ? MSG_PEEK : 0));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{sock, POLLIN, 0};
      if (::poll(&p, 1, 10000) == 0) {
        throw Error(ErrorCode::kInternal,
                    "queue: a message's descriptors did not arrive on the side channel");
      }
      continue;
    }
    if (n > 0 && n < static_cast<ssize_t>(sizeof(got)) && !peek) {
      // The tag arrived in pieces (never seen with 8 bytes, but stream sockets allow it).
      if (recv(sock, reinterpret_cast<char*>(&got) + n, sizeof(got) - n, MSG_WAITALL) !=
          static_cast<ssize_t>(sizeof(got) - n)) {
        n = -1;
      } else {
        n = sizeof(got);
      }
    }
    if (n != sizeof(got)) {
      throw Error(ErrorCode::kInternal, "queue: the descriptor channel broke");
    }
    std::vector<FileDescriptor> fds;
    internal::CollectDescriptors(mh, &fds);
    if (internal::ClassifyBatch(got, seq) == internal::BatchAction::kTake) return fds;
    // An orphaned batch (got < seq): close it and read on (consuming it, if it was a peek).
    if (peek) {
      fds.clear();
      RecvFds(sock, got, false);
    }
  }
}

// The identities of a message's descriptors for sharing a batch (see "Descriptor batches"):
// (dev, inode, access mode) of each, as the codec tells descriptors apart (mp/codec.cc,
// AddDescriptor: a read-only and a read-write descriptor of one file are different
// descriptors), or an empty list when the message cannot share one.
std::vector<uint64_t> BatchKeys(const std::vector<FileDescriptor>& fds) {
  std::vector<uint64_t> keys;
  if (fds.empty() || fds.size() > static_cast<size_t>(internal::kBatchKeys)) return keys;
  for (const FileDescriptor& f : fds) {
    struct stat st;
    if (f.owned() || fstat(f.get(), &st) != 0 || !S_ISREG(st.st_mode)) return {};
    const int fl = fcntl(f.get(), F_GETFL);
    if (fl < 0) return {};
    keys.push_back(static_cast<uint64_t>(st.st_dev));
    keys.push_back(static_cast<uint64_t>(st.st_ino));
    keys.push_back(static_cast<uint64_t>(fl & O_ACCMODE));
  }
  return keys;
}

bool SameBatch(const internal::QueueShared* h, const std::vector<uint64_t>& keys) {
  return !keys.empty() && h->last_batch_keys * internal::kKeyWords == keys.size() &&
         std::equal(keys.begin(), keys.end(), h->last_keys);
}

std::string DescriptorsStuck(uint64_t in_flight) {
  return absl::StrCat(
      "too many messages with descriptors in flight: ", in_flight,
      " descriptor batches wait on the queue's side socket (its limit is ", internal::kMaxBatches,
      " batches, the socket's buffer (net.core.wmem_max) and, for processes without "
      "CAP_SYS_RESOURCE, RLIMIT_NOFILE descriptors in flight). get() messages to make room; "
      "consecutive tensors from one shared segment share one batch, so put tensors carved from "
      "the arena (the cache on) rather than tensors with segments of their own");
}

// Why a put found no room: the limit hit (maxsize, or the ring's bytes), and what to do.
std::string FullBecause(bool room_by_count, int64_t count, int64_t maxsize, uint64_t cap,
                        uint64_t used, size_t need) {
  if (!room_by_count) {
    return absl::StrCat("the queue holds maxsize = ", maxsize, " messages (", count,
                        " queued); get() some, or make the queue with a larger maxsize");
  }
  return absl::StrCat("the ring is full by bytes: ", used, " of its ", cap,
                      " bytes are taken and this message needs ", need,
                      "; get() some, or make the queue with a larger QueueOptions::ring_bytes");
}

FileDescriptor SpillToMemfd(const std::string& bytes) {
  const int fd = internal::PrivateMemfd("forksafe:queue-item");
  if (fd < 0) runtime::ThrowSystemError("memfd_create for a large queue item", errno);
  FileDescriptor f(fd);
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = pwrite(fd, bytes.data() + off, bytes.size() - off, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOSPC || errno == ENOMEM) {
        throw Error(ErrorCode::kResourceExhausted,
                    absl::StrCat("queue: no memory for a ", bytes.size(), "-byte item"));
      }
      runtime::ThrowSystemError("writing a large queue item", errno);
    }
    off += static_cast<size_t>(n);
  }
  return f;
}

// The doorbell. A getter that finds the queue empty sleeps in poll() on a pipe rather than on a
// futex: a pipe write wakes its reader with the kernel's "synchronous wake-up" hint, so the
// scheduler may run the woken getter on the putter's CPU, which is about to sleep anyway. A futex
// wake carries no such hint; across two vCPUs the getter was woken on an idle vCPU, and a queue
// round trip cost 1.3-3x a bare socket ping-pong instead of ~1x (docs/performance.md).
//
// Protocol: a getter counts itself in `get_sleepers` under the lock, unlocks and polls; a putter
// rings (writes a byte) after committing and unlocking when it sees a sleeper. The pipe keeps the
// byte, so a ring between the getter's unlock and its poll is not lost. A woken getter drains
// every byte; if messages remain and other getters sleep, the getter that took one rings again
// (passing the baton), so draining never strands a sleeper.
//
// Never throws: it runs after a put committed its message, and a put that throws after its commit
// would give back the references of a message that is still queued. The pipe's both ends are this
// process's, so a write fails only with EAGAIN (the pipe is full of unconsumed rings: sleepers
// wake anyway) or EINTR.
void RingBell(int bell_w) noexcept {
  const char b = 1;
  for (;;) {
    const ssize_t n = ::write(bell_w, &b, 1);
    if (n < 0 && errno == EINTR) continue;
    return;
  }
}

// After the queue's lock was recovered from a process that died holding it: that process may
// have died between a commit of the ring (head or tail moved) and the count that goes with it,
// so the count is taken again from the committed records, and a JoinableQueue's unfinished count
// is never below it. A ring that does not parse is left alone (the next get reports it).
// Requires the lock held.
void RecountAfterOwnerDied(internal::QueueShared* h, const char* ring, uint64_t cap) {
  int64_t n = 0;
  try {
    for (uint64_t at = h->tail; at < h->head; ++n) {
      at += internal::ParseQueueRecord(ring, cap, h->head, at, Connection::kMaxDescriptors).span;
    }
  } catch (const Error&) {
    return;
  }
  __atomic_store_n(&h->count, n, __ATOMIC_RELEASE);
  if (h->unfinished < n) h->unfinished = n;
}

// Takes the queue's lock for good (no deadline), recounting if its holder had died.
void LockQueue(internal::QueueShared* h, const char* ring, uint64_t cap) {
  if (h->mu.Lock() == internal::LockResult::kOwnerDied) RecountAfterOwnerDied(h, ring, cap);
}

// Called and returns with the queue's lock held. Returns after a ring, a signal, the deadline,
// or when an item arrived during the spin.
void SleepOnBell(internal::QueueShared* h, const char* ring, uint64_t cap, int bell_r,
                 internal::Deadline deadline, internal::GetterSpin::Duration spin) {
  // First a spin of `spin`, yielding, without the lock. Across two vCPUs the cost of a round trip
  // was waking a vCPU that had gone idle (tens of microseconds on a VM, whatever the wake-up:
  // futex, pipe or socket); a getter that yields until the item comes keeps its vCPU busy, so the
  // put that follows wakes nothing. On one CPU sched_yield() hands the CPU to the putter at once,
  // so the spin adds no latency there (docs/performance.md has both). How long: the adaptive rule
  // of mp/internal/queue_spin.h (GetterSpin: about twice this process's recent wait for an item,
  // 50 to 400 us; when the items come later than that but regularly, 50 us and a nap that ends
  // just before the next item is expected), so that a getter whose items come later than 50 us
  // (a tensor being made, a Python peer's turn) is awake when they come, and an idle one does not
  // burn CPU.
  h->mu.Unlock();
  auto spin_until = internal::Clock::now() + spin;
  if (deadline.has_value() && *deadline < spin_until) spin_until = *deadline;
  while (__atomic_load_n(&h->count, __ATOMIC_ACQUIRE) == 0 && internal::Clock::now() < spin_until) {
    sched_yield();
  }
  LockQueue(h, ring, cap);
  if (h->count > 0) return;

  timespec ts{};
  timespec* rel = nullptr;
  if (deadline.has_value()) {
    const auto left = *deadline - internal::Clock::now();
    if (left <= internal::Clock::duration::zero()) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    ts.tv_sec = static_cast<time_t>(ns / 1000000000);
    ts.tv_nsec = static_cast<long>(ns % 1000000000);
    rel = &ts;
  }
  __atomic_add_fetch(&h->get_sleepers, 1, __ATOMIC_ACQ_REL);
  h->mu.Unlock();
  pollfd p{bell_r, POLLIN, 0};
  if (::ppoll(&p, 1, rel, nullptr) > 0) {
    char buf[256];
    while (::read(bell_r, buf, sizeof(buf)) == static_cast<ssize_t>(sizeof(buf))) {
    }
  }
  __atomic_sub_fetch(&h->get_sleepers, 1, __ATOMIC_ACQ_REL);
  LockQueue(h, ring, cap);
}

// Holds the queue's shared mutex; a recovered lock (owner died) is fine: see the file comment.
class QueueLock {
 public:
  QueueLock(internal::QueueShared* h, const char* ring, uint64_t cap, internal::Deadline deadline)
      : h_(h) {
    const internal::LockResult r = h_->mu.Lock(deadline);
    held_ = r != internal::LockResult::kTimedOut;
    if (r == internal::LockResult::kOwnerDied) RecountAfterOwnerDied(h, ring, cap);
  }
  ~QueueLock() { Release(); }
  /// Unlocks early (idempotent), so that a wake-up is not sent to a process that would then
  /// block on this very lock.
  void Release() {
    if (held_) h_->mu.Unlock();
    held_ = false;
  }
  bool held() const { return held_; }

 private:
  internal::QueueShared* h_;
  bool held_;
};

}  // namespace

namespace {
// The queue's item limit, as every process applies it: from shared memory, but never above
// kMaxItemBytes whatever another process wrote there (0, from a header of an older layout, is
// the default).
size_t ItemLimit(const internal::QueueShared* h) {
  const size_t v = __atomic_load_n(&h->max_item_bytes, __ATOMIC_RELAXED);
  return v == 0 ? Queue::kMaxItemBytes : std::min(v, Queue::kMaxItemBytes);
}
}  // namespace

Queue::Queue(int64_t maxsize) : Queue(QueueOptions{maxsize, QueueOptions{}.ring_bytes}) {}

Queue::Queue(const QueueOptions& options) : state_(std::make_shared<State>()) {
  // Validation (docs/reliability.md, "Bad input"): the ring's size is bounded before any
  // arithmetic on it, and checked against what the system can give before it is created.
  if (options.ring_bytes < kMinRingBytes || options.ring_bytes > kMaxRingBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("QueueOptions::ring_bytes must be in [", kMinRingBytes, ", ",
                             kMaxRingBytes, "] (4 KiB to 4 GiB), got ", options.ring_bytes,
                             "; items over a quarter of the ring travel out of band anyway"));
  }
  if (options.max_item_bytes < 1 || options.max_item_bytes > kMaxItemBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("QueueOptions::max_item_bytes must be in [1, ", kMaxItemBytes,
                             "] (1 byte to 1 GiB), got ", options.max_item_bytes,
                             "; send larger data through shared memory (a shared tensor)"));
  }
  const size_t ring = runtime::internal::RoundUpOrThrow(options.ring_bytes, 8, "Queue");
  runtime::internal::CheckMemoryAvailable(sizeof(internal::QueueShared) + ring,
                                          runtime::internal::MemoryUse::kShared,
                                          "Queue: a ring of QueueOptions::ring_bytes");
  state_->seg = internal::SharedSegment::Create(sizeof(internal::QueueShared) + ring, "queue");
  internal::QueueShared* h = state_->hdr();
  h->mu.Init();
  h->get_sleepers = 0;
  h->not_full.Init();
  h->all_done.Init();
  h->ring_bytes = ring;
  h->max_item_bytes = static_cast<uint32_t>(options.max_item_bytes);
  state_->cap = ring;
  h->maxsize = options.maxsize;
  h->next_seq = 1;
  h->taken_seq = 0;
  h->last_batch = 0;
  h->last_batch_keys = 0;
  h->released = 0;
  h->magic = internal::kQueueMagic;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    runtime::ThrowSystemError("socketpair for a queue", errno);
  }
  state_->fd_w.reset(sv[0]);
  state_->fd_r.reset(sv[1]);
  // Room for kMaxBatches descriptor batches in flight where the system allows it (beyond
  // net.core.wmem_max only with CAP_NET_ADMIN); a smaller buffer only makes puts wait sooner.
  const int sndbuf = internal::kMaxBatches * 1024;
  if (setsockopt(sv[0], SOL_SOCKET, SO_SNDBUFFORCE, &sndbuf, sizeof(sndbuf)) != 0) {
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
  }
  state_->carrier = CarrierOf(state_->seg.fd());
  int bell[2];
  if (pipe2(bell, O_CLOEXEC | O_NONBLOCK) != 0)
    runtime::ThrowSystemError("pipe2 for a queue", errno);
  state_->bell_r.reset(bell[0]);
  state_->bell_w.reset(bell[1]);
}

Queue::State& Queue::Live(const char* what) const {
  if (!state_ || state_->closed) {
    throw Error(ErrorCode::kClosed, absl::StrCat(what, ": the queue is closed in this process"));
  }
  return *state_;
}

void Queue::PutMessage(Message msg, bool block, Timeout timeout) {
  State& s = Live("Queue::put");
  const internal::Deadline deadline =
      block ? internal::DeadlineAfter(timeout, "Queue::put") : internal::Clock::now();
  internal::QueueShared* h = s.hdr();
  const uint64_t cap = s.cap;
  const size_t limit = ItemLimit(h);
  if (msg.bytes.size() > limit) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Queue::put: an item of ", msg.bytes.size(),
                             " bytes (encoded) exceeds the queue's limit of ", limit,
                             " bytes (QueueOptions::max_item_bytes, at most 1 GiB); nothing was "
                             "put. Send large data through shared memory (a shared tensor)"));
  }
  // Large payloads go out of band.
  bool spilled = false;
  if (msg.bytes.size() > cap / 4) {
    msg.fds.push_back(SpillToMemfd(msg.bytes));
    msg.bytes.clear();
    spilled = true;
  }
  if (msg.fds.size() > Connection::kMaxDescriptors) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Queue::put: a message may carry at most ",
                             Connection::kMaxDescriptors, " descriptors"));
  }
  const size_t need = internal::RecordSpan(msg.bytes.size());
  std::vector<int> fds;
  for (const FileDescriptor& f : msg.fds) fds.push_back(f.get());
  const std::vector<uint64_t> keys = BatchKeys(msg.fds);

  QueueLock lock(h, s.ring(), cap, deadline);
  if (!lock.held()) throw Full("Queue::put: timed out waiting for the queue's lock");
  for (;;) {
    const bool room_by_count = h->maxsize <= 0 || h->count < h->maxsize;
    const bool room_by_bytes = cap - (h->head - h->tail) >= need;
    if (room_by_count && room_by_bytes) {
      internal::RecordHeader rec{
          static_cast<uint32_t>(msg.bytes.size()),
          static_cast<uint32_t>(fds.size()) | (spilled ? internal::kSpilled : 0u), 0};
      if (!fds.empty()) {
        uint32_t& users = h->batch_users[h->last_batch % internal::kMaxBatches];
        if (h->last_batch + 1 == h->next_seq && h->last_batch > h->taken_seq &&
            SameBatch(h, keys)) {
          rec.seq = h->last_batch;  // the newest batch has these very files: share it
          ++users;
        } else {
          const uint64_t in_flight = h->next_seq - 1 - h->taken_seq;
          // The tag is reserved before the batch is sent: a putter that dies between the two
          // leaves a skipped tag (readers pass over it), never a batch under a tag that the next
          // put would send again.
          const uint64_t seq = h->next_seq;
          bool sent = false;
          if (in_flight < static_cast<uint64_t>(internal::kMaxBatches)) {
            h->next_seq = seq + 1;
            sent = SendFds(s.fd_w.get(), seq, fds);
            if (!sent) h->next_seq = seq;  // nothing went out: the tag is free again
          }
          if (!sent) {
            // No room for another batch: let readers drain some, then try again.
            if (deadline.has_value() && internal::Clock::now() >= *deadline) {
              throw Full(absl::StrCat(block ? "Queue::put: timed out: " : "Queue::put_nowait: ",
                                      DescriptorsStuck(in_flight)));
            }
            auto until = internal::Clock::now() + std::chrono::milliseconds(2);
            if (deadline.has_value() && *deadline < until) until = *deadline;
            bool died = false;
            h->not_full.Wait(h->mu, until, &died);
            if (died) RecountAfterOwnerDied(h, s.ring(), cap);
            continue;
          }
          rec.seq = seq;
          h->last_batch = rec.seq;
          h->last_batch_keys = static_cast<uint32_t>(keys.size() / internal::kKeyWords);
          std::copy(keys.begin(), keys.end(), h->last_keys);
          h->batch_users[rec.seq % internal::kMaxBatches] = 1;
        }
      }
      internal::WriteRing(s.ring(), cap, h->head, &rec, sizeof(rec));
      internal::WriteRing(s.ring(), cap, h->head + sizeof(rec), msg.bytes.data(), msg.bytes.size());
      h->head += need;  // commit
      __atomic_add_fetch(&h->count, 1, __ATOMIC_RELEASE);
      ++h->unfinished;
      // The message is in the queue: its in-flight references are the queue's from this point
      // (mp/queue.h). Nothing below throws.
      if (internal::InFlightScope* scope = internal::InFlightScope::Current();
          scope != nullptr && scope->carrier() == s.carrier) {
        scope->Commit();
      }
      const bool ring = __atomic_load_n(&h->get_sleepers, __ATOMIC_ACQUIRE) > 0;
      lock.Release();
      if (ring) RingBell(s.bell_w.get());  // after unlocking: the woken getter locks at once
      return;
    }
    if (need > cap) {
      throw Error(ErrorCode::kInvalidArgument, "Queue::put: message larger than the ring");
    }
    if (deadline.has_value() && internal::Clock::now() >= *deadline) {
      throw Full(absl::StrCat(
          block ? absl::StrCat("Queue::put: still full after ", timeout->count(), " s: ")
                : std::string("Queue::put_nowait: "),
          FullBecause(room_by_count, h->count, h->maxsize, cap, h->head - h->tail, need)));
    }
    bool died = false;
    h->not_full.Wait(h->mu, deadline, &died);
    if (died) RecountAfterOwnerDied(h, s.ring(), cap);
  }
}

Message Queue::GetMessage(bool block, Timeout timeout) {
  State& s = Live("Queue::get");
  const internal::Deadline deadline =
      block ? internal::DeadlineAfter(timeout, "Queue::get") : internal::Clock::now();
  internal::QueueShared* h = s.hdr();
  const uint64_t cap = s.cap;
  QueueLock lock(h, s.ring(), cap, deadline);
  if (!lock.held()) throw Empty("Queue::get: timed out waiting for the queue's lock");
  internal::QueueRecord rec;
  // When this get found the queue empty (blocking gets only): how long it waited feeds the spin
  // rule (mp/internal/queue_spin.h), whether an item came or the timeout passed.
  std::optional<internal::Clock::time_point> waiting_since;
  for (;;) {
    internal::GetterSpin::Wait plan{};
    internal::Deadline nap_until;  // the planned nap's end, until it has passed
    while (h->count == 0) {
      const auto now = internal::Clock::now();
      if (deadline.has_value() && now >= *deadline) {
        if (waiting_since.has_value()) s.spin.Record(now - *waiting_since);
        throw Empty(
            block ? absl::StrCat("Queue::get: nothing arrived within ", timeout->count(), " s")
                  : std::string("Queue::get_nowait: the queue is empty"));
      }
      auto spin = plan.spin;
      if (!waiting_since.has_value()) {
        waiting_since = now;
        plan = s.spin.Next();
        spin = plan.spin;
        if (plan.nap > internal::GetterSpin::Duration::zero()) nap_until = now + plan.nap;
      } else if (nap_until.has_value() && now >= *nap_until) {
        nap_until.reset();  // the nap is over: spin around the moment the item is expected
        spin = internal::GetterSpin::kMax;
      }
      internal::Deadline sleep_until = deadline;
      if (nap_until.has_value() && (!deadline.has_value() || *nap_until < *deadline)) {
        sleep_until = nap_until;
      }
      SleepOnBell(h, s.ring(), cap, s.bell_r.get(), sleep_until, spin);
    }
    if (waiting_since.has_value()) {
      s.spin.Record(internal::Clock::now() - *waiting_since);
      waiting_since.reset();
    }
    rec = internal::ParseQueueRecord(s.ring(), cap, h->head, h->tail, Connection::kMaxDescriptors);
    if (rec.nfds > 0 && rec.seq <= h->taken_seq) {
      // A reader died after taking this message's descriptors and before committing: the message
      // went with it. Drop the record.
      h->tail += rec.span;
      __atomic_sub_fetch(&h->count, 1, __ATOMIC_RELEASE);
      --h->unfinished;
      continue;
    }
    break;
  }
  Message msg;
  msg.bytes = internal::ReadQueuePayload(s.ring(), cap, h->tail, rec);
  if (rec.nfds > 0) {
    // The last message of a shared batch consumes it; the others peek at it.
    uint32_t& users = h->batch_users[rec.seq % internal::kMaxBatches];
    const bool last = users <= 1;
    msg.fds = RecvFds(s.fd_r.get(), rec.seq, !last);
    if (last) h->taken_seq = rec.seq;
    if (users > 0) --users;
  }
  h->tail += rec.span;  // commit
  __atomic_sub_fetch(&h->count, 1, __ATOMIC_RELEASE);
  ReleaseConsumedPages(h, s.ring(), cap);
  const bool pass_baton = h->count > 0 && __atomic_load_n(&h->get_sleepers, __ATOMIC_ACQUIRE) > 0;
  lock.Release();
  if (pass_baton) RingBell(s.bell_w.get());
  h->not_full.Broadcast();
  if (rec.spilled) {
    if (msg.fds.empty()) throw Error(ErrorCode::kInternal, "Queue::get: out-of-band item lost");
    msg.bytes = internal::ReadSpilledPayload(msg.fds.back().get(), ItemLimit(h));
    msg.fds.pop_back();
  }
  return msg;
}

bool Queue::poll(Timeout timeout) {
  State& s = Live("Queue::poll");
  internal::QueueShared* h = s.hdr();
  if (__atomic_load_n(&h->count, __ATOMIC_ACQUIRE) > 0) return true;
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "Queue::poll");
  QueueLock lock(h, s.ring(), s.cap, deadline);
  if (!lock.held()) return false;
  while (h->count == 0) {
    if (deadline.has_value() && internal::Clock::now() >= *deadline) return false;
    // No spin: a poller waits on other things too, and is not the getter a put expects.
    SleepOnBell(h, s.ring(), s.cap, s.bell_r.get(), deadline, internal::GetterSpin::Duration{});
  }
  // This poller takes nothing: a ring it drained must still wake a getter that sleeps.
  const bool pass_baton = __atomic_load_n(&h->get_sleepers, __ATOMIC_ACQUIRE) > 0;
  lock.Release();
  if (pass_baton) RingBell(s.bell_w.get());
  return true;
}

namespace internal {
GetterSpin& GetterSpinOf(const Queue& q) { return q.Live("GetterSpinOf").spin; }
}  // namespace internal

uint64_t Queue::CarrierId() const { return Live("Queue::put").carrier; }

int64_t Queue::qsize() const {
  State& s = Live("Queue::qsize");
  return __atomic_load_n(&s.hdr()->count, __ATOMIC_ACQUIRE);
}

bool Queue::full() const {
  State& s = Live("Queue::full");
  const int64_t max = s.hdr()->maxsize;
  return max > 0 && qsize() >= max;
}

int64_t Queue::maxsize() const { return Live("Queue::maxsize").hdr()->maxsize; }

void Queue::close() {
  if (!state_) return;
  state_->closed.store(true);
}

bool Queue::closed() const { return !state_ || state_->closed; }

void JoinableQueue::task_done() {
  State& s = Live("JoinableQueue::task_done");
  internal::QueueShared* h = s.hdr();
  internal::RobustLockGuard g(h->mu);
  if (g.owner_died()) RecountAfterOwnerDied(h, s.ring(), s.cap);
  if (h->unfinished - h->count <= 0) {
    throw Error(ErrorCode::kFailedPrecondition,
                "JoinableQueue::task_done called more times than there were items gotten");
  }
  if (--h->unfinished == 0) h->all_done.Broadcast();
}

bool JoinableQueue::join(Timeout timeout) {
  State& s = Live("JoinableQueue::join");
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "JoinableQueue::join");
  internal::QueueShared* h = s.hdr();
  internal::RobustLockGuard g(h->mu);
  if (g.owner_died()) RecountAfterOwnerDied(h, s.ring(), s.cap);
  while (h->unfinished > 0) {
    bool died = false;
    const bool woke = h->all_done.Wait(h->mu, deadline, &died);
    if (died) RecountAfterOwnerDied(h, s.ring(), s.cap);
    if (!woke) return h->unfinished == 0;
  }
  return true;
}

namespace internal {

void SaveQueue(const std::shared_ptr<void>& state, FileDescriptor* seg, FileDescriptor* fd_w,
               FileDescriptor* fd_r, FileDescriptor* bell_r, FileDescriptor* bell_w) {
  auto* s = static_cast<Queue::State*>(state.get());
  if (s == nullptr || s->closed) {
    throw Error(ErrorCode::kClosed, "a closed queue cannot be sent to another process");
  }
  *seg = FileDescriptor::Dup(s->seg.fd());
  *fd_w = FileDescriptor::Dup(s->fd_w.get());
  *fd_r = FileDescriptor::Dup(s->fd_r.get());
  *bell_r = FileDescriptor::Dup(s->bell_r.get());
  *bell_w = FileDescriptor::Dup(s->bell_w.get());
}

std::shared_ptr<void> LoadQueue(FileDescriptor seg, FileDescriptor fd_w, FileDescriptor fd_r,
                                FileDescriptor bell_r, FileDescriptor bell_w) {
  auto s = std::make_shared<Queue::State>();
  s->seg = SharedSegment::Map(std::move(seg));
  if (s->seg.size() < sizeof(QueueShared) + 4096 || s->hdr()->magic != kQueueMagic ||
      s->hdr()->ring_bytes != s->seg.size() - sizeof(QueueShared)) {
    throw Error(ErrorCode::kInvalidArgument, "malformed message: not a forksafe queue segment");
  }
  s->cap = s->seg.size() - sizeof(QueueShared);
  s->carrier = CarrierOf(s->seg.fd());
  s->fd_w = std::move(fd_w);
  s->fd_r = std::move(fd_r);
  if (!bell_r || !bell_w) {
    throw Error(ErrorCode::kInvalidArgument, "malformed message: a queue without its doorbell");
  }
  s->bell_r = std::move(bell_r);
  s->bell_w = std::move(bell_w);
  return s;
}

}  // namespace internal
}  // namespace forksafe::mp
