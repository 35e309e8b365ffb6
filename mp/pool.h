// mp/pool.h: Pool — a pool of worker processes that runs functions over inputs, as Python's
// multiprocessing.Pool does.
//
// What it offers
//   Pool(options) starts `processes` workers with the chosen start method. Work goes in with
//   map / starmap (blocking, results in input order), map_async / starmap_async / apply_async
//   (an AsyncResult<R> with get(timeout), wait(timeout), ready(), successful()), apply
//   (blocking), and imap / imap_unordered (a ResultIterator<R> that yields results as they
//   arrive: in input order, or in completion order; next(timeout) or range-for). close() stops
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
#ifndef FORKSAFE_MP_POOL_H_
#define FORKSAFE_MP_POOL_H_

#include <sys/types.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "cereal/details/traits.hpp"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/process.h"
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
  /// "" means get_start_method().
  std::string start_method;
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

namespace internal {

using PoolClock = std::chrono::steady_clock;
using PoolDeadline = std::optional<PoolClock::time_point>;
/// nullopt timeout: forever. Throws kInvalidArgument for a negative timeout, naming `what`.
PoolDeadline ToPoolDeadline(const Timeout& timeout, const char* what);

/// The results of one submitted job (a map, an apply, an imap), chunk by chunk. Filled by the
/// pool's dispatcher, read by AsyncResult / ResultIterator.
class JobState {
 public:
  JobState(std::string what, std::vector<size_t> chunk_sizes, bool fail_fast);

  const std::string& what() const { return what_; }
  size_t num_chunks() const { return sizes_.size(); }
  size_t chunk_size(size_t chunk) const { return sizes_[chunk]; }
  size_t chunk_start(size_t chunk) const { return starts_[chunk]; }
  bool fail_fast() const { return fail_fast_; }

  // Dispatcher side: the first outcome of a chunk wins. Return true when this was the job's
  // last outstanding chunk.
  bool Complete(size_t chunk, Message result);
  bool Fail(size_t chunk, std::exception_ptr error);

  // User side; each throws kFailedPrecondition in a process other than the one that made it.
  bool failed() const;
  /// All chunks done, or (fail_fast) one failed.
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
  /// Throws Error(kDeadlineExceeded) describing the job's progress.
  [[noreturn]] void ThrowTimeout(const char* call, const Timeout& timeout) const;

  /// Set by the pool before the job is queued: the local callable it uses (fork), if any.
  std::optional<uint64_t> local_id;

 private:
  void CheckOwner(const char* call) const;
  bool ReadyLocked() const;

