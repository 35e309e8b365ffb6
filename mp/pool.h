// mp/pool.h: Pool — a pool of worker processes that runs functions over inputs, as Python's
// multiprocessing.Pool does.
//
// What it offers
//   Pool(options) starts `processes` workers with the chosen start method. Work goes in with
//   map / starmap (blocking, results in input order), map_async / starmap_async / apply_async
//   (an AsyncResult<R> with get(timeout), wait(timeout), ready(), successful()), apply
//   (blocking), and imap / imap_unordered (a ResultIterator<R> that yields results as they
//   arrive: in input order, or in completion order; next(timeout) or range-for). The *_async
//   calls take Python's callback / error_callback as a last Callbacks{on_result, on_error}
//   argument. imap / imap_unordered over a generator (a callable returning std::optional<T>) or
//   an input-iterator range read their input lazily, as results are consumed. close() stops
//   intake and lets queued work finish, terminate() drops it, join(timeout) waits for the
//   workers to exit. PoolOptions::initializer runs once in every worker before its first task;
//   maxtasksperchild retires a worker after that many tasks and starts a fresh one.
//
//     int Square(int x) { return x * x; }
//     FORKSAFE_ENTRY_POINT(Square);            // needed by "spawn" and "forkserver" only
//     ...
//     Pool pool(PoolOptions{4});
//     std::vector<int> sq = pool.map(&Square, std::vector<int>{1, 2, 3});   // {1, 4, 9}
//
// What a task may be (the C++ form of "the function must be picklable")
//   - "fork": any callable. A plain function pointer is sent as an address (the workers are
//     copies of this program image). Any other callable (lambda, functor, std::function) exists
//     only in this process's memory once the workers are forked: the pool retires its idle
//     workers and forks fresh ones that carry it, so each call with a new such callable costs
//     one fork per worker (see Hazards).
//   - "spawn" / "forkserver": a free function registered with FORKSAFE_ENTRY_POINT, passed by
//     pointer. An unregistered function is Error(kNotFound) naming the macro; a lambda or
//     functor is Error(kInvalidArgument).
//   Inputs and results always travel through the codec (mp/codec.h), whatever the start method:
//   element and result types must be cereal-serializable and default-constructible, and file
//   descriptors inside them (a Connection, a Queue, a shared segment) cross out of band. A task
//   must return a value (void functions are rejected at compile time).
//
// How it works
//   The parent owns one duplex Connection per worker and a dispatcher thread. The dispatcher
//   hands a chunk (a run of consecutive inputs) to a worker only when that worker is idle, so it
//   always knows which chunk each worker holds. It polls the workers' connections (a dead
//   worker's end reads end-of-file at once) and, every 50 ms while work is out, their exit
//   status, so a death is noticed within milliseconds. Workers run an internal registered entry
//   point (spawn, forkserver) or a forked loop (fork): receive a chunk, run it, send the results
//   or the failure, repeat.
//
// Guarantees
//   - Ordering: map, starmap and imap return results in input order; imap_unordered yields
//     chunks in the order they completed (items of one chunk in input order).
//   - Failures: a task that throws fails its result with RemoteError, which carries the worker's
//     exception type, message and stack trace at the throw point (ChildFailure). map_async and
//     friends fail as soon as one chunk fails (as in Python); their other queued chunks are
//     dropped. A failing chunk of imap raises once, in its place, and the iteration goes on with
//     the next chunk. Other results are unaffected.
//   - Nothing waits forever on a dead worker (Python's Pool hangs there): a worker that dies
//     (signal, exit, std::exit) fails the chunk it held with WorkerLostError, naming the signal
//     ("SIGSEGV (Segmentation fault)") or the exit code, and the pool starts a replacement. A chunk
//     that kills its worker is not retried.
//   - An initializer that throws breaks the pool: queued and later work fails with the
//     initializer's RemoteError (Python respawns such workers forever). Workers that keep dying
//     before they are ready (3 in a row; one not ready within 60 s is killed) break it too.
//   - terminate() (and the destructor) kills the workers (SIGTERM, SIGKILL after 1 s) and fails
//     every unfinished result with Error(kCancelled). No worker outlives the Pool: all are reaped
//     by terminate()/join(); workers also die with the parent process (the lifeline of
//     mp/process.h).
//   - Callbacks: exactly one of on_result / on_error runs per call, once, on the pool's callback
//     thread (one per pool, started on first use; never the dispatcher, so a slow callback delays
//     other callbacks, not the workers), in the order calls finished, and before that call's
//     get() / wait() / ready() report it done. What a callback throws is written to stderr and
//     counted (callback_failures()); the call's own result is unaffected. terminate() and join()
//     return after the callbacks of everything that ended (terminated calls: on_error with
//     kCancelled).
//   - Lazy imap: the generator or range is read on the thread that calls next() (never on a
//     pool thread), at most 2 x processes() chunks ahead of the consumer, so an unbounded input
//     runs in bounded memory (the records of consumed chunks are dropped). A generator that
//     throws ends the input: the results read before it are yielded, then its exception.
//   - Thread safety: every method may be called from any thread of the process that created the
//     pool (not the destructor concurrently with others). AsyncResult and ResultIterator may be
//     used from any thread of that process; one ResultIterator is not for several threads.
//   - Fork: the dispatcher holds no lock of its own while it forks a worker, and a worker uses
//     nothing of the parent's Pool but what was copied for it. A Pool inherited by a forked child
//     refuses to work there (Error(kFailedPrecondition)) and its destructor does nothing there.
//
// Hazards
//   - The destructor terminates (as Python's `with Pool() as p:` does): results not yet
//     collected fail with kCancelled. close() + join() first to let queued work finish.
//   - With "fork", each call that passes a new lambda/functor re-forks the idle workers (prefer
//     plain functions in hot loops), and each worker keeps a copy of the callables that were
//     live when it was forked.
//   - Blocking Pool calls made from inside runtime::ThreadPool tasks can stall the fork of a
//     replacement worker (under "fork") by that pool's drain deadline.
//   - A worker stopped (SIGSTOP) in the middle of sending a result stalls the dispatcher.
//   - A lazy imap needs its consumer: close() (or terminate()) before it is consumed stops
//     reading its input; the iterator yields what was submitted, then Error(kFailedPrecondition)
//     saying how many inputs ran. (An imap over a vector submits everything at once and finishes
//     after close().)
//   - A callback runs on the pool's callback thread while the pool lives: one that blocks forever
//     blocks the callbacks after it, and terminate()/join() wait for it. A callback may call the
//     pool (submit, get its own result, even terminate()).
//   - Callbacks must be copyable (they are kept in a std::function).
#ifndef FORKSAFE_MP_POOL_H_
#define FORKSAFE_MP_POOL_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cereal/details/traits.hpp"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/pool_call.h"
#include "forksafe/mp/internal/pool_job.h"
#include "forksafe/mp/internal/pool_results.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/start_method.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

