// tests/support/bad_call.h: table-driven checks of bad input. A row is a call, the error code it
// must throw and words its message must contain (what was wrong, what to do). CheckBadCalls runs
// each row, in a bounded child (tests/support/bounded_child.h) when the call may ask for absurd
// amounts of memory, and returns one line per row that did not hold ("" when all held).
#ifndef FORKSAFE_TESTS_SUPPORT_BAD_CALL_H_
#define FORKSAFE_TESTS_SUPPORT_BAD_CALL_H_

#include <functional>
#include <string>
#include <vector>

#include "forksafe/runtime/error.h"
#include "tests/support/bounded_child.h"

namespace forksafe::testing {

/// One row: a call, the code it must throw, and words its message must contain.
struct BadCall {
  std::string name;
  std::function<void()> call;
  runtime::ErrorCode code;
  std::vector<std::string> says;
};

/// "" when `row.call` throws Error(row.code) whose message contains every word of `row.says`;
/// else what happened instead.
inline std::string BadCallVerdict(const BadCall& row) {
  try {
    row.call();
  } catch (const runtime::Error& e) {
    if (e.code() != row.code) {
      return std::string("threw ") + runtime::ErrorCodeName(e.code()) + " instead of " +
             runtime::ErrorCodeName(row.code) + ": " + e.what();
    }
    for (const std::string& w : row.says) {
      if (e.message().find(w) == std::string::npos) {
        return "message does not say \"" + w + "\": " + e.message();
      }
    }
    return "";
  }
  return "did not throw";
}

/// Runs every row (each in a bounded child when `bounded`); "" when all held, else a line for
/// each row that did not: its name and what happened.
inline std::string CheckBadCalls(const std::vector<BadCall>& rows, bool bounded) {
  std::string failures;
  for (const BadCall& row : rows) {
    const std::string r =
        bounded ? RunBounded([&row] { return BadCallVerdict(row); }) : BadCallVerdict(row);
    if (!r.empty()) failures += row.name + ": " + r + "\n";
  }
  return failures;
}

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_BAD_CALL_H_
