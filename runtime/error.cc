#include "forksafe/runtime/error.h"

#include <cstring>

namespace forksafe::runtime {

const char* ErrorCodeName(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kNotFound: return "not_found";
    case ErrorCode::kAlreadyExists: return "already_exists";
    case ErrorCode::kFailedPrecondition: return "failed_precondition";
    case ErrorCode::kForkPoisoned: return "fork_poisoned";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kResourceExhausted: return "resource_exhausted";
    case ErrorCode::kDeadlineExceeded: return "deadline_exceeded";
    case ErrorCode::kCancelled: return "cancelled";
    case ErrorCode::kClosed: return "closed";
    case ErrorCode::kOwnerDied: return "owner_died";
    case ErrorCode::kProcessFailed: return "process_failed";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(std::string(ErrorCodeName(code)) + ": " + message),
      code_(code),
      message_(message) {}

void ThrowSystemError(const std::string& what, int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  throw Error(ErrorCode::kInternal, what + ": " + text + " (errno " + std::to_string(err) + ")");
}

}  // namespace forksafe::runtime
