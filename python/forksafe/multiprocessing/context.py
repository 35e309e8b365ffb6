"""Start methods and contexts: Process with fork, spawn and forkserver.

Processes are started by the standard library's machinery for each start method, so spawn and
forkserver children re-import ``__main__`` as Python users expect (functions defined in the main
script work as targets). What forksafe adds:
- fork: every fork of the process, os.fork() included, runs forksafe's at-fork protocol (pools
  drained, the GIL held as the framework lock, OpenMP quiesced, the child's device reset to the
  CPU): importing forksafe is what makes a forked child safe.
- spawn/forkserver: the Process's target and arguments are pickled by forksafe's pickler: numpy
  arrays and torch tensors cross through shared memory, forksafe's queues, locks and values as
  descriptors, and a target that cannot cross (a lambda, a local function) raises
  forksafe.InvalidArgumentError naming it, before any child starts.
"""

import multiprocessing as _stdlib
import os
from multiprocessing import context as _stdlib_context
from multiprocessing import process as _stdlib_process

from . import reduction

__all__ = ["Process", "ForkProcess", "SpawnProcess", "ForkServerProcess", "ForksafeContext",
           "get_context", "get_start_method", "set_start_method", "get_all_start_methods"]


class _ForksafeProcess:
    """What every forksafe Process adds to the standard library's."""

    def start(self):
        try:
            super().start()
        finally:
            reduction.close_pending_spawn_fds()

    def __reduce__(self):
        # Only spawn and forkserver pickle a Process (to start it). The stdlib's pickler meets it
        # first: the whole Process goes through forksafe's pickler in one piece (spawn_reduce),
        # where it reduces as any object with state does. So a Process reachable from its own
        # target or attributes is memoized, not pickled again (a RecursionError before), and a
        # subclass's __getstate__ / __setstate__ are honoured.
        if _stdlib_context.get_spawning_popen() is None:
            raise TypeError("a Process object is pickled only to start it (spawn, forkserver)")
        if reduction.in_spawn_reduce():
            return _new_process, (type(self),), self.__getstate__()
        return reduction.spawn_reduce(self)


def _new_process(cls):
    return cls.__new__(cls)


class ForkProcess(_ForksafeProcess, _stdlib_context.ForkProcess):
    """A Process started with fork (forksafe's at-fork protocol runs around it)."""


class SpawnProcess(_ForksafeProcess, _stdlib_context.SpawnProcess):
    """A Process started in a fresh interpreter; __main__ is re-imported there."""


class ForkServerProcess(_ForksafeProcess, _stdlib_context.ForkServerProcess):
    """A Process forked from the fork server (started on first use)."""


# multiprocessing.context's names that programs and reducers import from it.
BaseContext = _stdlib_context.BaseContext
ProcessError = _stdlib_context.ProcessError
BufferTooShort = _stdlib_context.BufferTooShort
TimeoutError = _stdlib_context.TimeoutError
AuthenticationError = _stdlib_context.AuthenticationError
assert_spawning = _stdlib_context.assert_spawning
get_spawning_popen = _stdlib_context.get_spawning_popen
set_spawning_popen = _stdlib_context.set_spawning_popen

_PROCESS_CLASSES = {"fork": ForkProcess, "spawn": SpawnProcess, "forkserver": ForkServerProcess}


