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

import os
import threading
import weakref
from queue import Empty, Full  # noqa: F401 (multiprocessing.queues has them too)

from .. import _forksafe
from ..errors import ClosedError, FailedPreconditionError, HandleClosedError, \
    OverReleasedError, ResourceExhaustedError
from .reduction import Shareable, close_fds, dumps, loads

_mp = _forksafe.mp

__all__ = ["Queue", "SimpleQueue", "JoinableQueue"]


# The shared ring of a Queue made without ring_bytes: 64 MiB of address space, memory only for
# what it holds (a ring this large gives the pages of got messages back: mp/queue.cc), so that a
# program that puts its whole input before anything gets it (a million small items, a few
# hundred lists of 200 KiB) does not wait, as with multiprocessing's queue. Where the system
# cannot promise 64 MiB (a small container, RLIMIT_FSIZE), 1 MiB, then 64 KiB (a file size limit
# of 1 MiB: the ring's segment has a header too).
_DEFAULT_RING_BYTES = 64 << 20
_SMALLER_RING_BYTES = (1 << 20, 64 << 10)


class Queue(Shareable):
    """A FIFO queue between processes (multiprocessing.Queue). ``maxsize <= 0``: no limit but
    the shared ring's size (``ring_bytes``; by default 64 MiB, of which only what the queue
    holds is memory; items over a quarter of it go out of band)."""

    __slots__ = ("_handle", "_reader_end", "__weakref__")

    def __init__(self, maxsize=0, *, ctx=None, ring_bytes=None):
        if ring_bytes is not None:
            self._handle = _mp.Queue(maxsize, ring_bytes)
            return
        try:
            self._handle = _mp.Queue(maxsize, _DEFAULT_RING_BYTES)
            return
        except ResourceExhaustedError:
            pass
        for ring in _SMALLER_RING_BYTES[:-1]:
            try:
                self._handle = _mp.Queue(maxsize, ring)
                return
            except ResourceExhaustedError:
                pass
        self._handle = _mp.Queue(maxsize, _SMALLER_RING_BYTES[-1])

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

    @property
    def _reader(self):
        # The queue's reading end as the standard library's own code uses it (see _QueueReader);
        # made on first use, one per queue object.
        r = getattr(self, "_reader_end", None)
        if r is None or r._pid != os.getpid():  # none yet, or a forked parent's (no watcher)
            r = self._reader_end = _QueueReader(self._handle)
        return r

    @property
    def _writer(self):
        # The writing end as multiprocessing's Pool uses it (_writer.send, _writer.close).
        return _QueueWriter(self)

    @property
    def _rlock(self):
        # What multiprocessing's Pool takes while it drains a queue it terminates: nothing to
        # hold here (a get takes the queue's own lock), so a lock of this call's own.
        return threading.Lock()

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


class _WatchState:
    """What a _QueueReader shares with its watcher thread."""

    __slots__ = ("r", "w", "lock", "marked", "taken", "stop", "__weakref__")

    def __init__(self):
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.lock = threading.Lock()
        self.marked = False  # a byte is in the pipe (under lock)
        self.taken = threading.Event()  # recv() took a message: look again
        self.stop = False  # set: the watcher ends; once it has, the pipe is closed (under lock)
        _watching.add(self)

    def close_pipe(self):
        # Forgotten first, then closed: os.close lets go of the GIL, and a fork in between must
        # not leave the child a number that may be reused by then (its hook closes what is here).
        with self.lock:
            r, w = self.r, self.w
            self.r = self.w = -1
        if r >= 0:
            os.close(w)
            os.close(r)

    def drain(self):
        try:
            while os.read(self.r, 64):
                pass
        except BlockingIOError:
            pass


# The watchers' states of this process. A forked child has none of their threads: it closes
# their pipes, and a queue's _reader there is made anew.
_watching = weakref.WeakSet()


def _close_inherited_pipes():
    for st in list(_watching):
        st.stop = True
        st.lock = threading.Lock()  # the parent's may have been held by another thread
        st.close_pipe()


os.register_at_fork(after_in_child=_close_inherited_pipes)

_WATCH_SLICE = 0.5  # how often a watcher looks whether its reader or queue is gone (s)


def _watch(handle, st):
    # The watcher thread: makes st.r readable while the queue holds a message, until the queue
    # is closed or its reader dropped; then it closes the pipe (only it writes there).
    try:
        while not st.stop:
            if not handle.poll(_WATCH_SLICE):
                continue
            with st.lock:
                if not st.marked and handle.qsize() > 0:
                    os.write(st.w, b"\0")
                    st.marked = True
            while not st.taken.wait(_WATCH_SLICE):
                if st.stop:
                    return
                handle.qsize()  # ClosedError once the queue is closed
            st.taken.clear()
    except ClosedError:
        pass
    finally:
        st.stop = True
        st.close_pipe()


class _QueueReader:
    """A queue's reading end as multiprocessing's own code uses a queue's ``_reader``:
    concurrent.futures' ProcessPoolExecutor, given a forksafe context, waits on its result
    queue's ``_reader`` with multiprocessing.connection.wait and then calls ``recv()``.

    ``fileno()`` is a pipe that a watcher thread makes readable while the queue holds a message
    (C++ Queue::poll, which takes nothing); ``recv()`` gets the oldest message. As with a pipe
    that several processes read, another getter may take the message between the wait and the
    recv, which then waits for the next one. The watcher ends within half a second of the
    queue's close() or of the reader being dropped."""

    __slots__ = ("_handle", "_st", "_pid", "__weakref__")

    def __init__(self, handle):
        self._handle = handle
        self._pid = os.getpid()
        self._st = _WatchState()
        threading.Thread(target=_watch, args=(handle, self._st), name="forksafe-queue-reader",
                         daemon=True).start()

    def __del__(self):
        st = getattr(self, "_st", None)
        if st is not None:
            st.stop = True
            st.taken.set()

    def fileno(self):
        """A descriptor that polls readable while the queue holds a message."""
        if self._st.stop:
            raise HandleClosedError("handle is closed: this queue reader was closed, or its "
                                    "queue was; use the queue's get()", "closed")
        return self._st.r

    def poll(self, timeout=0.0):
        """True when a message is in the queue, waiting up to `timeout` (None: forever)."""
        return self._handle.poll(timeout)

    def recv(self):
        """Gets the oldest message (waits for one)."""
        data, tensors, fds = self._handle.get(True, None)
        st = self._st
        with st.lock:
            if st.r >= 0:
                st.drain()
            st.marked = False
        st.taken.set()
        return loads(data, tensors, fds)

    def close(self):
        """Stops watching (the queue stays open)."""
        self._st.stop = True
        self._st.taken.set()


class _QueueWriter:
    """A queue's writing end as multiprocessing's Pool uses a SimpleQueue's ``_writer``."""

    __slots__ = ("_queue",)

    def __init__(self, queue):
        self._queue = queue

    def send(self, obj):
        """Puts `obj` (waits for room)."""
        self._queue.put(obj)

    def close(self):
        """No-op: the queue stays open (a Pool's worker closes the end it does not use)."""
