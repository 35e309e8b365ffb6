// mp/queue.h: Queue, SimpleQueue and JoinableQueue — many producers, many consumers, any
// processes.
//
// What it offers
//   Python's multiprocessing queues in C++: put/get with block and timeout, put_nowait and
//   get_nowait (throwing Full / Empty), qsize/empty/full, close; JoinableQueue adds task_done and
//   join. Values go through the codec (mp/codec.h); descriptors inside them (a Connection, another
//   Queue, a shared segment) travel too.
//
// How it works
//   One shared-memory segment holds a ring buffer of framed messages plus a robust, process-shared
//   mutex; a getter that finds it empty first spins, yielding the CPU (so a reply on another CPU
//   finds it awake: waking an idle vCPU is what made cross-CPU round trips slow, see
//   docs/performance.md), then sleeps on a doorbell pipe that a put rings only when a getter
//   sleeps; putters waiting for room sleep on a futex. The wait adapts, per queue handle in each
//   process (mp/internal/queue_spin.h): the spin is about twice how long this process's recent
//   gets waited for an item, from 50 us to at most 400 us; when items come later than that but
//   regularly (up to 20 ms apart), the getter spins 50 us, sleeps with a timer until shortly
//   before the next item is expected, and spins up to 400 us around that moment, so the put
//   finds it awake; after a wait longer than 20 ms (an idle queue) it spins 50 us and sleeps
//   until a put rings, with no timer. An idle getter thus costs at most ~50 us of CPU, or one
//   timer wake-up and ~450 us per expected item. Descriptors travel on a side socket, tagged
//   with a sequence number reserved (under the lock) before they are sent.
//   Messages larger than a quarter of the ring go out of band, in an anonymous memory file
//   passed as a descriptor, so no message is too big and big messages never wait for ring space.
//
// Guarantees (and the seeds' caveats that do not apply here)
//   - put() returns once the message is in shared memory: there is no feeder thread, so no data is
//     lost when the putting process exits or is killed right after put() returns, and a process
//     that put items exits at once (Python's "joining processes that use queues" deadlock and the
//     need for cancel_join_thread do not exist here).
//   - That includes the memory a message refers to, with both sharing strategies (mp/sharing.h):
//     a tensor in the queue is a reference held by the queue. Its segment stays while the
//     message is unread and any process holds the queue, even after every process that had the
//     tensor exited (file_system: the /dev/shm name stays; file_descriptor: the descriptor
//     travels with the message). Once the message is got, the receiver's tensor is the
//     reference; a segment of its own (a tensor over 16 MiB, or the cache off) is unlinked by
//     whichever process drops the last reference. A message never read dies with the queue: when
//     no process holds the queue any more, what only it referenced is freed (file_descriptor: the
//     descriptor closes with the queue; file_system: by the creator's EmptyCache, or the shm
//     manager once the creator is gone), leaving nothing in /dev/shm. A put that fails (Full, a
//     timeout) gives its references back at once; one that committed its message never does:
//     the references are the queue's from the commit on.
//   - Descriptors are sent once per run of messages, not per message: consecutive messages
//     whose descriptors are the same shared segments (tensors from one arena segment) share one
//     batch on the side socket, so tens of thousands of tensors fit in flight, bounded by the
//     ring and maxsize. Batches of distinct descriptors are limited (4,096 in flight, fewer where
//     the socket's buffer or RLIMIT_NOFILE is smaller); past that a put waits for getters and,
//     at its timeout (at once for put_nowait), throws Full saying so and what to do.
//   - Putting and getting in the same process works; so does forwarding a received value to
//     another queue.
//   - A process killed while holding the queue's lock cannot wedge it: the next process to lock it
//     recovers (robust mutex); a message whose put had not completed is simply not there, and
//     the message count is taken again from the committed records (a process killed between
//     committing the ring and counting had left them apart: a later get returned an old message
//     after empty() said true). qsize() and empty() read the count without the lock: until some
//     call has taken the lock after such a death, they may be one off.
//   - FIFO across all producers (the order in which put() calls took the lock).
//   - Fork: inherited as is. Spawn/forkserver: pass the Queue as a Process argument.
//   - Thread safety: all methods may be called from any thread of any process.
//   - What a reader takes from shared memory and the side socket is checked before use (records
//     inside the committed bytes, descriptor counts, batch tags, the size and kind of an
//     out-of-band item): a corrupted queue gives Error(kInvalidArgument), never a crash or an
//     unbounded allocation. One item is at most QueueOptions::max_item_bytes (1 GiB by default)
//     encoded; a larger put() is Error(kInvalidArgument), and the queue goes on.
//
// Hazard: an unbounded Queue still has a finite ring (QueueOptions::ring_bytes, 1 MiB default):
// when it is full of small messages that nobody gets, put() waits for space (or times out); so
// does a put when the descriptor batches in flight reach their limit (see above). A large ring
// is cheap: one of 8 MiB or more gives the pages of got messages back to the system (every
// 1 MiB got), so it costs the memory of what it holds, not its size (forksafe.multiprocessing's
// Queue uses 64 MiB).
// Hazard: a reader SIGKILLed between get() and using a tensor's handle leaves that reference in
// flight: its segment lives until the queue is gone.
// Hazard: "the queue is gone" is judged from /proc (mp/internal/shm_manager.h): a process holds it
// while it maps its ring or has a descriptor of it. A queue that exists only in transit (inside a
// message on a Pipe or in another queue, not received yet, while no process keeps a handle of its
// own) looks gone, and the file_system segments that only its unread messages reference may be
// freed. Keep a handle of a queue while sending it to another process.
#ifndef FORKSAFE_MP_QUEUE_H_
#define FORKSAFE_MP_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/shared_segment.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