class ForksafeContext(_stdlib_context.BaseContext):
    """A start method and everything made with it: multiprocessing's context API. A
    multiprocessing.context.BaseContext, so that code that checks for one (torch's DataLoader
    with ``multiprocessing_context=``) takes it."""

    def __init__(self, method):
        if method not in _PROCESS_CLASSES:
            raise ValueError(f"cannot find context for {method!r}: use one of "
                             f"{', '.join(_PROCESS_CLASSES)}")
        self._name = method
        self.Process = _PROCESS_CLASSES[method]
        self._stdlib_ctx = _stdlib.get_context(method)

    def get_start_method(self, allow_none=False):
        return self._name

    def get_context(self, method=None):
        """This context (method None, as multiprocessing's concrete contexts), or the one of
        `method`."""
        return self if method is None else _default.get_context(method)

    def get_all_start_methods(self):
        return get_all_start_methods()

    def set_start_method(self, method, force=False):
        raise ValueError(f"cannot set start method of concrete context (this is the "
                         f"{self._name!r} context): call forksafe.multiprocessing."
                         "set_start_method(), or use get_context(method)")

    # ---- the objects a context makes ---------------------------------------------------------
    def Queue(self, maxsize=0):
        from .queues import Queue
        return Queue(maxsize, ctx=self)

    def SimpleQueue(self):
        from .queues import SimpleQueue
        return SimpleQueue(ctx=self)

    def JoinableQueue(self, maxsize=0):
        from .queues import JoinableQueue
        return JoinableQueue(maxsize, ctx=self)

    def Pipe(self, duplex=True):
        from .connection import Pipe
        return Pipe(duplex)

    def Lock(self):
        from .synchronize import Lock
        return Lock(ctx=self)

    def RLock(self):
        from .synchronize import RLock
        return RLock(ctx=self)

    def Semaphore(self, value=1):
        from .synchronize import Semaphore
        return Semaphore(value, ctx=self)

    def BoundedSemaphore(self, value=1):
        from .synchronize import BoundedSemaphore
        return BoundedSemaphore(value, ctx=self)

    def Condition(self, lock=None):
        from .synchronize import Condition
        return Condition(lock, ctx=self)

    def Event(self):
        from .synchronize import Event
        return Event(ctx=self)

    def Barrier(self, parties, action=None, timeout=None):
        from .synchronize import Barrier
        return Barrier(parties, action, timeout, ctx=self)

    def Value(self, typecode_or_type, *args, lock=True):
        from .sharedctypes import Value
        return Value(typecode_or_type, *args, lock=lock, ctx=self)

    def Array(self, typecode_or_type, size_or_initializer, *, lock=True):
        from .sharedctypes import Array
        return Array(typecode_or_type, size_or_initializer, lock=lock, ctx=self)

    def RawValue(self, typecode_or_type, *args):
        from .sharedctypes import RawValue
        return RawValue(typecode_or_type, *args)

    def RawArray(self, typecode_or_type, size_or_initializer):
        from .sharedctypes import RawArray
        return RawArray(typecode_or_type, size_or_initializer)

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None):
        from .pool import Pool
        return Pool(processes, initializer, initargs, maxtasksperchild, context=self)

    def Manager(self):
        """A started SyncManager (the standard library's: dict, list, Namespace, Queue, ...),
        its server process started with this context's method."""
        from multiprocessing.managers import SyncManager
        m = SyncManager(ctx=self._stdlib_ctx)
        m.start()
        return m

    # ---- process utilities --------------------------------------------------------------------
    @staticmethod
    def current_process():
        return _stdlib_process.current_process()

    @staticmethod
    def parent_process():
        return _stdlib_process.parent_process()

    @staticmethod
    def active_children():
        return _stdlib_process.active_children()

    @staticmethod
    def cpu_count():
        return os.cpu_count() or 1

    @staticmethod
    def freeze_support():
        _stdlib.freeze_support()

    @staticmethod
    def get_logger():
        return _stdlib.get_logger()

    @staticmethod
    def log_to_stderr(level=None):
        return _stdlib.log_to_stderr(level)

    @staticmethod
    def set_executable(executable):
        _stdlib.set_executable(executable)

    def set_forkserver_preload(self, module_names):
        _stdlib.set_forkserver_preload(module_names)

    @property
    def reducer(self):
        """multiprocessing.reduction (ForkingPickler, register): a reducer registered there is
        used by forksafe's pickling too, for what forksafe does not take out of band."""
        import multiprocessing.reduction
        return multiprocessing.reduction

    @staticmethod
    def allow_connection_pickling():
        """No-op: forksafe's connections always cross processes."""


class _DefaultContext(ForksafeContext):
    """The module-level context: its start method is set once (set_start_method)."""

    def __init__(self):
        self._actual = None
        self._contexts = {}

    def _ctx(self):
        if self._actual is None:
            self._actual = self.get_context("fork")  # multiprocessing's default on Linux
        return self._actual

    def __getattr__(self, name):  # Process, _stdlib_ctx of the chosen method
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._ctx(), name)

    @property
    def _name(self):  # the chosen method's (BaseContext has a _name of None)
        return self._ctx()._name

    def get_context(self, method=None):
        if method is None:
            return self._ctx()
        if method not in self._contexts:
            self._contexts[method] = ForksafeContext(method)
        return self._contexts[method]

    def get_start_method(self, allow_none=False):
        if self._actual is None and allow_none:
            return None
        return self._ctx()._name

    def set_start_method(self, method, force=False):
        if self._actual is not None and not force:
            raise RuntimeError("context has already been set")
        if method is None and force:
            self._actual = None
            return
        self._actual = self.get_context(method)


_default = _DefaultContext()


class Process(_ForksafeProcess, _stdlib_process.BaseProcess):
    """A Process with the default start method (set_start_method; fork unless set). Subclass it
    and override run(), or pass target/args, as with multiprocessing.Process."""

    _start_method = None

    @staticmethod
    def _Popen(process_obj):
        return _default.get_context().Process._Popen(process_obj)

    @staticmethod
    def _after_fork():
        return _default.get_context().Process._after_fork()


def get_context(method=None):
    return _default.get_context(method)


def get_start_method(allow_none=False):
    return _default.get_start_method(allow_none)


def set_start_method(method, force=False):
    _default.set_start_method(method, force)


def get_all_start_methods():
    return ["fork", "spawn", "forkserver"]