/// A task threw in a worker. Code kProcessFailed; failure() has the worker's exception.
class RemoteError : public runtime::Error {
 public:
  RemoteError(ChildFailure failure, pid_t worker_pid, const std::string& context);
  /// The exception's type, message and the worker's stack at the throw.
  const ChildFailure& failure() const { return failure_; }
  /// The worker that ran the task.
  pid_t worker_pid() const { return pid_; }

 private:
  ChildFailure failure_;
  pid_t pid_;
};

/// The worker running a task died (killed by a signal, or exited). Code kProcessFailed.
class WorkerLostError : public runtime::Error {
 public:
  WorkerLostError(pid_t worker_pid, int exit_code, const std::string& message);
  /// The worker that died (already reaped).
  pid_t worker_pid() const { return pid_; }
  /// Negative signal number when killed by a signal, as Process::exitcode(); 0 when its exit
  /// status is lost (the program reaped it, see mp/process.h), which the message then says.
  int exit_code() const { return exit_code_; }
  /// "SIGSEGV (Segmentation fault)", or "" when the worker exited by itself.
  const std::string& signal_name() const { return signal_name_; }

 private:
  pid_t pid_;
  int exit_code_;
  std::string signal_name_;
};

/// How to build a Pool.
struct PoolOptions {
  /// Number of workers; 0 means runtime::DefaultThreadCount() (runtime/cpu_budget.h):
  /// FORKSAFE_NUM_THREADS, else the first number of OMP_NUM_THREADS, else the CPUs of this
  /// process's affinity mask and cgroup quota (at least 1). A malformed FORKSAFE_NUM_THREADS is
  /// then kInvalidArgument; a malformed OMP_NUM_THREADS is ignored with a warning on stderr.
  int processes = 0;
  /// Runs once in each worker before its first task. Any callable, "fork" only; for every start
  /// method use set_initializer(). If it throws, the pool is broken (see the file comment).
  std::function<void()> initializer;
  /// Tasks (chunks) a worker runs before it is replaced by a fresh one; 0 means no limit.
  int maxtasksperchild = 0;
  /// How workers start; the default (or "") means get_start_method() when the pool is built.
  /// Python's names convert: `options.start_method = "spawn"` (an unknown name throws
  /// kInvalidArgument there).
  StartMethod start_method;
  /// A name for worker processes and messages; "" means "Pool-N".
  std::string name;

