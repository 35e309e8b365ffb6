// mp/timeout.h: how long a call of forksafe::mp may wait.
//
// What it offers
//   A Timeout is "forever" (default, or std::nullopt), a number of seconds (join(0.5)), or any
//   std::chrono duration (join(200ms)). Every call of forksafe::mp that takes one converts it with
//   internal::CheckedWait below, the one conversion, so the rules are the same everywhere.
//
// Guarantees (the rules)
//   - No timeout (nullopt) or +infinity: wait forever.
//   - 0: do not wait (try once).
//   - A finite positive value: wait that long. Values beyond kForeverSeconds (about 100 years)
//     are treated as forever (the deadline could not be represented on steady_clock).
//   - Negative (including -infinity) or NaN: Error(kInvalidArgument) naming the call and the value.
//     (NaN used to be taken as 0 and infinity as a deadline in the past.)
#ifndef FORKSAFE_MP_TIMEOUT_H_
#define FORKSAFE_MP_TIMEOUT_H_

#include <chrono>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>

#include "forksafe/runtime/error.h"

namespace forksafe::mp {

/// An optional wait in seconds. Converts from double seconds, chrono durations and nullopt.
struct Timeout : std::optional<std::chrono::duration<double>> {
  using Base = std::optional<std::chrono::duration<double>>;
  /// Wait forever.
  Timeout() = default;
  Timeout(std::nullopt_t) : Base() {}
  /// Wait `seconds` seconds.
  Timeout(double seconds) : Base(std::chrono::duration<double>(seconds)) {}
  template <class Rep, class Period>
  Timeout(std::chrono::duration<Rep, Period> d) : Base(std::chrono::duration<double>(d)) {}
  Timeout(const Base& b) : Base(b) {}
};

namespace internal {

/// Finite waits longer than this (about 100 years) mean forever.
constexpr double kForeverSeconds = 100.0 * 365.25 * 24 * 3600;

/// The one conversion of a Timeout (see the rules above): nullopt for "wait forever", otherwise
/// the wait as a steady_clock duration. Throws Error(kInvalidArgument) "<what>: timeout must be a
/// number of seconds >= 0, got <value>; ..." for NaN and negative values.
inline std::optional<std::chrono::steady_clock::duration> CheckedWait(
    const std::optional<std::chrono::duration<double>>& timeout, const char* what) {
  if (!timeout.has_value()) return std::nullopt;
  const double s = timeout->count();
  if (std::isnan(s) || s < 0) {
    std::ostringstream msg;
    msg << what << ": timeout must be a number of seconds >= 0, got " << s
        << "; pass no timeout (or +infinity) to wait forever, 0 to not wait";
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument, msg.str());
  }
  if (s > kForeverSeconds) return std::nullopt;  // +infinity included
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(*timeout);
}

}  // namespace internal
}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_TIMEOUT_H_
