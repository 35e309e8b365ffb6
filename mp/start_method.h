// mp/start_method.h: StartMethod, the type that names how a new process starts.
//
// What it offers
//   StartMethod holds one of fork, spawn, forkserver, or "the default" (get_start_method() at the
//   time of use). The library compares and switches on it, never on strings. Strings are parsed
//   once, at the API edge: a StartMethod converts implicitly from "fork", "spawn", "forkserver" and
//   "" (the default), as Python's names, so `options.start_method = "spawn"` keeps working.
//
// Guarantees
//   - An unknown name throws Error(kInvalidArgument) naming it and listing the valid ones, where
//     it is converted (before any process starts).
//   - A value type: trivially copyable, safe to share between threads and across fork.
#ifndef FORKSAFE_MP_START_METHOD_H_
#define FORKSAFE_MP_START_METHOD_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

namespace forksafe::mp {

/// How a new process starts (see the banner; mp/process.h describes each method).
class StartMethod {
 public:
  /// The methods, and kDefault for "whatever get_start_method() says when it is used".
  enum Kind : uint8_t { kDefault, kFork, kSpawn, kForkServer };

  /// The default (kDefault).
  constexpr StartMethod() = default;
  /// A method by kind.
  constexpr StartMethod(Kind kind) : kind_(kind) {}  // NOLINT: implicit, as an enum is
  /// Parses a name ("fork", "spawn", "forkserver"; "" is the default). Throws kInvalidArgument for
  /// any other name, listing the valid ones.
  StartMethod(std::string_view name);  // NOLINT: implicit, Python's names are the API
  StartMethod(const char* name) : StartMethod(std::string_view(name == nullptr ? "" : name)) {}
  StartMethod(const std::string& name) : StartMethod(std::string_view(name)) {}

  /// The kind.
  constexpr Kind kind() const { return kind_; }
  /// True for kDefault.
  constexpr bool is_default() const { return kind_ == kDefault; }
  /// "fork", "spawn", "forkserver", or "" for the default.
  const char* name() const;
  /// This method, or get_start_method() (mp/process.h) when this is the default.
  StartMethod Resolved() const;

  friend constexpr bool operator==(StartMethod a, StartMethod b) { return a.kind_ == b.kind_; }
  friend constexpr bool operator!=(StartMethod a, StartMethod b) { return a.kind_ != b.kind_; }
  /// Prints name() ("default" for the default).
  friend std::ostream& operator<<(std::ostream& os, StartMethod m) {
    return os << (m.is_default() ? "default" : m.name());
  }

 private:
  Kind kind_ = kDefault;
};

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_START_METHOD_H_