  /// Sets the initializer to fn(args...), for every start method: with "spawn"/"forkserver" fn
  /// must be registered with FORKSAFE_ENTRY_POINT and the arguments are encoded with the codec
  /// (so a Queue or Connection can be passed); with "fork" they are copied.
  template <class R, class... Params, class... Args>
  PoolOptions& set_initializer(R (*fn)(Params...), Args&&... args) {
    static_assert(sizeof...(Params) == sizeof...(Args),
                  "set_initializer: pass exactly one argument per parameter of the initializer");
    auto tup = std::make_shared<std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
    initializer = [fn, tup] { std::apply([fn](auto&... a) { fn(a...); }, *tup); };
    initializer_fn = reinterpret_cast<const void*>(fn);
    initializer_args = nullptr;
    if constexpr ((cereal::traits::is_output_serializable<std::decay_t<Params>,
                                                          cereal::BinaryOutputArchive>::value &&
                   ...)) {
      initializer_args = [tup] {
        return std::apply([](const auto&... a) { return Encode(a...); }, *tup);
      };
    }
    return *this;
  }

  /// Set by set_initializer(): the function and its encoded arguments (for spawn/forkserver).
  const void* initializer_fn = nullptr;
  std::function<Message()> initializer_args;
};

/// Python's callback= and error_callback= of map_async, starmap_async and apply_async, passed as
/// the call's last argument:
///
///     pool.map_async(&Square, xs, Callbacks{[](const std::vector<int>& r) { ... },
///                                           [](const runtime::Error& e) { ... }});
///
/// on_result is called with the call's result (`const R&`; for map, the whole vector); on_error
/// with its failure, as `const runtime::Error&` or as `std::exception_ptr`. Either may be nullptr.
/// Exactly one of them runs, once per call, on the pool's callback thread (one per pool, never
/// the dispatcher), in the order the calls finished, and before the call's get()/wait() return.
/// What a callback throws is reported on stderr and counted (Pool::callback_failures()), never
/// propagated: it neither fails the call nor stops the pool.
template <class OnResult, class OnError = std::nullptr_t>
struct Callbacks {
  OnResult on_result;
  OnError on_error{};
};
template <class A>
Callbacks(A) -> Callbacks<A, std::nullptr_t>;
template <class A, class B>
Callbacks(A, B) -> Callbacks<A, B>;

/// The result of an asynchronous call (map_async, starmap_async, apply_async).
template <class R>
class AsyncResult {
 public:
  /// An empty handle; every call on it throws kFailedPrecondition.
  AsyncResult() = default;

  /// Waits at most `timeout` (nullopt: forever) and returns the result. Throws
  /// Error(kDeadlineExceeded) when it is not ready in time, the task's failure (RemoteError,
  /// WorkerLostError, or Error(kCancelled) after terminate()) otherwise. A move-only R can be
  /// taken once.
  R get(Timeout timeout = std::nullopt) {
    State& s = Live("AsyncResult::get");
    if (!s.job->WaitReady(internal::ToPoolDeadline(timeout, "AsyncResult::get"))) {
      s.job->ThrowTimeout("AsyncResult::get", timeout);
    }
    if (std::exception_ptr e = s.job->first_error()) std::rethrow_exception(e);
    return s.Get();
  }
  /// Waits at most `timeout` until the result is ready; returns whether it is.
  bool wait(Timeout timeout = std::nullopt) {
    return Live("AsyncResult::wait")
        .job->WaitReady(internal::ToPoolDeadline(timeout, "AsyncResult::wait"));
  }
  /// True once the call completed (or failed).
  bool ready() const { return Live("AsyncResult::ready").job->ready(); }
  /// Whether the call completed without failure. Throws kFailedPrecondition when not ready yet
  /// (Python's ValueError).
  bool successful() const {
    State& s = Live("AsyncResult::successful");
    if (!s.job->ready()) {
      throw runtime::Error(runtime::ErrorCode::kFailedPrecondition,
                           "AsyncResult::successful: the result of " + s.job->what() +
                               " is not ready yet; call wait() or check ready() first");
    }
    return !s.job->failed();
  }

