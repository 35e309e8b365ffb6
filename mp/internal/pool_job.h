// mp/internal/pool_job.h: NOT FOR USERS. The state of one call submitted to a Pool (a map, an
// apply, an imap): its chunks' results and errors, who waits for them, and the call's callbacks.
// mp/pool.h's AsyncResult and ResultIterator read it; the pool's dispatcher fills it.
//
// Two shapes of job
//   - Closed (map, starmap, apply, imap over a vector): every chunk is known when it is made.
//   - Open (imap over an input range or a generator): chunks are added with AddChunk() as the
//     input is read, until Seal(). The records of chunks the iterator has consumed are dropped
//     (Release()), so an unbounded input keeps a bounded state.
//
// Callbacks
//   A job may carry one callback (SetCallback, before it is queued). When the job becomes
//   finished (every chunk done, or a fail-fast job's first failure) the pool posts it to its
//   CallbackRunner, which runs the callback on the pool's callback thread. A job with a callback
//   is ready() (wait, get) only after its callback returned, as in Python, except for calls made
//   on the callback thread (a callback's own result, or another call's whose callback is queued
//   behind it): there a finished job is ready, whatever its callback.
//
// Thread safety: every method may be called from any thread; the state is under one mutex.
// Methods for the user's side throw kFailedPrecondition in a process other than the creator.
#ifndef FORKSAFE_MP_INTERNAL_POOL_JOB_H_
#define FORKSAFE_MP_INTERNAL_POOL_JOB_H_

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/thread_annotations.h"

namespace forksafe::mp::internal {

using PoolClock = std::chrono::steady_clock;
using PoolDeadline = std::optional<PoolClock::time_point>;
/// nullopt timeout: forever. Throws kInvalidArgument for a negative timeout, naming `what`.
PoolDeadline ToPoolDeadline(const Timeout& timeout, const char* what);

/// What a chunk's failure does to its job: fail the whole call at once (map, starmap, apply:
/// its other queued chunks are dropped), or only that chunk (imap).
enum class FailRule { kFailFast, kPerChunk };

/// The results of one submitted job, chunk by chunk. See the file comment.
class JobState {
 public:
  /// A closed job of the given chunk sizes.
  JobState(std::string what, std::vector<size_t> chunk_sizes, FailRule fail_rule);
  /// An open job: no chunks yet; AddChunk() until Seal().
  JobState(std::string what, FailRule fail_rule);

  const std::string& what() const { return what_; }
  bool fail_fast() const { return fail_fast_; }
  /// Chunks added so far (all of them for a closed job).
  size_t num_chunks() const;
  /// The chunk's size and first input index (0 for a chunk already released).
  size_t chunk_size(size_t chunk) const;
  size_t chunk_start(size_t chunk) const;

  // ---- open jobs ----
  /// Adds a chunk of `size` inputs and returns its index. kFailedPrecondition once sealed.
  size_t AddChunk(size_t size);
  /// No more chunks. Returns true when this made the job finished (nothing outstanding).
  bool Seal();
  /// Drops a consumed chunk's record (results were taken), in any order: a chunk that takes
  /// long keeps only its own record.
  void Release(size_t chunk);

  // ---- dispatcher side: the first outcome of a chunk wins ----
  /// Returns true when this was the job's last outstanding chunk (and the job is sealed).
  bool Complete(size_t chunk, Message result);
  bool Fail(size_t chunk, std::exception_ptr error);
  /// True exactly once: on the first call after the job became finished.
  bool TakeFinishedEvent();

  // ---- user side ----
  bool failed() const;
  /// Finished, and its callback (if any) has run.
  bool ready() const;
  bool WaitReady(PoolDeadline deadline) const;
  bool WaitChunk(size_t chunk, PoolDeadline deadline) const;
  /// The chunk that finished n-th (0-based); nullopt on timeout.
  std::optional<size_t> WaitCompletion(size_t n, PoolDeadline deadline) const;
  std::exception_ptr error(size_t chunk) const;
  /// The first failure recorded, in time.
  std::exception_ptr first_error() const;
  /// Moves a completed chunk's encoded results out.
  Message TakeResult(size_t chunk);
  /// Calls fn(fd) for each descriptor held by results not taken yet (a forked worker must not
  /// keep them), under the job's lock: fn may inspect the descriptor (fstat), which the user
  /// cannot close meanwhile.
  void ForEachResultFd(const std::function<void(int)>& fn) const;
  /// Throws Error(kDeadlineExceeded) describing the job's progress.
  [[noreturn]] void ThrowTimeout(const char* call, const Timeout& timeout) const;