/// put_nowait() on a full queue, or put() whose timeout passed: kDeadlineExceeded, as every wait
/// that ran out (runtime/error.h); catch Full to tell it from Empty.
class Full : public runtime::Error {
 public:
  explicit Full(const std::string& what) : Error(runtime::ErrorCode::kDeadlineExceeded, what) {}
};

/// get_nowait() on an empty queue, or get() whose timeout passed: kDeadlineExceeded, as every
/// wait that ran out (runtime/error.h); catch Empty to tell it from Full.
class Empty : public runtime::Error {
 public:
  explicit Empty(const std::string& what) : Error(runtime::ErrorCode::kDeadlineExceeded, what) {}
};

/// Sizing of a queue.
struct QueueOptions {
  /// Most messages the queue holds; <= 0 means no limit but the ring's size.
  int64_t maxsize = 0;
  /// Bytes of the shared ring, 4 KiB to 4 GiB (else the constructor throws kInvalidArgument;
  /// more than the memory available now is kResourceExhausted). Messages over a quarter of it go
  /// out of band. Rings of 8 MiB and more give the pages of got messages back (see Hazards).
  size_t ring_bytes = size_t{1} << 20;
  /// Largest encoded item put() accepts and get() reads, 1 byte to Queue::kMaxItemBytes (1 GiB,
  /// the default; else the constructor throws kInvalidArgument). Every process that uses the
  /// queue applies the same limit.
  size_t max_item_bytes = size_t{1} << 30;
};

class Queue;
namespace internal {
struct QueueShared;
class GetterSpin;
GetterSpin& GetterSpinOf(const Queue& q);  // mp/internal/queue_spin.h
}  // namespace internal

/// A multi-producer, multi-consumer queue between processes.
class Queue {
 public:
  /// A queue holding at most `maxsize` messages (<= 0: unbounded).
  explicit Queue(int64_t maxsize = 0);
  explicit Queue(const QueueOptions& options);
  /// An empty handle (for decoding into); using it throws kClosed.
  Queue(std::nullptr_t) {}

  /// The most QueueOptions::max_item_bytes may be (as Connection's default limit).
  static constexpr size_t kMaxItemBytes = size_t{1} << 30;

  /// Puts `value`. With block, waits up to `timeout` for room; throws Full when there is none,
  /// saying which limit was hit (maxsize, the ring's bytes, or the descriptors in flight) and
  /// what to do.
  template <class T>
  void put(const T& value, bool block = true, Timeout timeout = {}) {
    // The shared memory `value` refers to is referenced by this queue until the message is got
    // (or the queue is gone); a put that fails gives those references back.
    internal::InFlightScope in_flight(CarrierId());
    PutMessage(Encode(value), block, timeout);  // commits the scope when it commits the message
  }
  template <class T>
  void put_nowait(const T& value) {
    put(value, false);
  }
  /// Gets the oldest value. With block, waits up to `timeout`; throws Empty when there is none.
  template <class T>
  T get(bool block = true, Timeout timeout = {}) {
    Message m = GetMessage(block, timeout);
    return DecodeAs<T>(m);
  }
  template <class T>
  T get_nowait() {
    return get<T>(false);
  }