 private:
  friend class Pool;
  using State = internal::AsyncResultState<R>;
  AsyncResult(std::shared_ptr<internal::JobState> job,
              std::function<R(internal::JobState&)> assemble)
      : state_(std::make_shared<State>()) {
    state_->job = std::move(job);
    state_->assemble = std::move(assemble);
  }
  State& Live(const char* call) const {
    if (!state_) {
      throw runtime::Error(runtime::ErrorCode::kFailedPrecondition,
                           std::string(call) + ": empty AsyncResult (default-constructed)");
    }
    return *state_;
  }
  std::shared_ptr<State> state_;
};

/// The results of imap / imap_unordered, as they arrive. Move-only: each result is yielded once.
/// For an imap over a generator or an iterator range, next() also reads the input, on the thread
/// that iterates: at most window() chunks are submitted and not yet consumed.
template <class R>
class ResultIterator {
 public:
  ResultIterator(ResultIterator&&) noexcept = default;
  ResultIterator& operator=(ResultIterator&& o) noexcept {
    if (this != &o) {
      input_ = std::move(o.input_);  // seals this one's lazy input first
      job_ = std::move(o.job_);
      order_ = o.order_;
      cursor_ = o.cursor_;
      buffer_ = std::move(o.buffer_);
    }
    return *this;
  }
  ResultIterator(const ResultIterator&) = delete;
  ResultIterator& operator=(const ResultIterator&) = delete;
  /// A lazy imap's input is not read further; chunks already submitted still run.
  ~ResultIterator() = default;

  /// The next result, waiting at most `timeout`; nullopt once all were returned. Throws
  /// Error(kDeadlineExceeded) on timeout (nothing is consumed then), and a failed chunk's error
  /// once, in its place (the iteration then goes on with the next chunk). A lazy input that
  /// throws (or a pool that stops taking its chunks: closed, terminated, broken) ends the
  /// iteration: the chunks read before it are yielded, then that error is thrown once.
  std::optional<R> next(Timeout timeout = std::nullopt) {
    const internal::PoolDeadline deadline =
        internal::ToPoolDeadline(timeout, "ResultIterator::next");
    input_.TopUp(cursor_);
    while (buffer_.empty()) {
      if (cursor_ >= input_.added()) {
        if (std::exception_ptr e = input_.TakeError()) std::rethrow_exception(e);
        return std::nullopt;
      }
      size_t chunk = cursor_;
      if (order_ == internal::ResultOrder::kInput) {
        if (!job_->WaitChunk(cursor_, deadline)) {
          job_->ThrowTimeout("ResultIterator::next", timeout);
        }
      } else {
        std::optional<size_t> c = job_->WaitCompletion(cursor_, deadline);
        if (!c) job_->ThrowTimeout("ResultIterator::next", timeout);
        chunk = *c;
      }
      ++cursor_;
      std::exception_ptr e = job_->error(chunk);
      Message m = e ? Message() : job_->TakeResult(chunk);
      if (input_.window() > 0) job_->Release(chunk);  // lazy: the record is not kept
      input_.TopUp(cursor_);
      if (e) std::rethrow_exception(e);
      std::vector<R> items = DecodeAs<std::vector<R>>(m);
      for (R& r : items) buffer_.push_back(std::move(r));
    }
    std::optional<R> out(std::move(buffer_.front()));
    buffer_.pop_front();
    return out;
  }

  /// Chunks a lazy imap keeps submitted ahead of the consumer (0 for an imap over a vector,
  /// whose chunks were all submitted at once).
  size_t window() const { return input_.window(); }

