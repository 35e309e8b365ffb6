// mp/internal/pool_results.h: NOT FOR USERS. What mp/pool.h's AsyncResult and ResultIterator
// hold besides their JobState (mp/internal/pool_job.h): the decoded value of an AsyncResult and
// the callback that delivers it, the assembly of a job's encoded chunks into the call's result,
// and the input side of an imap (all chunks submitted at once, or a lazy input read as the
// iterator is consumed).
//
// What it offers
//   AsyncResultState<R> (the job, its assembler, the value assembled once, under a mutex) and
//   MakeResultCallback (a job's callback that calls a Callbacks' on_result or on_error);
//   AssembleVector<R> / AssembleOne<R>; ResultOrder; IteratorInput.
//
// Guarantees
//   - A result is assembled (decoded) once, under the state's mutex; what assembling threw is
//     kept and thrown again to every later reader.
//   - IteratorInput reads its input only from the thread that calls TopUp() (the consumer's),
//     never from a pool thread, and keeps at most `window` chunks submitted and not consumed.
//   - An IteratorInput seals its feed when it is destroyed or assigned over: the pool forgets
//     what it kept for the job; chunks already submitted still run.
//
// Hazards
//   - One IteratorInput is not for several threads (as one ResultIterator).
#ifndef FORKSAFE_MP_INTERNAL_POOL_RESULTS_H_
#define FORKSAFE_MP_INTERNAL_POOL_RESULTS_H_

#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/pool_call.h"
#include "forksafe/mp/internal/pool_job.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/thread_annotations.h"

namespace forksafe::mp::internal {

/// The order in which an imap yields its chunks: input order, or completion order.
enum class ResultOrder { kInput, kCompletion };

/// Throws Error(kInternal): a worker returned `got` results for a chunk of another size.
[[noreturn]] void ThrowBadResultCount(const JobState& job, size_t got);

/// The result of a map or starmap: every chunk's std::vector<R>, in input order.
template <class R>
std::function<std::vector<R>(JobState&)> AssembleVector() {
  return [](JobState& j) {
    std::vector<R> out;
    for (size_t c = 0; c < j.num_chunks(); ++c) {
      Message m = j.TakeResult(c);
      std::vector<R> part = DecodeAs<std::vector<R>>(m);
      if (part.size() != j.chunk_size(c)) ThrowBadResultCount(j, part.size());
      for (R& r : part) out.push_back(std::move(r));
    }
    return out;
  };
}

/// The result of an apply: the one element of its one chunk.
template <class R>
std::function<R(JobState&)> AssembleOne() {
  return [](JobState& j) {
    Message m = j.TakeResult(0);
    std::vector<R> v = DecodeAs<std::vector<R>>(m);
    if (v.size() != 1) ThrowBadResultCount(j, v.size());
    return std::move(v[0]);
  };
}

/// What an AsyncResult<R> shares with its callback.
template <class R>
struct AsyncResultState {
  std::shared_ptr<JobState> job;  // set before the result is handed out
  std::function<R(JobState&)> assemble;
  runtime::internal::Mutex mu;
  std::optional<R> value FORKSAFE_GUARDED_BY(mu);
  std::exception_ptr assemble_error FORKSAFE_GUARDED_BY(mu);

  /// The decoded result, assembled once; throws what assembling threw.
  R& ValueLocked() FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (value) return *value;
    if (assemble_error) std::rethrow_exception(assemble_error);
    try {
      value.emplace(assemble(*job));
    } catch (...) {
      assemble_error = std::current_exception();
      throw;
    }
    return *value;
  }

  /// The result for AsyncResult::get(): a copy, or the value itself for a move-only R (which
  /// can then be taken once).
  R Get() FORKSAFE_LOCKS_EXCLUDED(mu) {
    runtime::internal::MutexLock lk(&mu);
    R& v = ValueLocked();
    if constexpr (std::is_copy_constructible_v<R>) {
      return v;
    } else {
      return std::move(v);
    }
  }
};

/// A job's callback: assembles the result and calls cbs.on_result, or calls cbs.on_error (a
/// Callbacks of mp/pool.h). It holds the state until it has run (the job drops it then).
template <class R, class Cbs>
std::function<void()> MakeResultCallback(std::shared_ptr<AsyncResultState<R>> st, Cbs cbs) {
  return [st = std::move(st), cbs = std::move(cbs)]() mutable {
    std::exception_ptr err = st->job->first_error();
    R* v = nullptr;
    if (!err) {
      try {
        runtime::internal::MutexLock lk(&st->mu);
        v = &st->ValueLocked();
      } catch (...) {
        err = std::current_exception();
      }
    }
    using OnResult = decltype(cbs.on_result);
    if (err) {
      CallOnError(cbs.on_error, err);
    } else if constexpr (!std::is_same_v<OnResult, std::nullptr_t>) {
      static_assert(std::is_invocable_v<OnResult&, const R&>,
                    "Callbacks: on_result must be callable with the call's result (const R&; "
                    "for map_async the std::vector of results)");
      cbs.on_result(static_cast<const R&>(*v));
    }
  };
}

/// The input side of an imap: how many chunks were submitted, and for a lazy input, the feed it
/// submits through, the reader of its input and the error that ended it.
class IteratorInput {
 public:
  /// All `chunks` were submitted already (an imap over a vector).
  explicit IteratorInput(size_t chunks) : added_(chunks) {}
  /// A lazy input: `read` reads and encodes the next chunk, `feed` queues it; at most `window`
  /// chunks are submitted ahead of the consumer.
  IteratorInput(std::unique_ptr<LazyFeed> feed, ChunkReader read, size_t window);
  IteratorInput(IteratorInput&&) noexcept = default;
  /// Seals this input's feed, then takes the other's.
  IteratorInput& operator=(IteratorInput&& o) noexcept;
  IteratorInput(const IteratorInput&) = delete;
  IteratorInput& operator=(const IteratorInput&) = delete;
  /// Seals the feed: the input is not read further.
  ~IteratorInput() { Seal(); }

  /// Lazy: reads and submits chunks until `window` are ahead of the `consumed` ones or the input
  /// ends. An input (or a feed) that throws ends it: the error is kept for TakeError().
  void TopUp(size_t consumed);
  /// Chunks submitted so far.
  size_t added() const { return added_; }
  /// The window (0 when every chunk was submitted at once).
  size_t window() const { return window_; }
  /// The error that ended the input, once; nullptr when none (or already taken).
  std::exception_ptr TakeError() { return std::exchange(error_, nullptr); }

 private:
  void Seal();

  std::unique_ptr<LazyFeed> feed_;
  ChunkReader read_;
  size_t window_ = 0;
  size_t added_ = 0;
  std::exception_ptr error_;
};

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_POOL_RESULTS_H_