  const std::string what_;
  const std::vector<size_t> sizes_;
  std::vector<size_t> starts_;
  const bool fail_fast_;
  const pid_t owner_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<uint8_t> done_;
  std::vector<Message> results_;
  std::vector<std::exception_ptr> errors_;
  std::vector<size_t> completion_order_;
  std::exception_ptr first_error_;
  size_t outstanding_;
};

// ---- calling a task ---------------------------------------------------------------------------

template <class F>
struct FnPtrTraits {
  static constexpr bool kIsFnPtr = false;
};
template <class R, class... P>
struct FnPtrTraits<R (*)(P...)> {
  static constexpr bool kIsFnPtr = true;
  static constexpr size_t kArity = sizeof...(P);
  using Args = std::tuple<std::decay_t<P>...>;
  using First = std::decay_t<std::tuple_element_t<0, std::tuple<P..., void>>>;
};
template <class R, class... P>
struct FnPtrTraits<R (*)(P...) noexcept> : FnPtrTraits<R (*)(P...)> {};

template <class F, class Tup>
struct Applicable;
template <class F, class... Ts>
struct Applicable<F, std::tuple<Ts...>> {
  static constexpr bool kRvalue = std::is_invocable_v<F, Ts&&...>;
  static constexpr bool kLvalue = std::is_invocable_v<F, Ts&...>;
};

// Calls f with one element (moved when f accepts an rvalue).
template <class F, class A>
decltype(auto) CallOne(F& f, A& a) {
  if constexpr (std::is_invocable_v<F&, A&&>) {
    return std::invoke(f, std::move(a));
  } else {
    return std::invoke(f, a);
  }
}
// Calls f with a tuple's elements as arguments.
template <class F, class Tup>
decltype(auto) CallStar(F& f, Tup& t) {
  if constexpr (Applicable<F&, Tup>::kRvalue) {
    return std::apply(f, std::move(t));
  } else {
    return std::apply(f, t);
  }
}

template <class D, class W, bool kStar>
constexpr bool Callable() {
  if constexpr (kStar) {
    return Applicable<D&, W>::kRvalue || Applicable<D&, W>::kLvalue;
  } else {
    return std::is_invocable_v<D&, W&&> || std::is_invocable_v<D&, W&>;
  }
}

template <class D, class W, bool kStar>
struct CallResult {
  using type = std::decay_t<decltype(CallOne(std::declval<D&>(), std::declval<W&>()))>;
};
template <class D, class W>
struct CallResult<D, W, true> {
  using type = std::decay_t<decltype(CallStar(std::declval<D&>(), std::declval<W&>()))>;
};

/// Decodes a chunk (std::vector<W>), calls f on each element, encodes std::vector<R>.
template <class W, class R, bool kStar, class F>
void RunElements(F& f, Message& in, Message& out) {
  std::vector<W> items;
  Decode(in, items);
  std::vector<R> results;
  results.reserve(items.size());
  for (W& w : items) {
    if constexpr (kStar) {
      results.push_back(CallStar(f, w));
    } else {
      results.push_back(CallOne(f, w));
    }
  }
  out = Encode(results);
}

/// Runs a chunk with a function given by address.
using RawRunner = void (*)(const void* fn, Message& in, Message& out);
/// Runs a chunk with a callable that lives in this process (fork only).
using LocalRunner = std::function<void(Message& in, Message& out)>;

/// Registers a runner under a key that is the same in every process of this program (its
/// mangled type name). Done at static initialization, so spawned workers have every runner that
/// the program can submit.
bool RegisterPoolRunner(const char* key, RawRunner runner);

template <class D, class W, class R, bool kStar>
struct ElementRunner {
  static void Run(const void* fn, Message& in, Message& out) {
    D f = reinterpret_cast<D>(const_cast<void*>(fn));
    RunElements<W, R, kStar>(f, in, out);
  }
  static const char* Key() {
    (void)kRegistered;  // odr-use: instantiates the registration below
    return typeid(ElementRunner).name();
  }
  static const bool kRegistered;
};
template <class D, class W, class R, bool kStar>
const bool ElementRunner<D, W, R, kStar>::kRegistered =
    RegisterPoolRunner(typeid(ElementRunner<D, W, R, kStar>).name(),
                       &ElementRunner<D, W, R, kStar>::Run);

/// What the typed layer hands the pool: a function pointer with its runner, or a local callable.
struct FnSpec {
  const void* fn = nullptr;
  RawRunner runner = nullptr;
  const char* runner_key = nullptr;
  std::shared_ptr<const LocalRunner> local;
};

template <class D, class W, class R, bool kStar, class F>
FnSpec MakeFnSpec(F&& fn) {
  FnSpec spec;
  if constexpr (FnPtrTraits<D>::kIsFnPtr) {
    D p = fn;
    spec.fn = reinterpret_cast<const void*>(p);
    spec.runner = &ElementRunner<D, W, R, kStar>::Run;
    spec.runner_key = ElementRunner<D, W, R, kStar>::Key();
  } else {
    spec.local = std::make_shared<const LocalRunner>(
        [f = D(std::forward<F>(fn))](Message& in, Message& out) mutable {
          RunElements<W, R, kStar>(f, in, out);
        });
  }
  return spec;
}

// The wire type of one element: the function's parameter (tuple of parameters for star calls)
// for function pointers, the input's own type for other callables.
template <class D, class T, bool kStar, bool = FnPtrTraits<D>::kIsFnPtr>
struct WireOf {
  using type = T;
};
template <class D, class T>
struct WireOf<D, T, false, true> {
  using type = typename FnPtrTraits<D>::First;
};
template <class D, class T>
struct WireOf<D, T, true, true> {
  using type = typename FnPtrTraits<D>::Args;
};

}  // namespace internal

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
    std::lock_guard<std::mutex> lk(s.mu);
    if (!s.value) s.value.emplace(s.assemble(*s.job));
    if constexpr (std::is_copy_constructible_v<R>) {
      return *s.value;
    } else {
      return std::move(*s.value);
    }
  }
  /// Waits at most `timeout` until the result is ready; returns whether it is.
  bool wait(Timeout timeout = std::nullopt) {
    return Live("AsyncResult::wait").job->WaitReady(
        internal::ToPoolDeadline(timeout, "AsyncResult::wait"));
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
  struct State {
    std::shared_ptr<internal::JobState> job;
    std::function<R(internal::JobState&)> assemble;
    std::mutex mu;
    std::optional<R> value;
  };
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
template <class R>
class ResultIterator {
 public:
  ResultIterator(ResultIterator&&) noexcept = default;
  ResultIterator& operator=(ResultIterator&&) noexcept = default;
  ResultIterator(const ResultIterator&) = delete;
  ResultIterator& operator=(const ResultIterator&) = delete;

  /// The next result, waiting at most `timeout`; nullopt once all were returned. Throws
  /// Error(kDeadlineExceeded) on timeout (nothing is consumed then), and a failed chunk's error
  /// once, in its place (the iteration then goes on with the next chunk).
  std::optional<R> next(Timeout timeout = std::nullopt) {
    const internal::PoolDeadline deadline =
        internal::ToPoolDeadline(timeout, "ResultIterator::next");
    while (buffer_.empty()) {
      if (cursor_ >= job_->num_chunks()) return std::nullopt;
      size_t chunk = cursor_;
      if (ordered_) {
        if (!job_->WaitChunk(cursor_, deadline)) {
          job_->ThrowTimeout("ResultIterator::next", timeout);
        }
      } else {
        std::optional<size_t> c = job_->WaitCompletion(cursor_, deadline);
        if (!c) job_->ThrowTimeout("ResultIterator::next", timeout);
        chunk = *c;
      }
      ++cursor_;
      if (std::exception_ptr e = job_->error(chunk)) std::rethrow_exception(e);
      Message m = job_->TakeResult(chunk);
      std::vector<R> items = DecodeAs<std::vector<R>>(m);
      for (R& r : items) buffer_.push_back(std::move(r));
    }
    std::optional<R> out(std::move(buffer_.front()));
    buffer_.pop_front();
    return out;
  }

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
  ResultIterator(std::shared_ptr<internal::JobState> job, bool ordered)
      : job_(std::move(job)), ordered_(ordered) {}
  std::shared_ptr<internal::JobState> job_;
  bool ordered_;
  size_t cursor_ = 0;
  std::deque<R> buffer_;
};

/// A pool of worker processes. See the file comment.
class Pool {
 public:
  /// Starts the workers. Throws kInvalidArgument for processes < 0, maxtasksperchild < 0, an
  /// unknown start method, or an initializer that cannot run under it; kNotFound for an
  /// unregistered set_initializer() function under spawn/forkserver; kResourceExhausted when
  /// processes cannot be started.
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
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, T, false>::type;
    CheckSignature<D, W, false>();
    using R = typename internal::CallResult<D, W, false>::type;
    return VectorResult<R>(SubmitChunks<W>("map", internal::MakeFnSpec<D, W, R, false>(
                                                      std::forward<F>(fn)),
                                           inputs, chunksize, true, true));
  }

  /// fn(args...) for every tuple of inputs, in input order.
  template <class F, class... Ts>
  auto starmap(F&& fn, const std::vector<std::tuple<Ts...>>& inputs, int chunksize = 0) {
    return starmap_async(std::forward<F>(fn), inputs, chunksize).get();
  }
  /// starmap() without waiting.
  template <class F, class... Ts>
  auto starmap_async(F&& fn, const std::vector<std::tuple<Ts...>>& inputs, int chunksize = 0) {
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, std::tuple<Ts...>, true>::type;
    CheckSignature<D, W, true>();
    using R = typename internal::CallResult<D, W, true>::type;
    return VectorResult<R>(SubmitChunks<W>("starmap", internal::MakeFnSpec<D, W, R, true>(
                                                          std::forward<F>(fn)),
                                           inputs, chunksize, true, true));
  }

  /// Results of fn over inputs in input order, as they arrive. chunksize 0 means 1.
  template <class F, class T>
  auto imap(F&& fn, const std::vector<T>& inputs, int chunksize = 1) {
    return Iterate<F, T>(std::forward<F>(fn), inputs, chunksize, true);
  }
  /// Results of fn over inputs in completion order.
  template <class F, class T>
  auto imap_unordered(F&& fn, const std::vector<T>& inputs, int chunksize = 1) {
    return Iterate<F, T>(std::forward<F>(fn), inputs, chunksize, false);
  }

  /// fn(args...) in a worker; waits for the result.
  template <class F, class... Args>
  auto apply(F&& fn, Args&&... args) {
    return apply_async(std::forward<F>(fn), std::forward<Args>(args)...).get();
  }
  /// fn(args...) in a worker, without waiting.
  template <class F, class... Args>
  auto apply_async(F&& fn, Args&&... args) {
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, std::tuple<std::decay_t<Args>...>, true>::type;
    CheckSignature<D, W, true>();
    using R = typename internal::CallResult<D, W, true>::type;
    std::vector<W> one;
    one.emplace_back(std::forward<Args>(args)...);
    std::shared_ptr<internal::JobState> job = SubmitChunks<W>(
        "apply_async", internal::MakeFnSpec<D, W, R, true>(std::forward<F>(fn)), one, 1, false,
        true);
    return AsyncResult<R>(std::move(job), [](internal::JobState& j) {
      Message m = j.TakeResult(0);
      std::vector<R> v = DecodeAs<std::vector<R>>(m);
      if (v.size() != 1) ThrowBadResultCount(j, v.size());
      return std::move(v[0]);
    });
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
  /// The start method in use.
  const std::string& start_method() const;
  /// The pids of the current workers (a snapshot).
  std::vector<pid_t> pids() const;

  struct Impl;

 private:
  template <class D, class W, bool kStar>
  static constexpr void CheckSignature() {
    static_assert(internal::Callable<D, W, kStar>(),
                  "Pool: the function cannot be called with the given inputs (for map/imap: one "
                  "element; for starmap/apply: the tuple's elements as arguments)");
    using R = typename internal::CallResult<D, W, kStar>::type;
    static_assert(!std::is_void_v<R>, "Pool: a task must return a value (results travel back "
                                      "through the codec); return e.g. a bool");
    static_assert(std::is_default_constructible_v<R> && std::is_default_constructible_v<W>,
                  "Pool: inputs and results must be default-constructible (the codec decodes "
                  "into them)");
    if constexpr (internal::FnPtrTraits<D>::kIsFnPtr && !kStar) {
      static_assert(internal::FnPtrTraits<D>::kArity == 1,
                    "Pool::map/imap: the function must take exactly one parameter; use starmap "
                    "for several");
    }
  }

  template <class W, class T>
  std::shared_ptr<internal::JobState> SubmitChunks(const char* what, internal::FnSpec fn,
                                                   const std::vector<T>& inputs, int chunksize,
                                                   bool is_map, bool fail_fast) {
    CheckSubmit(what, fn);
    const size_t cs = ChunkSize(what, inputs.size(), chunksize, is_map);
    std::vector<Message> chunks;
    std::vector<size_t> sizes;
    for (size_t i = 0; i < inputs.size(); i += cs) {
      const size_t end = std::min(inputs.size(), i + cs);
      std::vector<W> slice;
      slice.reserve(end - i);
      for (size_t j = i; j < end; ++j) slice.emplace_back(inputs[j]);
      chunks.push_back(Encode(slice));
      sizes.push_back(end - i);
    }
    return Enqueue(what, std::move(fn), std::move(chunks), std::move(sizes), fail_fast);
  }

  template <class F, class T>
  auto Iterate(F&& fn, const std::vector<T>& inputs, int chunksize, bool ordered) {
    using D = std::decay_t<F>;
    using W = typename internal::WireOf<D, T, false>::type;
    CheckSignature<D, W, false>();
    using R = typename internal::CallResult<D, W, false>::type;
    if (chunksize == 0) chunksize = 1;
    return ResultIterator<R>(
        SubmitChunks<W>(ordered ? "imap" : "imap_unordered",
                        internal::MakeFnSpec<D, W, R, false>(std::forward<F>(fn)), inputs,
                        chunksize, false, false),
        ordered);
  }

  template <class R>
  static AsyncResult<std::vector<R>> VectorResult(std::shared_ptr<internal::JobState> job) {
    return AsyncResult<std::vector<R>>(std::move(job), [](internal::JobState& j) {
      std::vector<R> out;
      for (size_t c = 0; c < j.num_chunks(); ++c) {
        Message m = j.TakeResult(c);
        std::vector<R> part = DecodeAs<std::vector<R>>(m);
        if (part.size() != j.chunk_size(c)) ThrowBadResultCount(j, part.size());
        for (R& r : part) out.push_back(std::move(r));
      }
      return out;
    });
  }

  [[noreturn]] static void ThrowBadResultCount(const internal::JobState& job, size_t got);
  void CheckSubmit(const char* what, const internal::FnSpec& fn) const;
  size_t ChunkSize(const char* what, size_t n, int chunksize, bool is_map) const;
  std::shared_ptr<internal::JobState> Enqueue(const char* what, internal::FnSpec fn,
                                              std::vector<Message> chunks,
                                              std::vector<size_t> sizes, bool fail_fast);

  std::unique_ptr<Impl> impl_;
};

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_POOL_H_
