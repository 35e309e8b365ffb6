"""forksafe: a fork-safe runtime for Python programs and the frameworks they drive.

Importing forksafe is enough to make every fork of the process safe, os.fork() included and
forks made by other libraries: forksafe's at-fork handlers (one registry per process, shared with
any framework in the process that embeds libforksafe.so) drain its thread pools, quiesce oneTBB
and OpenMP (a torch program's children can run intra-op regions again), hold the GIL across the
fork as the framework lock (taken last, given back first) and reset the child's default device
to the CPU. See docs/python.md.

    import forksafe
    forksafe.fork_report()      # what happened during the last fork
    with forksafe.ThreadPool(4) as pool:
        print(pool.submit(pow, 2, 10).result())
"""

import atexit as _atexit
import weakref as _weakref

from . import _forksafe
from .errors import *  # noqa: F401,F403 (the exception classes are part of the package's API)
from .errors import BY_CODE as _BY_CODE
from .errors import __all__ as _errors_all

__version__ = _forksafe.version()

_forksafe._set_error_classes(dict(_BY_CODE))
_missing = set(_forksafe.error_code_names()) - set(_BY_CODE)
if _missing:  # a libforksafe.so newer than this package
    raise ImportError(f"forksafe {__version__}: no exception class for the error codes {_missing}")

# The GIL becomes the framework lock, unless a framework in this process set its own.
_forksafe.install_gil_framework_lock()
# OpenMP runtimes loaded before forksafe (torch's libgomp, say) are quiesced before every fork.
_forksafe.install_openmp_fork_handler()
_forksafe.order_fork_handlers_after_openmp()

# forksafe.Tensor (the C++ device::Tensor): numpy and torch see it without a copy, through the
# buffer protocol (np.asarray(t), memoryview(t); CPU tensors) and DLPack (torch.from_dlpack(t),
# np.from_dlpack(t)); from_dlpack(x) wraps a numpy array's or torch tensor's memory likewise.
Tensor = _forksafe.Tensor
from_dlpack = _forksafe.from_dlpack

_pools = _weakref.WeakSet()


class ThreadPool:
    """A fork-safe pool of threads running Python callables (forksafe's C++ ThreadPool).

    Before every fork of the process the pool's running tasks finish (within ``drain_deadline``
    seconds), queued tasks stay with the parent and run after the fork, and the child gets an
    empty pool that starts threads on first use. ``num_threads=0`` means the CPUs this process
    may use (affinity, cgroup quota, FORKSAFE_NUM_THREADS, OMP_NUM_THREADS).
    """

    def __init__(self, num_threads=0, name="python", drain_deadline=2.0):
        self._pool = _forksafe.ThreadPool(num_threads, name, drain_deadline)
        _pools.add(self)

    def submit(self, fn, /, *args, **kwargs):
        """Queues fn(*args, **kwargs); returns a Future (result(timeout), exception(), done())."""
        return self._pool.submit(fn, *args, **kwargs)

    def map(self, fn, *iterables, timeout=None):
        """Like concurrent.futures' map: results in order; raises the first task's error."""
        futures = [self._pool.submit(fn, *args) for args in zip(*iterables)]
        return [f.result(timeout) for f in futures]

    def wait(self):
        """Blocks until no task is queued or running."""
        self._pool.wait()

    def close(self):
        """Runs what is queued, then stops the threads. Idempotent."""
        if not self._pool.closed:
            self._pool.close()

    @property
    def closed(self):
        return self._pool.closed

    @property
    def num_threads(self):
        return self._pool.num_threads

    @property
    def live_workers(self):
        return self._pool.live_workers

    @property
    def name(self):
        return self._pool.name

    def stats(self):
        """Counters: tasks_completed, forks_drained, drain_timeouts, rebuilt_in_child, ..."""
        return self._pool.stats()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        state = "closed" if self.closed else f"{self.num_threads} threads"
        return f"<forksafe.ThreadPool {self._pool.name if not self.closed else ''} {state}>"


def fork_report():
    """What happened during this process's last fork: a dict with fork_number, attempts,
    clean (nothing to report), events (kind, subsystem, detail) and text (for a log)."""
    return _forksafe.last_fork_report()


def fork_count():
    """Forks this process has made (its children's own forks are theirs)."""
    return _forksafe.fork_count()


def framework_lock():
    """Which lock is held across forks: "gil" (the default once forksafe is imported),
    "default" or "custom" (a framework in this process set its own)."""
    return _forksafe.framework_lock_kind()


def openmp_usable():
    """Whether OpenMP regions are safe to run in this process (False in a child whose parent
    forked in a state forksafe could not make safe; fork_report() says why)."""
    return _forksafe.openmp_usable()


def default_device():
    """The default device ("cpu", "sim:0", "cuda:0"); "cpu" in a forked child."""
    return _forksafe.default_device()


def set_default_device(device):
    """Sets the default device ("cpu", "sim", "sim:1", "cuda:0")."""
    _forksafe.set_default_device(device)


def rank_device(type):  # noqa: A002 - the device type, as in "cuda"
    """This rank's device of `type` ("cuda", "sim") under a launcher: index LOCAL_RANK modulo
    that type's visible devices; index 0 without a launcher (docs/cluster.md)."""
    return _forksafe.rank_device(type)


def available_devices():
    """Every device this process can use, as strings."""
    return _forksafe.available_devices()


def default_thread_count():
    """The CPUs this process may use (affinity, cgroup quota, FORKSAFE_NUM_THREADS,
    OMP_NUM_THREADS): the default size of a ThreadPool."""
    return _forksafe.default_thread_count()


@_atexit.register
def _at_exit():
    # Pools' threads run Python code: stop them while the interpreter can still run it. The GIL
    # stays the framework lock: once Python finalizes it holds nothing (python/gil_lock.h), and
    # swapping it while another thread forks would leave that fork without the GIL.
    for pool in list(_pools):
        try:
            pool.close()
        except Error:
            pass  # closed from one of its own tasks' threads: nothing to wait for here


__all__ = ["Tensor", "from_dlpack", "ThreadPool", "fork_report", "fork_count", "framework_lock", "openmp_usable",
           "default_device", "set_default_device", "rank_device", "available_devices",
           "default_thread_count",
           "__version__"] + list(_errors_all)
