// tests/soak/soak_scale.h: the size of a soak run.
//
// FORKSAFE_SOAK_SCALE (a positive number; default 1) multiplies every soak's full size: 1 runs
// the figures of issue 7 (a million Queue messages, ten thousand forks, a Pool killed at random
// for minutes), 0.1 a tenth of them (CI). An unparsable or non-positive value means 1.
#ifndef FORKSAFE_TESTS_SOAK_SOAK_SCALE_H_
#define FORKSAFE_TESTS_SOAK_SOAK_SCALE_H_

#include <cstdint>
#include <cstdlib>

namespace forksafe::testing {

/// The scale factor from FORKSAFE_SOAK_SCALE (> 0; 1 when unset or invalid).
inline double SoakScale() {
  const char* v = std::getenv("FORKSAFE_SOAK_SCALE");
  if (v == nullptr) return 1.0;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  return (end != v && s > 0) ? s : 1.0;
}

/// `full` scaled, at least `min`.
inline int64_t Scaled(int64_t full, int64_t min = 1) {
  const int64_t n = static_cast<int64_t>(static_cast<double>(full) * SoakScale());
  return n < min ? min : n;
}

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SOAK_SOAK_SCALE_H_
