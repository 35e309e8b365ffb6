"""forksafe.multiprocessing: a drop-in for multiprocessing and torch.multiprocessing.

    import forksafe.multiprocessing as mp      # instead of: import torch.multiprocessing as mp

    if __name__ == "__main__":
        mp.set_start_method("spawn")
        q = mp.Queue()
        p = mp.Process(target=worker, args=(q,))
        p.start(); print(q.get()); p.join()

Everything is multiprocessing's API (Process with fork/spawn/forkserver, Pool, Queue,
SimpleQueue, JoinableQueue, Pipe, Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event,
Barrier, Value, Array, Manager, contexts) plus torch.multiprocessing's (spawn, start_processes,
ProcessContext, ProcessRaisedException, ProcessExitedException, the sharing strategies). The
machinery underneath is forksafe's C++ mp layer: queues without feeder threads, locks robust on
owner death, a Pool that fails a dead worker's task instead of hanging, numpy arrays and torch
tensors that cross processes through shared memory, and every fork covered by forksafe's at-fork
protocol. docs/python.md lists what differs from multiprocessing and torch.
"""

import multiprocessing as _stdlib

import forksafe as _forksafe_package  # noqa: F401 (installs the at-fork protocol and the GIL lock)

from .. import _forksafe
from .connection import Connection, Pipe
from .launch import LaunchInfo, launch_info
from .context import (ForkProcess, ForkServerProcess, ForksafeContext, Process, SpawnProcess,
                      get_all_start_methods, get_context, get_start_method, set_start_method)
from .context import _default
from .pool import Pool
from .queues import JoinableQueue, Queue, SimpleQueue
from .reduction import is_shared, share_memory, shared_ndarray
from .sharedctypes import Array, RawArray, RawValue, Value
from .spawn import (ProcessContext, ProcessException, ProcessExitedException,
                    ProcessRaisedException, spawn, start_processes)
from .synchronize import Barrier, BoundedSemaphore, Condition, Event, Lock, RLock, Semaphore
from . import reduction as reductions  # torch.multiprocessing.reductions' place

# multiprocessing's exceptions, for `except mp.TimeoutError` and friends.
ProcessError = _stdlib.ProcessError
BufferTooShort = _stdlib.BufferTooShort
TimeoutError = _stdlib.TimeoutError
AuthenticationError = _stdlib.AuthenticationError

current_process = _stdlib.current_process
parent_process = _stdlib.parent_process
active_children = _stdlib.active_children
freeze_support = _stdlib.freeze_support
get_logger = _stdlib.get_logger
log_to_stderr = _stdlib.log_to_stderr
set_executable = _stdlib.set_executable
set_forkserver_preload = _stdlib.set_forkserver_preload
# multiprocessing's modules and constants, under their usual names: as attributes and as
# modules (`import forksafe.multiprocessing.util`, `from ....util import Finalize`).
reducer = _stdlib.reducer


def _alias_stdlib_modules(names):
    import importlib
    import sys
    for name in names:
        module = importlib.import_module("multiprocessing." + name)
        sys.modules.setdefault(f"{__name__}.{name}", module)
        globals()[name] = module


_alias_stdlib_modules(("util", "process", "forkserver", "resource_tracker", "resource_sharer",
                       "heap"))
SUBDEBUG = _stdlib.SUBDEBUG
SUBWARNING = _stdlib.SUBWARNING
# torch.multiprocessing's older name of ProcessContext.
SpawnContext = ProcessContext


def init_reductions():
    """torch.multiprocessing.init_reductions: a no-op here (forksafe's pickling is always on)."""


def cpu_count():
    """The number of CPUs in the system (multiprocessing.cpu_count)."""
    return _stdlib.cpu_count()


def Manager():
    """A started SyncManager (dict, list, Namespace, Queue, Lock, Value, ...) whose server
    process uses the current start method. Use it as a context manager to stop it."""
    return _default.get_context().Manager()


def allow_connection_pickling():
    """No-op: forksafe's connections always cross processes."""


def get_sharing_strategy():
    """The strategy for shared memory made from now on: "file_descriptor" (the default) or
    "file_system" (torch.multiprocessing's names)."""
    return _forksafe.mp.get_sharing_strategy()


def set_sharing_strategy(new_strategy):
    """Sets the sharing strategy (forksafe.InvalidArgumentError for an unknown one)."""
    _forksafe.mp.set_sharing_strategy(new_strategy)


def get_all_sharing_strategies():
    """{"file_descriptor", "file_system"}."""
    return set(_forksafe.mp.get_all_sharing_strategies())


__all__ = [
    "Array", "AuthenticationError", "Barrier", "BoundedSemaphore", "BufferTooShort",
    "Condition", "Connection", "Event", "ForkProcess", "ForkServerProcess", "ForksafeContext",
    "JoinableQueue", "LaunchInfo", "Lock", "Manager", "Pipe", "Pool", "Process", "ProcessContext",
    "ProcessError", "ProcessException", "ProcessExitedException", "ProcessRaisedException",
    "Queue", "RLock", "RawArray", "RawValue", "SUBDEBUG", "SUBWARNING", "Semaphore",
    "SimpleQueue", "SpawnContext", "SpawnProcess",
    "TimeoutError", "Value", "active_children", "allow_connection_pickling", "cpu_count",
    "current_process", "freeze_support", "get_all_sharing_strategies", "get_all_start_methods",
    "get_context", "get_logger", "get_sharing_strategy", "get_start_method", "init_reductions",
    "is_shared",
    "launch_info",
    "log_to_stderr", "parent_process", "set_executable", "set_forkserver_preload",
    "set_sharing_strategy", "set_start_method", "share_memory", "shared_ndarray", "spawn",
    "start_processes",
]
