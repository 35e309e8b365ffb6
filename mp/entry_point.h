// mp/entry_point.h: functions that a fresh process can be asked to run, by name.
//
// What it offers
//   C++ cannot ship a function to a freshly started program, so the "spawn" and "forkserver"
//   start methods run only functions registered by name — the C++ form of Python's rule that a
//   target must be defined at the top level of a module so that it can be pickled. Register a
//   free function at namespace scope:
//
//     void Worker(int rank, std::string greeting) { ... }
//     FORKSAFE_ENTRY_POINT(Worker);
//
//   Then Process(&Worker, 3, "hi") works with every start method. Arguments are encoded with the
//   codec (mp/codec.h) in the parent and decoded in the child, so each argument type must be
//   serializable (standard types are; Connection, Queue, Lock, Value, ... are too).
//
// Guarantees
//   - Registration happens during static initialization, so it is complete before main() runs in
//     every process, including spawned ones (which run the same executable).
//   - Registering two functions under one name is reported at start-up (stderr) and the second
//     is refused; looking up an unknown name throws Error(kNotFound) naming the macro to add.
#ifndef FORKSAFE_MP_ENTRY_POINT_H_
#define FORKSAFE_MP_ENTRY_POINT_H_

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "forksafe/mp/codec.h"

namespace forksafe::mp {
namespace internal {

/// Decodes the arguments from a message and calls the function.
using EntryInvoker = std::function<void(Message& args)>;

bool RegisterEntryPoint(const char* name, const void* fn, EntryInvoker invoker);
/// The invoker registered under `name`; throws kNotFound.
const EntryInvoker& FindEntryPoint(const std::string& name);
/// The name under which `fn` was registered, or "" if it was not.
std::string EntryPointName(const void* fn);

template <class R, class... Args>
EntryInvoker MakeInvoker(R (*fn)(Args...)) {
  return [fn](Message& msg) {
    std::tuple<std::decay_t<Args>...> args;
    std::apply([&msg](auto&... a) { Decode(msg, a...); }, args);
    std::apply([fn](auto&... a) { fn(a...); }, args);
  };
}

template <class R, class... Args>
bool RegisterFunction(const char* name, R (*fn)(Args...)) {
  return RegisterEntryPoint(name, reinterpret_cast<const void*>(fn), MakeInvoker(fn));
}

}  // namespace internal
}  // namespace forksafe::mp

#define FORKSAFE_MP_CONCAT_INNER(a, b) a##b
#define FORKSAFE_MP_CONCAT(a, b) FORKSAFE_MP_CONCAT_INNER(a, b)

/// Registers the free function `fn` (at namespace scope) under its own name.
#define FORKSAFE_ENTRY_POINT(fn)                                                           \
  [[maybe_unused]] static const bool FORKSAFE_MP_CONCAT(forksafe_entry_point_, __LINE__) = \
      ::forksafe::mp::internal::RegisterFunction(#fn, &fn)

#endif  // FORKSAFE_MP_ENTRY_POINT_H_
