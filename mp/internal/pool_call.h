// mp/internal/pool_call.h: NOT FOR USERS. How mp/pool.h calls a task and feeds a call: the
// traits of a task function, the runners that decode a chunk, call the function on each element
// and encode the results (registered by type name, so that spawned workers find them), the wire
// type of an element, the cutting of inputs into encoded chunks (a vector at once, a lazy imap's
// generator or range as it is read), the traits of a lazy imap's input, and the error side of
// Callbacks.
//
// What it offers
//   CallForm (fn(element) or fn(tuple's elements...)), FnSpec / MakeFnSpec (what a call hands the
//   pool), WireOf / CallResult / Callable (the types of a call), EncodeChunks / MakeChunkReader /
//   RangeGenerator (chunks of inputs), ChunkRule, IsCallbacks / LastIsCallbacks / CallOnError
//   (the Callbacks argument of mp/pool.h), LazyFeed (where a lazy imap's chunks go).
//
// Guarantees
//   - Header-only templates but RegisterPoolRunner (mp/internal/pool_runners.cc); nothing here
//     takes a lock or starts a thread.
//   - An ElementRunner registers itself at static initialization under its mangled type name,
//     the same in every copy of the program.
//
// Hazards
//   - A ChunkReader reads its generator on the calling thread; it is not for several threads.
#ifndef FORKSAFE_MP_INTERNAL_POOL_CALL_H_
#define FORKSAFE_MP_INTERNAL_POOL_CALL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {
template <class OnResult, class OnError>
struct Callbacks;  // mp/pool.h
}  // namespace forksafe::mp