  /// The raw forms: a prepared message in, a message out. Encode a message for PutMessage inside
  /// an internal::InFlightScope(CarrierId()) for the lifetime rule of put() to hold; PutMessage
  /// commits that scope when the message is committed (nothing after that point throws).
  void PutMessage(Message msg, bool block = true, Timeout timeout = {});
  /// The queue's identity as a holder of in-flight references (mp/internal/shared_arena.h).
  uint64_t CarrierId() const;
  Message GetMessage(bool block = true, Timeout timeout = {});

  /// True once a message is in the queue, waiting up to `timeout` (0, as Connection::poll, by
  /// default; none: forever); takes nothing. For code that waits on many things at once (the
  /// Python package's `_reader` of a queue, which multiprocessing.connection.wait polls): the
  /// message may be taken by another getter before this caller gets it.
  bool poll(Timeout timeout = 0.0);
  /// Messages in the queue now (a snapshot).
  int64_t qsize() const;
  bool empty() const { return qsize() == 0; }
  /// True when maxsize messages are queued.
  bool full() const;
  int64_t maxsize() const;

  /// Closes this process's handle (all copies in this process). Idempotent. Other processes are
  /// unaffected; messages already put stay in the queue.
  void close();
  bool closed() const;
  /// For Python compatibility: there is no feeder thread, so these do nothing.
  void join_thread() {}
  void cancel_join_thread() {}

  template <class Archive>
  void save(Archive& ar) const;
  template <class Archive>
  void load(Archive& ar);

 public:
  struct State;  // internal

 protected:
  State& Live(const char* what) const;
  std::shared_ptr<State> state_;
  friend class JoinableQueue;
  friend internal::GetterSpin& internal::GetterSpinOf(const Queue& q);
};

/// Python's SimpleQueue: put, get, empty, close, with no size limit and no timeouts.
class SimpleQueue {
 public:
  SimpleQueue() : q_(QueueOptions{}) {}
  template <class T>
  void put(const T& value) {
    q_.put(value);
  }
  template <class T>
  T get() {
    return q_.get<T>();
  }
  bool empty() const { return q_.empty(); }
  void close() { q_.close(); }

  template <class Archive>
  void serialize(Archive& ar) {
    ar(q_);
  }

 private:
  Queue q_;
};

/// A Queue whose consumers report completion: task_done() after each get(), join() waits until
/// every item put has been reported done.
class JoinableQueue : public Queue {
 public:
  explicit JoinableQueue(int64_t maxsize = 0) : Queue(maxsize) {}
  explicit JoinableQueue(const QueueOptions& o) : Queue(o) {}
  JoinableQueue(std::nullptr_t) : Queue(nullptr) {}
  /// Marks one gotten item as processed. Throws kFailedPrecondition when called more times than
  /// items were put.
  void task_done();
  /// Waits until every item put has been task_done()'d; returns false on timeout.
  bool join(Timeout timeout = {});
};

// ---- serialization --------------------------------------------------------------------------
namespace internal {
void SaveQueue(const std::shared_ptr<void>& state, FileDescriptor* seg, FileDescriptor* fd_w,
               FileDescriptor* fd_r, FileDescriptor* bell_r, FileDescriptor* bell_w);
std::shared_ptr<void> LoadQueue(FileDescriptor seg, FileDescriptor fd_w, FileDescriptor fd_r,
                                FileDescriptor bell_r, FileDescriptor bell_w);
}  // namespace internal

template <class Archive>
void Queue::save(Archive& ar) const {
  FileDescriptor seg, w, r, bell_r, bell_w;
  internal::SaveQueue(std::static_pointer_cast<void>(state_), &seg, &w, &r, &bell_r, &bell_w);
  ar(seg, w, r, bell_r, bell_w);
}

template <class Archive>
void Queue::load(Archive& ar) {
  FileDescriptor seg, w, r, bell_r, bell_w;
  ar(seg, w, r, bell_r, bell_w);
  state_ = std::static_pointer_cast<State>(internal::LoadQueue(
      std::move(seg), std::move(w), std::move(r), std::move(bell_r), std::move(bell_w)));
}

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_QUEUE_H_
