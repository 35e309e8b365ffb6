// mp/timeout.h: how long a call of forksafe::mp may wait.
//
// A Timeout is "forever" (default, or std::nullopt), a number of seconds (join(0.5)), or any
// std::chrono duration (join(200ms)). Negative values are rejected by the calls that take one,
// with Error(kInvalidArgument).
#ifndef FORKSAFE_MP_TIMEOUT_H_
#define FORKSAFE_MP_TIMEOUT_H_

#include <chrono>
#include <optional>

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

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_TIMEOUT_H_
