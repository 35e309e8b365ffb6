// runtime/error.h: the one way forksafe reports errors.
//
// What it offers
//   Every fallible call in forksafe (runtime, device and mp alike) reports failure by throwing
//   `forksafe::runtime::Error` or a subclass. An Error carries a machine-readable `ErrorCode` and a
//   message written for a person: what went wrong, with the values involved, and what to do about
//   it. Callers that want a status value instead of an exception wrap a call in `Capture()`.
//
// Guarantees
//   - A function that throws leaves no resource behind (file descriptors, processes, memory).
//   - Code that runs inside at-fork handlers never throws: it records a ForkEvent instead
//     (see runtime/at_fork.h), since an exception cannot cross pthread_atfork.
//   - Thread safety: Error is an immutable value; copying it is safe from any thread.
#ifndef FORKSAFE_RUNTIME_ERROR_H_
#define FORKSAFE_RUNTIME_ERROR_H_

#include <stdexcept>
#include <string>
#include <utility>

namespace forksafe::runtime {

/// The category of a failure. Stable: callers may switch on it.
///
/// The rule for choosing a code (every layer follows it; a throw that does not is a bug):
///   - kDeadlineExceeded: every bounded wait that ran out. A timeout that passed, and a
///     non-blocking attempt (a zero wait) that could not proceed at once: get_nowait() on an
///     empty queue, put_nowait() on a full one, a lock or a result not had in time. A queue's
///     Empty and Full (mp/queue.h) are this code; the C++ type, or Python's queue.Empty /
///     queue.Full, tells them apart. Blocking calls with no timeout never throw it.
///   - kUnavailable: only "a backend, device or facility is absent on this machine or in this
///     process" (no CUDA driver or device, no backend registered for a device type, a backend that
///     cannot export memory). Never "nothing there yet" (that is a wait: kDeadlineExceeded) and
///     never "a peer went away" (kClosed or kProcessFailed).
///   - kResourceExhausted: a limit of the machine or the process was reached: memory, file
///     descriptors, threads, processes, /dev/shm or disk space, and the size limits a message or
///     item is checked against. Never a queue or pool that is full for now (kDeadlineExceeded).
///   - kInvalidArgument: the caller passed something wrong (a range, a malformed value or
///     message); kFailedPrecondition: the call is wrong in the object's current state (closed
///     pool, inside a fork handler, a forked child's copy); kClosed: the object, or the peer's
///     end, was closed; kProcessFailed: another process failed or died; kInternal: an unexpected
///     system-call failure (with errno).
enum class ErrorCode {
  kInvalidArgument,     ///< A parameter is out of range or malformed.
  kNotFound,            ///< A named or handled thing does not exist.
  kAlreadyExists,       ///< Registering something twice.
  kFailedPrecondition,  ///< The call is not allowed in the current state (e.g. inside a fork
                        ///< handler).
  kForkPoisoned,        ///< A subsystem initialized in the parent was used in a forked child.
  kUnavailable,         ///< A backend, device or facility is absent on this machine.
  kResourceExhausted,   ///< Out of memory, descriptors, threads, processes, /dev/shm, a size limit.
  kDeadlineExceeded,    ///< A bounded wait ran out (a timeout, or a non-blocking attempt).
  kCancelled,           ///< Work was dropped before it ran (e.g. pool destroyed).
  kClosed,              ///< The object, or the peer's end of a channel, was closed.
  kOwnerDied,           ///< The process holding a shared lock died; state may be inconsistent.
  kProcessFailed,       ///< Another process failed: it threw, exited non-zero or was killed.
  kInternal,            ///< A system call failed unexpectedly; the message carries errno.
};

/// Returns a stable lowercase name for `code` ("invalid_argument", ...).
const char* ErrorCodeName(ErrorCode code) noexcept;

/// The exception type thrown by every forksafe API.
class Error : public std::runtime_error {
 public:
  /// Builds an error; `what()` reads "<code name>: <message>".
  Error(ErrorCode code, const std::string& message);
  /// An empty kInternal error, for use as an out-parameter of Capture().
  Error() : Error(ErrorCode::kInternal, "") {}

  /// The category of this error.
  ErrorCode code() const noexcept { return code_; }
  /// The message without the code prefix.
  const std::string& message() const noexcept { return message_; }

 private:
  ErrorCode code_;
  std::string message_;
};

/// Throws Error with "<what>: <strerror(err)> (errno <err>)": kResourceExhausted (with what to
/// do) for a limit reached (EMFILE, ENFILE, EFBIG, ENOMEM, ENOSPC, EDQUOT), kInternal otherwise.
[[noreturn]] void ThrowSystemError(const std::string& what, int err);

/// Runs `fn` and returns true, or catches an Error and stores it in `*out` and returns false.
template <typename Fn>
bool Capture(Fn&& fn, Error* out) {
  try {
    std::forward<Fn>(fn)();
    return true;
  } catch (const Error& e) {
    if (out != nullptr) *out = e;
    return false;
  }
}

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_ERROR_H_
