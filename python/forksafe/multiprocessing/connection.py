"""Pipe and Connection between processes (forksafe's C++ mp/connection.h).

Messages are objects pickled with their numpy arrays and torch tensors out of band (through
shared memory, see reduction.py); send_bytes/recv_bytes carry raw bytes. recv() on a connection
whose other end is closed raises EOFError (forksafe.ClosedError is one).
"""

from multiprocessing.connection import Client, Listener, wait  # noqa: F401 (their names here)

from .. import _forksafe
from ..errors import ClosedError, HandleClosedError, PeerClosedError
from .reduction import Shareable, close_fds, dumps, loads

_mp = _forksafe.mp

# wait() takes forksafe's connections too (it selects on fileno()); Listener and Client are
# multiprocessing's own (sockets between unrelated processes), kept under their usual names.
__all__ = ["Client", "Connection", "Listener", "Pipe", "wait"]


class Connection(Shareable):
    """One end of a Pipe (multiprocessing.connection.Connection)."""

    __slots__ = ("_handle", "__weakref__")

    @staticmethod
    def _handle_type():
        return _mp.Connection

    def send(self, obj):
        """Sends `obj` as one message."""
        data, tensors, fds = dumps(obj)
        try:
            self._handle.send(data, tensors, fds)
        except ClosedError as e:
            raise _closed_on_send(self, e) from None
        finally:
            close_fds(fds)

    def _send_dumped(self, data, tensors, fds):
        # A message pickled beforehand by dumps(); its descriptors stay the caller's to close.
        try:
            self._handle.send(data, tensors, fds)
        except ClosedError as e:
            raise _closed_on_send(self, e) from None

    def recv(self):
        """Receives one object; blocks until a message arrives (EOFError at end of stream)."""
        try:
            data, tensors, fds = self._handle.recv(None)
        except ClosedError:
            _raise_if_own_closed(self)
            raise
        return loads(data, tensors, fds)

    def send_bytes(self, buf, offset=0, size=None):
        """Sends bytes (a slice of a bytes-like object) as one message."""
        view = memoryview(buf).cast("B")
        if offset < 0 or offset > len(view):
            raise ValueError("offset is negative or past the end of the buffer")
        end = len(view) if size is None else offset + size
        if size is not None and (size < 0 or end > len(view)):
            raise ValueError("size is negative or the slice ends past the buffer")
        try:
            self._handle.send_bytes(bytes(view[offset:end]))
        except ClosedError as e:
            raise _closed_on_send(self, e) from None

    def recv_bytes(self, maxlength=None):
        """Receives one message's bytes; OSError when it is longer than `maxlength`."""
        data = self._recv_bytes()
        if maxlength is not None and len(data) > maxlength:
            raise OSError(f"bad message length: {len(data)} bytes, maxlength {maxlength}")
        return data

    def recv_bytes_into(self, buf, offset=0):
        """Receives one message's bytes into `buf` at `offset`; returns their count."""
        data = self._recv_bytes()
        view = memoryview(buf).cast("B")
        if offset + len(data) > len(view):
            from multiprocessing import BufferTooShort
            raise BufferTooShort(data)
        view[offset:offset + len(data)] = data
        return len(data)

    def _recv_bytes(self):
        try:
            return self._handle.recv_bytes()
        except ClosedError:
            _raise_if_own_closed(self)
            raise

    def poll(self, timeout=0.0):
        """True when a message (or end of stream) can be read, waiting up to `timeout` (None:
        forever)."""
        try:
            return self._handle.poll(timeout)
        except ClosedError:
            _raise_if_own_closed(self)
            raise

    def fileno(self):
        """The descriptor to wait on (multiprocessing.connection.wait, selectors)."""
        _raise_if_own_closed(self)
        return self._handle.fileno()

    def close(self):
        self._handle.close()

    @property
    def closed(self):
        return self._handle.closed

    @property
    def readable(self):
        return self._handle.readable

    @property
    def writable(self):
        return self._handle.writable

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _raise_if_own_closed(conn):
    # This end was closed by close(): multiprocessing raises OSError("handle is closed").
    if conn._handle.closed:
        raise HandleClosedError("handle is closed: this Connection was closed by close(); "
                                "use the other end, or a new Pipe()", "closed") from None


def _closed_on_send(conn, e):
    # This end closed: HandleClosedError (an OSError too). The peer closed its end: a
    # BrokenPipeError too, as multiprocessing raises.
    _raise_if_own_closed(conn)
    if isinstance(e, PeerClosedError):
        return e
    return PeerClosedError(e.message)


def _wrap(handle):
    c = Connection.__new__(Connection)
    c._handle = handle
    return c


def Pipe(duplex=True):
    """Two connected ends. duplex=False: the first only receives, the second only sends."""
    a, b = _mp.Pipe(duplex)
    return _wrap(a), _wrap(b)