namespace forksafe::mp::internal {

// ---- calling a task ---------------------------------------------------------------------------

/// How a task takes one input: as one argument (map, imap), or as a tuple whose elements are its
/// arguments (starmap, apply).
enum class CallForm { kElement, kSpread };

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

template <class D, class W, CallForm kForm>
constexpr bool Callable() {
  if constexpr (kForm == CallForm::kSpread) {
    return Applicable<D&, W>::kRvalue || Applicable<D&, W>::kLvalue;
  } else {
    return std::is_invocable_v<D&, W&&> || std::is_invocable_v<D&, W&>;
  }
}

template <class D, class W, CallForm kForm>
struct CallResult {
  using type = std::decay_t<decltype(CallOne(std::declval<D&>(), std::declval<W&>()))>;
};
template <class D, class W>
struct CallResult<D, W, CallForm::kSpread> {
  using type = std::decay_t<decltype(CallStar(std::declval<D&>(), std::declval<W&>()))>;
};

/// Decodes a chunk (std::vector<W>), calls f on each element, encodes std::vector<R>.
template <class W, class R, CallForm kForm, class F>
void RunElements(F& f, Message& in, Message& out) {
  std::vector<W> items;
  Decode(in, items);
  std::vector<R> results;
  results.reserve(items.size());
  for (W& w : items) {
    if constexpr (kForm == CallForm::kSpread) {
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
/// the program can submit. Defined in mp/internal/pool_runners.cc.
bool RegisterPoolRunner(const char* key, RawRunner runner);

template <class D, class W, class R, CallForm kForm>
struct ElementRunner {
  static void Run(const void* fn, Message& in, Message& out) {
    D f = reinterpret_cast<D>(const_cast<void*>(fn));
    RunElements<W, R, kForm>(f, in, out);
  }
  static const char* Key() {
    (void)kRegistered;  // odr-use: instantiates the registration below
    return typeid(ElementRunner).name();
  }
  static const bool kRegistered;
};
template <class D, class W, class R, CallForm kForm>
const bool ElementRunner<D, W, R, kForm>::kRegistered = RegisterPoolRunner(
    typeid(ElementRunner<D, W, R, kForm>).name(), &ElementRunner<D, W, R, kForm>::Run);

/// What the typed layer hands the pool: a function pointer with its runner, or a local callable.
struct FnSpec {
  const void* fn = nullptr;
  RawRunner runner = nullptr;
  const char* runner_key = nullptr;
  std::shared_ptr<const LocalRunner> local;
};

template <class D, class W, class R, CallForm kForm, class F>
FnSpec MakeFnSpec(F&& fn) {
  FnSpec spec;
  if constexpr (FnPtrTraits<D>::kIsFnPtr) {
    D p = fn;
    spec.fn = reinterpret_cast<const void*>(p);
    spec.runner = &ElementRunner<D, W, R, kForm>::Run;
    spec.runner_key = ElementRunner<D, W, R, kForm>::Key();
  } else {
    spec.local = std::make_shared<const LocalRunner>(
        [f = D(std::forward<F>(fn))](Message& in, Message& out) mutable {
          RunElements<W, R, kForm>(f, in, out);
        });
  }
  return spec;
}

// The wire type of one element: the function's parameter (tuple of parameters for star calls)
// for function pointers, the input's own type for other callables.
template <class D, class T, CallForm kForm, bool = FnPtrTraits<D>::kIsFnPtr>
struct WireOf {
  using type = T;
};
template <class D, class T>
struct WireOf<D, T, CallForm::kElement, true> {
  using type = typename FnPtrTraits<D>::First;
};
template <class D, class T>
struct WireOf<D, T, CallForm::kSpread, true> {
  using type = typename FnPtrTraits<D>::Args;
};

// A generator for a lazy imap: callable with no arguments, returning std::optional<T>.
template <class G, class = void>
struct GeneratorTraits {
  static constexpr bool kIs = false;
};
template <class T>
struct OptionalValue {
  static constexpr bool kIs = false;
};
template <class T>
struct OptionalValue<std::optional<T>> {
  static constexpr bool kIs = true;
  using type = T;
};
template <class G>
struct GeneratorTraits<G, std::enable_if_t<std::is_invocable_v<G&>>> {
  using Out = std::decay_t<std::invoke_result_t<G&>>;
  static constexpr bool kIs = OptionalValue<Out>::kIs;
};
template <class It, class = void>
struct IsInputIterator : std::false_type {};
template <class It>
struct IsInputIterator<It, std::void_t<typename std::iterator_traits<It>::iterator_category>>
    : std::is_base_of<std::input_iterator_tag,
                      typename std::iterator_traits<It>::iterator_category> {};

// ---- the Callbacks argument -------------------------------------------------------------------

template <class T>
struct IsCallbacks : std::false_type {};
template <class A, class B>
struct IsCallbacks<Callbacks<A, B>> : std::true_type {};

// Whether the last of a pack is a Callbacks.
template <class... Ts>
struct LastIsCallbacks : std::false_type {};
template <class T, class... Ts>
struct LastIsCallbacks<T, Ts...>
    : IsCallbacks<std::decay_t<std::tuple_element_t<sizeof...(Ts), std::tuple<T, Ts...>>>> {};

// Calls a Callbacks' on_error with the failure, in the form it takes.
template <class OnError>
void CallOnError(OnError& on_error, std::exception_ptr e) {
  if constexpr (std::is_same_v<OnError, std::nullptr_t>) {
    (void)on_error;
    (void)e;
  } else if constexpr (std::is_invocable_v<OnError&, const runtime::Error&>) {
    try {
      std::rethrow_exception(e);
    } catch (const runtime::Error& err) {
      on_error(err);
    } catch (const std::exception& other) {
      on_error(runtime::Error(runtime::ErrorCode::kInternal, other.what()));
    } catch (...) {
      on_error(runtime::Error(runtime::ErrorCode::kInternal,
                              "a task failed with an exception that is not a std::exception"));
    }
  } else {
    static_assert(std::is_invocable_v<OnError&, std::exception_ptr>,
                  "Callbacks: on_error must take const forksafe::runtime::Error& or "
                  "std::exception_ptr (or be nullptr)");
    on_error(e);
  }
}

/// Where an open imap sends the chunks it reads (mp/pool.cc): its pool, while that takes work.
class LazyFeed {
 public:
  virtual ~LazyFeed() = default;
  /// Queues the next chunk of `size` inputs. Throws kFailedPrecondition when the pool no longer
  /// takes work (closed, terminated, destroyed or broken).
  virtual void Submit(Message chunk, size_t size) = 0;
  /// No more input: seals the job and lets the pool forget what it kept for it.
  virtual void Seal() = 0;
};
/// Reads and encodes an imap input's next chunk: the message and its count, nullopt at the end.
using ChunkReader = std::function<std::optional<std::pair<Message, size_t>>()>;

// ---- inputs into chunks -----------------------------------------------------------------------

/// What chunksize 0 means: pick one (map, starmap: about 4 chunks per worker), or an error.
enum class ChunkRule { kPickWhenZero, kAtLeastOne };

/// Cuts `inputs` into chunks of `cs` elements, each converted to W and encoded as
/// std::vector<W>: appends the messages to `chunks` and their element counts to `sizes`.
template <class W, class T>
void EncodeChunks(const std::vector<T>& inputs, size_t cs, std::vector<Message>* chunks,
                  std::vector<size_t>* sizes) {
  for (size_t i = 0; i < inputs.size(); i += cs) {
    const size_t end = std::min(inputs.size(), i + cs);
    std::vector<W> slice;
    slice.reserve(end - i);
    for (size_t j = i; j < end; ++j) slice.emplace_back(inputs[j]);
    chunks->push_back(Encode(slice));
    sizes->push_back(end - i);
  }
}

/// A generator over [first, last).
template <class It>
auto RangeGenerator(It first, It last) {
  using T = typename std::iterator_traits<It>::value_type;
  return [first, last]() mutable -> std::optional<T> {
    if (first == last) return std::nullopt;
    std::optional<T> v(*first);
    ++first;
    return v;
  };
}

/// A ChunkReader over a generator of T (see GeneratorTraits): each call reads up to `cs` inputs
/// and encodes them as std::vector<W>. A generator that throws ends the input: the inputs read
/// before it in that chunk are returned first, the exception on the next call; a throw with
/// nothing read is thrown at once. After nullopt (or a throw) the generator is not called again.
template <class W, class T, class G>
ChunkReader MakeChunkReader(G&& generator, size_t cs) {
  using Gen = std::decay_t<G>;
  struct Source {
    explicit Source(G&& g) : gen(std::forward<G>(g)) {}
    Gen gen;
    bool ended = false;
    std::exception_ptr error;  // thrown by the generator after part of a chunk was read
  };
  auto src = std::make_shared<Source>(std::forward<G>(generator));
  return [src, cs]() -> std::optional<std::pair<Message, size_t>> {
    if (src->error) std::rethrow_exception(std::exchange(src->error, nullptr));
    std::vector<W> slice;
    while (!src->ended && slice.size() < cs) {
      std::optional<T> v;
      try {
        v = src->gen();
      } catch (...) {
        src->ended = true;
        if (slice.empty()) throw;
        src->error = std::current_exception();  // the inputs read before it still run
        break;
      }
      if (!v) {
        src->ended = true;
        break;
      }
      slice.emplace_back(std::move(*v));
    }
    if (slice.empty()) return std::nullopt;
    const size_t n = slice.size();
    return std::make_pair(Encode(slice), n);
  };
}

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_POOL_CALL_H_