  /// Range-for support: `for (int r : pool.imap(&Square, xs)) ...` (errors throw from ++).
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = R;
    using difference_type = std::ptrdiff_t;
    using pointer = R*;
    using reference = R&;
    iterator() = default;
    explicit iterator(ResultIterator* owner) : owner_(owner) { ++*this; }
    R& operator*() { return *current_; }
    R* operator->() { return &*current_; }
    iterator& operator++() {
      current_ = owner_->next();
      if (!current_) owner_ = nullptr;
      return *this;
    }
    bool operator==(const iterator& o) const { return owner_ == o.owner_; }
    bool operator!=(const iterator& o) const { return owner_ != o.owner_; }

   private:
    ResultIterator* owner_ = nullptr;
    std::optional<R> current_;
  };
  iterator begin() { return iterator(this); }
  iterator end() { return iterator(); }

 private:
  friend class Pool;
  ResultIterator(std::shared_ptr<internal::JobState> job, internal::ResultOrder order)
      : job_(std::move(job)), order_(order), input_(job_->num_chunks()) {}
  ResultIterator(std::shared_ptr<internal::JobState> job, internal::ResultOrder order,
                 internal::IteratorInput lazy_input)
      : job_(std::move(job)), order_(order), input_(std::move(lazy_input)) {
    input_.TopUp(cursor_);
  }

  std::shared_ptr<internal::JobState> job_;
  internal::ResultOrder order_;
  size_t cursor_ = 0;  // chunks consumed
  std::deque<R> buffer_;
  internal::IteratorInput input_;  // last: sealed first when the iterator goes
};

namespace internal {
class PoolDispatcher;  // mp/internal/pool_dispatcher.h: the parent side of a Pool
}  // namespace internal

/// A pool of worker processes. See the file comment.
class Pool {
 public:
  /// Starts the workers. Throws kInvalidArgument for processes < 0, maxtasksperchild < 0, or an
  /// initializer that cannot run under the start method (an unknown start method name throws
  /// where it becomes a StartMethod); kNotFound for an unregistered set_initializer() function
  /// under spawn/forkserver; kResourceExhausted when processes cannot be started.
  explicit Pool(PoolOptions options = {});
  /// Shorthand for Pool(PoolOptions{processes}).
  explicit Pool(int processes);
  /// terminate(): kills the workers, fails unfinished results with kCancelled, reaps everyone.
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  /// fn(x) for every x of inputs, in input order. chunksize 0 picks one (as Python does:
  /// about 4 chunks per worker). Throws the first task failure.
  template <class F, class T>
  auto map(F&& fn, const std::vector<T>& inputs, int chunksize = 0) {
    return map_async(std::forward<F>(fn), inputs, chunksize).get();
  }
  /// map() without waiting.
  template <class F, class T>
  auto map_async(F&& fn, const std::vector<T>& inputs, int chunksize = 0) {
    return map_async(std::forward<F>(fn), inputs, chunksize, Callbacks<std::nullptr_t>{});
  }
  /// map_async() whose result (or failure) goes to `callbacks` (see Callbacks).
  template <class F, class T, class A, class B>
  auto map_async(F&& fn, const std::vector<T>& inputs, Callbacks<A, B> callbacks) {
    return map_async(std::forward<F>(fn), inputs, 0, std::move(callbacks));
  }
  template <class F, class T, class A, class B>
  auto map_async(F&& fn, const std::vector<T>& inputs, int chunksize, Callbacks<A, B> callbacks) {
    constexpr internal::CallForm kForm = internal::CallForm::kElement;
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, T, kForm>::type;
    CheckSignature<D, W, kForm>();
    using R = typename internal::CallResult<D, W, kForm>::type;
    return Submit<std::vector<R>>(
        internal::AssembleVector<R>(), std::move(callbacks), [&](auto attach) {
          return SubmitChunks<W>("map", internal::MakeFnSpec<D, W, R, kForm>(std::forward<F>(fn)),
                                 inputs, chunksize, internal::ChunkRule::kPickWhenZero,
                                 internal::FailRule::kFailFast, attach);
        });
  }

