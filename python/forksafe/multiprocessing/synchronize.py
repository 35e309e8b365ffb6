"""Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event and Barrier shared between
processes (forksafe's C++ mp/synchronize.h).

Guarantees beyond the standard library's: every primitive is robust on owner death (a process
killed while holding a Lock does not wedge the others: the next acquirer gets it, and
``previous_owner_died()`` says so), never built on sem_t, and safe across fork in every start
method. Every wait releases the GIL. Names and semantics are multiprocessing's:
``acquire(block=True, timeout=None)``, context managers, ``Barrier.wait`` raising
``threading.BrokenBarrierError``.
"""

import threading
import time

from .. import _forksafe
from ..errors import (DeadlineExceededError, FailedPreconditionError, NotOwnedError,
                      OverReleasedError)
from .reduction import Shareable

_mp = _forksafe.mp

__all__ = ["Lock", "RLock", "Semaphore", "BoundedSemaphore", "Condition", "Event", "Barrier"]



def _not_owned(e):
    # The lock's misuse as multiprocessing reports it (ValueError, AssertionError), kept a
    # forksafe.FailedPreconditionError with the C++ message.
    return NotOwnedError(e.message)

class _Acquirable(Shareable):
    """acquire(block, timeout) and the context manager, over a handle with acquire/release."""

    __slots__ = ("_handle",)

    def acquire(self, block=True, timeout=None):
        """Takes it; False when it could not within `timeout` (or at once, block=False)."""
        return self._handle.acquire(block, timeout if block else None)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class _LockBase(_Acquirable):
    __slots__ = ()

    def __init__(self, *, ctx=None):
        self._handle = self._handle_type()()

    def release(self):
        """Gives the lock back; the caller must hold it (forksafe.NotOwnedError: also the
        ValueError and AssertionError that multiprocessing raises)."""
        try:
            self._handle.release()
        except FailedPreconditionError as e:
            raise _not_owned(e) from None

    def previous_owner_died(self):
        """True when the last acquire took the lock from a process that died holding it."""
        return self._handle.previous_owner_died()

    def __repr__(self):
        return f"<forksafe.multiprocessing.{type(self).__name__}>"


class Lock(_LockBase):
    """A non-recursive lock shared between processes (multiprocessing.Lock)."""

    __slots__ = ()

    @staticmethod
    def _handle_type():
        return _mp.Lock


class RLock(_LockBase):
    """A recursive lock shared between processes (multiprocessing.RLock)."""

    __slots__ = ()

    @staticmethod
    def _handle_type():
        return _mp.RLock


class Semaphore(_Acquirable):
    """A counter of units shared between processes (multiprocessing.Semaphore)."""

    __slots__ = ()

    def __init__(self, value=1, *, ctx=None):
        self._handle = self._handle_type()(value)

    @staticmethod
    def _handle_type():
        return _mp.Semaphore

    def release(self, n=1):
        self._handle.release(n)

    def get_value(self):
        return self._handle.get_value()

    @property
    def _semlock(self):
        # What the standard library's own code reads of a semaphore it got from a context
        # (multiprocessing.queues.Queue.full() and qsize(), which concurrent.futures'
        # ProcessPoolExecutor builds on the context it is given).
        return _SemLockView(self._handle)

    def __repr__(self):
        return f"<forksafe.multiprocessing.{type(self).__name__}(value={self.get_value()})>"


class _SemLockView:
    """The part of multiprocessing's _multiprocessing.SemLock that its queues call."""

    __slots__ = ("_h",)

    def __init__(self, handle):
        self._h = handle

    def _get_value(self):
        return self._h.get_value()

    def _is_zero(self):
        return self._h.get_value() == 0


class BoundedSemaphore(Semaphore):
    """A Semaphore that may not be released above its initial value (ValueError there)."""

    __slots__ = ()

    @staticmethod
    def _handle_type():
        return _mp.BoundedSemaphore

    def release(self, n=1):
        try:
            self._handle.release(n)
        except FailedPreconditionError as e:
            raise OverReleasedError(f"BoundedSemaphore released too many times: {e.message}") \
                from None


class Condition(_Acquirable):
    """A condition variable over a shared Lock or RLock (an RLock by default)."""

    __slots__ = ()

    def __init__(self, lock=None, *, ctx=None):
        if lock is None:
            lock = RLock()
        if not isinstance(lock, (Lock, RLock)):
            raise TypeError("Condition(lock): lock must be a forksafe.multiprocessing Lock or "
                            f"RLock, not {type(lock).__name__}")
        self._handle = _mp.Condition(lock._handle)  # it shares the lock's state

    @staticmethod
    def _handle_type():
        return _mp.Condition

    def release(self):
        try:
            self._handle.release()
        except FailedPreconditionError as e:
            raise _not_owned(e) from None

    def wait(self, timeout=None):
        """Releases the lock, waits for a notify (at most `timeout`), takes the lock again.
        Returns False when the timeout ran out. The caller must hold the lock
        (forksafe.NotOwnedError)."""
        try:
            return self._handle.wait(timeout)
        except NotOwnedError:
            raise
        except FailedPreconditionError as e:
            raise _not_owned(e) from None

    def wait_for(self, predicate, timeout=None):
        """Waits until predicate() is true (checked under the lock) or `timeout` runs out;
        returns the predicate's last value."""
        result = predicate()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not result:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.wait(left)
            else:
                self.wait()
            result = predicate()
        return result

    def notify(self, n=1):
        try:
            self._handle.notify(n)
        except FailedPreconditionError as e:
            raise _not_owned(e) from None

    def notify_all(self):
        try:
            self._handle.notify_all()
        except FailedPreconditionError as e:
            raise _not_owned(e) from None


class Event(Shareable):
    """A flag processes can wait for (multiprocessing.Event)."""

    __slots__ = ("_handle",)

    def __init__(self, *, ctx=None):
        self._handle = _mp.Event()

    @staticmethod
    def _handle_type():
        return _mp.Event

    def is_set(self):
        return self._handle.is_set()

    def set(self):
        self._handle.set()

    def clear(self):
        self._handle.clear()

    def wait(self, timeout=None):
        """Waits until the flag is set (at most `timeout`); returns the flag."""
        return self._handle.wait(timeout)


class Barrier(Shareable):
    """A barrier for `parties` processes (multiprocessing.Barrier). `action` runs once per cycle
    in the process that arrives last; it crosses processes by name, like a Process target."""

    __slots__ = ("_handle", "_action")

    def __init__(self, parties, action=None, timeout=None, *, ctx=None):
        self._action = action
        self._handle = _mp.Barrier(parties, action, timeout)

    @staticmethod
    def _handle_type():
        return _mp.Barrier

    def _extra(self):
        return self._action

    @classmethod
    def _rebuild(cls, handle, action):
        obj = cls.__new__(cls)
        obj._action = action
        obj._handle = _mp._barrier_with_action(handle, action) if action is not None else handle
        return obj

    def wait(self, timeout=None):
        """Waits for the other parties; returns this caller's index in [0, parties). Raises
        threading.BrokenBarrierError when the barrier is or becomes broken (a timeout breaks it)."""
        try:
            return self._handle.wait(timeout)
        except (FailedPreconditionError, DeadlineExceededError) as e:
            raise threading.BrokenBarrierError(str(e)) from None

    def reset(self):
        self._handle.reset()

    def abort(self):
        self._handle.abort()

    @property
    def parties(self):
        return self._handle.parties

    @property
    def n_waiting(self):
        return self._handle.n_waiting

    @property
    def broken(self):
        return self._handle.broken
