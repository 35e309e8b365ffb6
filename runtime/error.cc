#include "forksafe/runtime/error.h"

#include <cerrno>
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
  std::string message = what + ": " + text + " (errno " + std::to_string(err) + ")";
  switch (err) {
    // A limit of the process or the system, not a fault: the caller can free or raise it.
    case EMFILE:
    case ENFILE:
      throw Error(ErrorCode::kResourceExhausted,
                  message + "; close descriptors, or raise the limit (ulimit -n)");
    case EFBIG:
      throw Error(ErrorCode::kResourceExhausted,
                  message + "; the file size limit (ulimit -f) is below what this needs");
    case ENOMEM:
    case ENOSPC:
    case EDQUOT:
      throw Error(ErrorCode::kResourceExhausted,
                  message + "; free memory or /dev/shm space, or raise the limit");
    default: throw Error(ErrorCode::kInternal, message);
  }
}

}  // namespace forksafe::runtime