  /// fn(args...) for every tuple of inputs, in input order.
  template <class F, class... Ts>
  auto starmap(F&& fn, const std::vector<std::tuple<Ts...>>& inputs, int chunksize = 0) {
    return starmap_async(std::forward<F>(fn), inputs, chunksize).get();
  }
  /// starmap() without waiting.
  template <class F, class... Ts>
  auto starmap_async(F&& fn, const std::vector<std::tuple<Ts...>>& inputs, int chunksize = 0) {
    return starmap_async(std::forward<F>(fn), inputs, chunksize, Callbacks<std::nullptr_t>{});
  }
  /// starmap_async() whose result (or failure) goes to `callbacks` (see Callbacks).
  template <class F, class... Ts, class A, class B>
  auto starmap_async(F&& fn, const std::vector<std::tuple<Ts...>>& inputs,
                     Callbacks<A, B> callbacks) {
    return starmap_async(std::forward<F>(fn), inputs, 0, std::move(callbacks));
  }
  template <class F, class... Ts, class A, class B>
  auto starmap_async(F&& fn, const std::vector<std::tuple<Ts...>>& inputs, int chunksize,
                     Callbacks<A, B> callbacks) {
    constexpr internal::CallForm kForm = internal::CallForm::kSpread;
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, std::tuple<Ts...>, kForm>::type;
    CheckSignature<D, W, kForm>();
    using R = typename internal::CallResult<D, W, kForm>::type;
    return Submit<std::vector<R>>(
        internal::AssembleVector<R>(), std::move(callbacks), [&](auto attach) {
          return SubmitChunks<W>(
              "starmap", internal::MakeFnSpec<D, W, R, kForm>(std::forward<F>(fn)), inputs,
              chunksize, internal::ChunkRule::kPickWhenZero, internal::FailRule::kFailFast, attach);
        });
  }

  /// Results of fn over inputs in input order, as they arrive. chunksize 0 means 1. Every chunk
  /// is submitted at once.
  template <class F, class T>
  auto imap(F&& fn, const std::vector<T>& inputs, int chunksize = 1) {
    return Iterate<F, T>(std::forward<F>(fn), inputs, chunksize, internal::ResultOrder::kInput);
  }
  /// Results of fn over inputs in completion order.
  template <class F, class T>
  auto imap_unordered(F&& fn, const std::vector<T>& inputs, int chunksize = 1) {
    return Iterate<F, T>(std::forward<F>(fn), inputs, chunksize,
                         internal::ResultOrder::kCompletion);
  }
  /// imap over a generator, read lazily: `generator()` returns std::optional<T>, nullopt at the
  /// end (it is not called again after that). The input is read on the thread that iterates,
  /// never on the pool's: about 2 x processes() chunks are submitted ahead of the consumer at
  /// most, so an unbounded input runs in bounded memory. A generator that throws ends the input
  /// (see ResultIterator::next). The generator must outlive nothing: the iterator owns it.
  template <class F, class G,
            std::enable_if_t<internal::GeneratorTraits<std::decay_t<G>>::kIs, int> = 0>
  auto imap(F&& fn, G&& generator, int chunksize = 1) {
    return IterateLazy(std::forward<F>(fn), std::forward<G>(generator), chunksize,
                       internal::ResultOrder::kInput);
  }
  template <class F, class G,
            std::enable_if_t<internal::GeneratorTraits<std::decay_t<G>>::kIs, int> = 0>
  auto imap_unordered(F&& fn, G&& generator, int chunksize = 1) {
    return IterateLazy(std::forward<F>(fn), std::forward<G>(generator), chunksize,
                       internal::ResultOrder::kCompletion);
  }
  /// imap over [first, last), read lazily as above (input iterators such as
  /// std::istream_iterator work; the range must stay valid while the iterator reads it).
  template <class F, class It, std::enable_if_t<internal::IsInputIterator<It>::value, int> = 0>
  auto imap(F&& fn, It first, It last, int chunksize = 1) {
    return IterateLazy(std::forward<F>(fn), internal::RangeGenerator(first, last), chunksize,
                       internal::ResultOrder::kInput);
  }
  template <class F, class It, std::enable_if_t<internal::IsInputIterator<It>::value, int> = 0>
  auto imap_unordered(F&& fn, It first, It last, int chunksize = 1) {
    return IterateLazy(std::forward<F>(fn), internal::RangeGenerator(first, last), chunksize,
                       internal::ResultOrder::kCompletion);
  }