  // ---- callbacks ----
  /// Sets the callback; before the job is queued.
  void SetCallback(std::function<void()> callback);
  bool has_callback() const;
  /// Runs the callback once (on the pool's callback thread) and marks it done, also when it
  /// throws (the exception goes to the caller, after the mark).
  void RunCallback();

  /// Set by the pool before the job is queued: the local callable it uses (fork), if any.
  std::optional<uint64_t> local_id;

 private:
  struct Record {
    size_t size = 0;
    size_t start = 0;
    bool done = false;
    Message result;
    std::exception_ptr error;
  };
  void CheckOwner(const char* call) const;
  bool FinishedLocked() const FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReadyLocked() const FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // nullptr when the chunk was released or does not exist.
  Record* Find(size_t chunk) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Record* Find(size_t chunk) const FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Settle(size_t chunk, Message* result, std::exception_ptr error) FORKSAFE_LOCKS_EXCLUDED(mu_);

  const std::string what_;
  const bool fail_fast_;
  const pid_t owner_;
  mutable runtime::internal::Mutex mu_;
  mutable runtime::internal::CondVar cv_;
  // by chunk index; released ones are erased
  std::map<size_t, Record> records_ FORKSAFE_GUARDED_BY(mu_);
  size_t next_chunk_ FORKSAFE_GUARDED_BY(mu_) = 0;  // chunks added so far
  size_t next_start_ FORKSAFE_GUARDED_BY(mu_) = 0;
  bool open_ FORKSAFE_GUARDED_BY(mu_) = false;
  // entry completion_base_ + i
  mutable std::deque<size_t> completion_order_ FORKSAFE_GUARDED_BY(mu_);
  mutable size_t completion_base_ FORKSAFE_GUARDED_BY(mu_) = 0;
  std::exception_ptr first_error_ FORKSAFE_GUARDED_BY(mu_);
  size_t outstanding_ FORKSAFE_GUARDED_BY(mu_) = 0;
  bool finished_event_taken_ FORKSAFE_GUARDED_BY(mu_) = false;
  std::function<void()> callback_ FORKSAFE_GUARDED_BY(mu_);
  bool has_callback_ FORKSAFE_GUARDED_BY(mu_) = false;
  bool callback_done_ FORKSAFE_GUARDED_BY(mu_) = false;
};

/// Runs jobs' callbacks, in the order they finished, on one thread of the pool's, started on
/// first use. A callback that throws is reported on stderr and counted, never propagated.
class CallbackRunner : public std::enable_shared_from_this<CallbackRunner> {
 public:
  explicit CallbackRunner(std::string pool_name);
  ~CallbackRunner();

  /// Queues the job's callback.
  void Post(std::shared_ptr<JobState> job);
  /// Runs what is queued, then ends the thread. Called from the callback thread itself (a
  /// callback that terminates its pool), it returns at once and the thread ends after that
  /// callback.
  void Stop();
  /// Callbacks that threw.
  uint64_t failures() const;

 private:
  void Loop() FORKSAFE_LOCKS_EXCLUDED(mu_);
  void Run(JobState& job) FORKSAFE_LOCKS_EXCLUDED(mu_);

  const std::string pool_name_;
  mutable runtime::internal::Mutex mu_;
  runtime::internal::CondVar cv_;
  std::deque<std::shared_ptr<JobState>> queue_ FORKSAFE_GUARDED_BY(mu_);
  bool stopping_ FORKSAFE_GUARDED_BY(mu_) = false;
  bool running_ FORKSAFE_GUARDED_BY(mu_) = false;  // a Loop is running (or about to)
  uint64_t failures_ FORKSAFE_GUARDED_BY(mu_) = 0;
  std::thread thread_ FORKSAFE_GUARDED_BY(mu_);
};

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_POOL_JOB_H_
