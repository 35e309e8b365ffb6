"""Queue, SimpleQueue and JoinableQueue between processes (forksafe's C++ mp/queue.h).

What differs from multiprocessing's queues (and the seeds' caveats that do not apply):
- No feeder thread: put() returns once the item is in shared memory. Nothing is lost when the
  putting process exits right after, and a process that put items exits at once (no
  "joining processes that use queues" deadlock; join_thread and cancel_join_thread are no-ops
  kept for compatibility).
- numpy arrays and torch tensors in an item cross through shared memory, not as pickled bytes
  (see reduction.py); the queue holds a reference to that memory until the item is got.
- A process killed while holding the queue's lock does not wedge it.
Empty and Full are queue.Empty and queue.Full, as in multiprocessing.
"""

from queue import Empty, Full  # noqa: F401 (multiprocessing.queues has them too)

from .. import _forksafe
from ..errors import FailedPreconditionError, OverReleasedError, ResourceExhaustedError
from .reduction import Shareable, close_fds, dumps, loads

_mp = _forksafe.mp

__all__ = ["Queue", "SimpleQueue", "JoinableQueue"]


# The shared ring of a Queue made without ring_bytes: 64 MiB of address space, memory only for
# what it holds (a ring this large gives the pages of got messages back: mp/queue.cc), so that a
# program that puts its whole input before anything gets it (a million small items, a few
# hundred lists of 200 KiB) does not wait, as with multiprocessing's queue. Where the system
# cannot promise 64 MiB (a small container, RLIMIT_FSIZE), 1 MiB.
_DEFAULT_RING_BYTES = 64 << 20
_SMALL_RING_BYTES = 1 << 20


class Queue(Shareable):
    """A FIFO queue between processes (multiprocessing.Queue). ``maxsize <= 0``: no limit but
    the shared ring's size (``ring_bytes``; by default 64 MiB, of which only what the queue
    holds is memory; items over a quarter of it go out of band)."""

    __slots__ = ("_handle", "__weakref__")

    def __init__(self, maxsize=0, *, ctx=None, ring_bytes=None):
        if ring_bytes is not None:
            self._handle = _mp.Queue(maxsize, ring_bytes)
            return
        try:
            self._handle = _mp.Queue(maxsize, _DEFAULT_RING_BYTES)
        except ResourceExhaustedError:
            self._handle = _mp.Queue(maxsize, _SMALL_RING_BYTES)

    @staticmethod
    def _handle_type():
        return _mp.Queue

    def put(self, obj, block=True, timeout=None):
        """Puts `obj`; waits up to `timeout` for room when full (block=True), else queue.Full."""
        data, tensors, fds = dumps(obj)
        try:
            self._handle.put(data, tensors, fds, block, timeout if block else None)
        finally:
            close_fds(fds)

    def get(self, block=True, timeout=None):
        """Removes and returns the oldest item; queue.Empty when there is none in time. A
        blocking get on an empty queue waits with the GIL released, spinning first for as long
        as the queue's adaptive rule says (mp/internal/queue_spin.h), so that a reply that comes
        soon costs no wake-up."""
        data, tensors, fds = self._handle.get(block, timeout if block else None)
        return loads(data, tensors, fds)

    def put_nowait(self, obj):
        return self.put(obj, False)

    def get_nowait(self):
        return self.get(False)

    def qsize(self):
        """The number of items now (a snapshot)."""
        return self._handle.qsize()

    def empty(self):
        return self._handle.empty()

    def full(self):
        return self._handle.full()

    def close(self):
        """Closes this process's handle; later calls here raise forksafe.ClosedError."""
        self._handle.close()

    def join_thread(self):
        """No-op: there is no feeder thread to join."""

    def cancel_join_thread(self):
        """No-op: there is no feeder thread; nothing put can be lost at exit."""


class SimpleQueue(Queue):
    """multiprocessing.SimpleQueue: put, get, empty, close."""

    __slots__ = ()

    def __init__(self, *, ctx=None):
        super().__init__(0, ctx=ctx)

    def get(self):
        return super().get(True, None)

    def put(self, obj):
        return super().put(obj, True, None)


class JoinableQueue(Queue):
    """A Queue whose consumers call task_done() per item; join() waits until all are done."""

    __slots__ = ()

    def task_done(self):
        """Marks one got item as processed (ValueError when called more times than put)."""
        try:
            self._handle.task_done()
        except FailedPreconditionError as e:
            raise OverReleasedError(f"task_done() called too many times: {e.message}") from None

    def join(self, timeout=None):
        """Blocks until every item put has been task_done() (None, as multiprocessing's). With a
        timeout (forksafe's): returns False when it ran out, True otherwise."""
        done = self._handle.join(timeout)
        return None if timeout is None else done