  /// fn(args...) in a worker; waits for the result.
  template <class F, class... Args>
  auto apply(F&& fn, Args&&... args) {
    return apply_async(std::forward<F>(fn), std::forward<Args>(args)...).get();
  }
  /// fn(args...) in a worker, without waiting. A Callbacks as the last argument receives the
  /// result or the failure (see Callbacks): `pool.apply_async(&Add, 1, 2, Callbacks{on_sum})`.
  template <class F, class... Args>
  auto apply_async(F&& fn, Args&&... args) {
    if constexpr (internal::LastIsCallbacks<Args...>::value) {
      return ApplySplit(std::forward<F>(fn), std::forward_as_tuple(std::forward<Args>(args)...),
                        std::make_index_sequence<sizeof...(Args) - 1>());
    } else {
      return ApplyWith(std::forward<F>(fn), Callbacks<std::nullptr_t>{},
                       std::forward<Args>(args)...);
    }
  }

  /// Stops intake: queued work still runs, then the workers exit (join() waits for that).
  void close();
  /// Kills the workers now (SIGTERM, then SIGKILL after 1 s), fails every unfinished result with
  /// Error(kCancelled), and waits until all workers are reaped.
  void terminate();
  /// Waits at most `timeout` for the workers to exit after close() or terminate(); returns
  /// whether they did. Throws kFailedPrecondition before close()/terminate() (as Python).
  bool join(Timeout timeout = std::nullopt);

  /// The number of workers the pool keeps.
  int processes() const;
  /// The start method in use (never the default: the one get_start_method() gave at start).
  StartMethod start_method() const;
  /// The pids of the current workers (a snapshot).
  std::vector<pid_t> pids() const;
  /// Callbacks (see Callbacks) that threw so far; each was also reported on stderr.
  uint64_t callback_failures() const;

 private:
  template <class D, class W, internal::CallForm kForm>
  static constexpr void CheckSignature() {
    static_assert(internal::Callable<D, W, kForm>(),
                  "Pool: the function cannot be called with the given inputs (for map/imap: one "
                  "element; for starmap/apply: the tuple's elements as arguments)");
    using R = typename internal::CallResult<D, W, kForm>::type;
    static_assert(!std::is_void_v<R>,
                  "Pool: a task must return a value (results travel back "
                  "through the codec); return e.g. a bool");
    static_assert(std::is_default_constructible_v<R> && std::is_default_constructible_v<W>,
                  "Pool: inputs and results must be default-constructible (the codec decodes "
                  "into them)");
    if constexpr (internal::FnPtrTraits<D>::kIsFnPtr && kForm == internal::CallForm::kElement) {
      static_assert(internal::FnPtrTraits<D>::kArity == 1,
                    "Pool::map/imap: the function must take exactly one parameter; use starmap "
                    "for several");
    }
  }

  using Attach = std::function<void(const std::shared_ptr<internal::JobState>&)>;

  // Checks the call, cuts the inputs into chunks of W and queues them as one job.
  template <class W, class T>
  std::shared_ptr<internal::JobState> SubmitChunks(const char* what, internal::FnSpec fn,
                                                   const std::vector<T>& inputs, int chunksize,
                                                   internal::ChunkRule chunk_rule,
                                                   internal::FailRule fail_rule,
                                                   const Attach& attach = nullptr) {
    CheckSubmit(what, fn);
    const size_t cs = ChunkSize(what, inputs.size(), chunksize, chunk_rule);
    std::vector<Message> chunks;
    std::vector<size_t> sizes;
    internal::EncodeChunks<W>(inputs, cs, &chunks, &sizes);
    return Enqueue(what, std::move(fn), std::move(chunks), std::move(sizes), fail_rule, attach);
  }

  // An AsyncResult<R> for what `submit(attach)` queues; with callbacks, `attach` sets the job's
  // callback before any chunk is queued.
  template <class R, class A, class B, class SubmitFn>
  AsyncResult<R> Submit(std::function<R(internal::JobState&)> assemble, Callbacks<A, B> cbs,
                        SubmitFn&& submit) {
    if constexpr (std::is_same_v<A, std::nullptr_t> && std::is_same_v<B, std::nullptr_t>) {
      return AsyncResult<R>(submit(Attach()), std::move(assemble));
    } else {
      AsyncResult<R> result(nullptr, std::move(assemble));
      std::shared_ptr<internal::AsyncResultState<R>> state = result.state_;
      submit(Attach([state, &cbs](const std::shared_ptr<internal::JobState>& job) {
        state->job = job;
        job->SetCallback(internal::MakeResultCallback<R>(state, std::move(cbs)));
      }));
      return result;
    }
  }

