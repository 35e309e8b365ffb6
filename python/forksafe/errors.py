"""forksafe's exceptions: one class per C++ error code, all under forksafe.Error.

Every error forksafe raises is a forksafe.Error whose ``code`` is the name of the C++
``forksafe::runtime::ErrorCode`` ("invalid_argument", "deadline_exceeded", ...) and whose
message says what was wrong and what to do. Where Python has a built-in exception for the same
situation, the class derives from it too, so ``except ValueError`` or ``except TimeoutError``
catch what a Python user expects them to catch.
"""
import errno as _errno

__all__ = [
    "Error", "InvalidArgumentError", "NotFoundError", "AlreadyExistsError",
    "FailedPreconditionError", "ForkPoisonedError", "UnavailableError",
    "ResourceExhaustedError", "DeadlineExceededError", "CancelledError", "ClosedError",
    "OwnerDiedError", "ProcessFailedError", "InternalError", "NotOwnedError", "PeerClosedError",
    "OverReleasedError", "InvalidTypeError", "HandleClosedError", "BY_CODE",
]


class Error(Exception):
    """Base class of every forksafe error. ``code``: the C++ error code's name."""

    code = "internal"

    def __init__(self, message="", code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self):
        return f"{self.code}: {self.message}"


class InvalidArgumentError(Error, ValueError):
    """A parameter is out of range or malformed."""
    code = "invalid_argument"


class NotFoundError(Error, LookupError):
    """A named or handled thing does not exist."""
    code = "not_found"


class AlreadyExistsError(Error):
    """Something was registered twice."""
    code = "already_exists"


class FailedPreconditionError(Error, RuntimeError):
    """The call is not allowed in the current state (a closed pool, inside a fork handler...)."""
    code = "failed_precondition"


class ForkPoisonedError(Error, RuntimeError):
    """A subsystem initialized in the parent was used in a forked child."""
    code = "fork_poisoned"


class UnavailableError(Error, RuntimeError):
    """A backend or device is absent on this machine."""
    code = "unavailable"


class ResourceExhaustedError(Error, RuntimeError):
    """Out of memory, descriptors, /dev/shm or threads."""
    code = "resource_exhausted"


class DeadlineExceededError(Error, TimeoutError):
    """A bounded wait ran out."""
    code = "deadline_exceeded"


class CancelledError(Error):
    """Work was dropped before it ran."""
    code = "cancelled"


class ClosedError(Error, EOFError, ValueError):
    """The object, or the peer's end of a channel, was closed. An EOFError (recv() from a peer
    that closed its end, as in multiprocessing) and a ValueError (a closed Queue's put or get,
    where multiprocessing raises ValueError)."""
    code = "closed"


class PeerClosedError(ClosedError, BrokenPipeError):
    """send() on a Connection whose peer closed its end: also a BrokenPipeError (errno EPIPE),
    which multiprocessing raises there. Its code is "closed"."""

    def __init__(self, message="", code=None):
        super().__init__(message, code)
        self.errno = _errno.EPIPE
        self.strerror = "Broken pipe"


class HandleClosedError(ClosedError, OSError):
    """A Connection used after its own close(): also the OSError ("handle is closed") that
    multiprocessing raises there. Its code is "closed"."""


class OwnerDiedError(Error, RuntimeError):
    """The process holding a shared lock died; the state it guarded may be inconsistent."""
    code = "owner_died"


class ProcessFailedError(Error, RuntimeError):
    """Another process failed: it raised, exited non-zero or was killed."""
    code = "process_failed"


class InternalError(Error, RuntimeError):
    """A system call failed unexpectedly; the message carries errno."""
    code = "internal"


class NotOwnedError(FailedPreconditionError, ValueError, AssertionError):
    """A Lock or RLock released, or a Condition waited on or notified, by a thread that does not
    hold the lock. Also a ValueError (multiprocessing's Lock.release raises one) and an
    AssertionError (its RLock.release and Condition do). Its code is "failed_precondition"."""


class OverReleasedError(FailedPreconditionError, ValueError):
    """A BoundedSemaphore released above its initial value, or JoinableQueue.task_done() called
    more times than items were put: also the ValueError multiprocessing raises."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument of a type that cannot be used (an unknown typecode of Value or Array): also
    the TypeError multiprocessing raises."""


# One class per code; the five above are raised by the Python layer where multiprocessing's
# exception for the situation is more specific than the code's.
BY_CODE = {cls.code: cls for cls in (
    InvalidArgumentError, NotFoundError, AlreadyExistsError, FailedPreconditionError,
    ForkPoisonedError, UnavailableError, ResourceExhaustedError, DeadlineExceededError,
    CancelledError, ClosedError, OwnerDiedError, ProcessFailedError, InternalError)}