  template <class F, class Tup, size_t... I>
  auto ApplySplit(F&& fn, Tup&& args, std::index_sequence<I...>) {
    return ApplyWith(std::forward<F>(fn), std::get<sizeof...(I)>(std::forward<Tup>(args)),
                     std::get<I>(std::forward<Tup>(args))...);
  }

  template <class F, class A, class B, class... Args>
  auto ApplyWith(F&& fn, Callbacks<A, B> cbs, Args&&... args) {
    constexpr internal::CallForm kForm = internal::CallForm::kSpread;
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, std::tuple<std::decay_t<Args>...>, kForm>::type;
    CheckSignature<D, W, kForm>();
    using R = typename internal::CallResult<D, W, kForm>::type;
    std::vector<W> one;
    one.emplace_back(std::forward<Args>(args)...);
    return Submit<R>(internal::AssembleOne<R>(), std::move(cbs), [&](auto attach) {
      return SubmitChunks<W>(
          "apply_async", internal::MakeFnSpec<D, W, R, kForm>(std::forward<F>(fn)), one,
          /*chunksize=*/1, internal::ChunkRule::kAtLeastOne, internal::FailRule::kFailFast, attach);
    });
  }

  template <class F, class T>
  auto Iterate(F&& fn, const std::vector<T>& inputs, int chunksize, internal::ResultOrder order) {
    constexpr internal::CallForm kForm = internal::CallForm::kElement;
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, T, kForm>::type;
    CheckSignature<D, W, kForm>();
    using R = typename internal::CallResult<D, W, kForm>::type;
    if (chunksize == 0) chunksize = 1;
    return ResultIterator<R>(
        SubmitChunks<W>(ImapName(order), internal::MakeFnSpec<D, W, R, kForm>(std::forward<F>(fn)),
                        inputs, chunksize, internal::ChunkRule::kAtLeastOne,
                        internal::FailRule::kPerChunk),
        order);
  }

  template <class F, class G>
  auto IterateLazy(F&& fn, G&& generator, int chunksize, internal::ResultOrder order) {
    constexpr internal::CallForm kForm = internal::CallForm::kElement;
    using T = typename internal::OptionalValue<
        typename internal::GeneratorTraits<std::decay_t<G>>::Out>::type;
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, T, kForm>::type;
    CheckSignature<D, W, kForm>();
    using R = typename internal::CallResult<D, W, kForm>::type;
    const char* what = ImapName(order);
    if (chunksize == 0) chunksize = 1;
    const size_t cs = ChunkSize(what, 0, chunksize, internal::ChunkRule::kAtLeastOne);
    auto job = std::make_shared<internal::JobState>(what, internal::FailRule::kPerChunk);
    std::unique_ptr<internal::LazyFeed> feed =
        OpenFeed(what, internal::MakeFnSpec<D, W, R, kForm>(std::forward<F>(fn)), job);
    internal::ChunkReader read = internal::MakeChunkReader<W, T>(std::forward<G>(generator), cs);
    return ResultIterator<R>(
        std::move(job), order,
        internal::IteratorInput(std::move(feed), std::move(read), LazyWindow()));
  }

  static const char* ImapName(internal::ResultOrder order) {
    return order == internal::ResultOrder::kInput ? "imap" : "imap_unordered";
  }

  void CheckSubmit(const char* what, const internal::FnSpec& fn) const;
  size_t ChunkSize(const char* what, size_t n, int chunksize, internal::ChunkRule rule) const;
  std::shared_ptr<internal::JobState> Enqueue(const char* what, internal::FnSpec fn,
                                              std::vector<Message> chunks,
                                              std::vector<size_t> sizes,
                                              internal::FailRule fail_rule, const Attach& attach);
  // The feed of an open imap job (checks the call like CheckSubmit).
  std::unique_ptr<internal::LazyFeed> OpenFeed(const char* what, internal::FnSpec fn,
                                               std::shared_ptr<internal::JobState> job);
  // Chunks a lazy imap keeps ahead of its consumer.
  size_t LazyWindow() const;

  std::unique_ptr<internal::PoolDispatcher> impl_;
};

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_POOL_H_
