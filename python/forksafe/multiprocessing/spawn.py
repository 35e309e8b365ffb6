"""spawn() and start_processes(): torch.multiprocessing's way to run fn(i, *args) in nprocs
processes and get the first failure back as an exception.

A child that raises sends the exception's type, message and traceback text to the parent over
a forksafe Queue (no temporary files) and exits with code 1; ProcessContext.join() then
terminates the others (SIGTERM, then SIGKILL after a grace period) and raises
ProcessRaisedException carrying them. A child that dies otherwise (a signal, os._exit(3)) gives
ProcessExitedException with its exit code and signal name. Both are forksafe.ProcessFailedError,
and so forksafe.Error. When a launcher set TORCHELASTIC_ERROR_FILE (torchrun does), join() writes
the failure there in torchelastic's form before raising, so torchrun's summary shows the child's
traceback.

Each child gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT), nested inside the launcher that started this process: child i of
rank r of W is rank r*nprocs + i of W*nprocs (forksafe/mp/launch.h has the rule). So code written
for torchrun runs under spawn() on one machine. launch_env=False leaves the environment alone.
The variables are set in the child just before fn runs: under "spawn" and "forkserver" the
re-import of __main__ happens before, so read them in fn (as torchrun programs do in main()), not
at a module's top level. os.environ.update (putenv) in a forked child takes the C library's
environment lock: a thread of the parent calling setenv/putenv at the instant of the fork would
hang that child (the C++ spawn() avoids the lock: mp/internal/child.h).
"""

import os
import signal
import sys
import time
import traceback
from multiprocessing import connection as _stdlib_connection

from .. import _forksafe
from ..errors import InvalidArgumentError, ProcessFailedError
from .context import get_context
from .launch import launch_info
from .queues import SimpleQueue

__all__ = ["spawn", "start_processes", "ProcessContext", "ProcessException",
           "ProcessRaisedException", "ProcessExitedException"]


class ProcessException(ProcessFailedError):
    """A process of spawn()/start_processes() failed: error_index (its i), error_pid."""

    def __init__(self, msg, error_index, error_pid):
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = self.error_pid = error_pid

    def __str__(self):
        return self.msg

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """The child raised: exception_type (its class's qualified name), exception_message and
    traceback (the child's formatted traceback text)."""

    def __init__(self, msg, error_index, error_pid, exception_type="", exception_message="",
                 traceback_text=""):
        super().__init__(msg, error_index, error_pid)
        self.exception_type = exception_type
        self.exception_message = exception_message
        self.traceback = traceback_text

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid, self.exception_type,
                            self.exception_message, self.traceback)


class ProcessExitedException(ProcessException):
    """The child ended without raising: exit_code (negative: killed by a signal) and
    signal_name ("SIGKILL", or None for a plain exit, as in torch)."""

    def __init__(self, msg, error_index, error_pid, exit_code, signal_name=None):
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid, self.exit_code,
                            self.signal_name)


def _wrap(fn, i, args, error_queue, env=None):
    """A child's main: fn(i, *args) with `env` set; an exception goes to the parent, then exit
    code 1."""
    try:
        if env:
            os.environ.update(env)
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # the parent is ending us
    except Exception as e:  # as torch: sys.exit(n) is exit code n (ProcessExitedException)
        error_queue.put((i, f"{type(e).__module__}.{type(e).__qualname__}", str(e),
                         traceback.format_exc()))
        sys.stdout.flush()  # os._exit drops buffered output
        sys.stderr.flush()
        os._exit(1)


class ProcessContext:
    """The processes of one start_processes() call."""

    def __init__(self, processes, error_queue, grace_period=30.0):
        self.processes = processes
        self.error_queue = error_queue
        self.grace_period = grace_period
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}
        self._errors = {}

    def pids(self):
        return [p.pid for p in self.processes]

    def join(self, timeout=None):
        """Waits for the processes. Returns True once all exited successfully, False when
        `timeout` ran out first; raises ProcessRaisedException / ProcessExitedException for the
        first that failed (after ending the others)."""
        if not self.sentinels:
            return True
        ready = _stdlib_connection.wait(list(self.sentinels), timeout=timeout)
        failed = None
        for sentinel in ready:
            i = self.sentinels.pop(sentinel)
            p = self.processes[i]
            p.join()
            if p.exitcode != 0 and failed is None:
                failed = i
        if failed is None:
            return not self.sentinels
        self._end_others()
        self._drain_errors()
        p = self.processes[failed]
        if failed in self._errors:
            type_name, message, tb = self._errors[failed]
            msg = (f"\n\n-- Process {failed} terminated with the following error:\n{tb}")
            _forksafe.mp.record_failure_for_launcher("ProcessRaisedException", msg.strip(), tb)
            raise ProcessRaisedException(msg, failed, p.pid, type_name, message, tb)
        code = p.exitcode
        if code < 0:
            name = signal.Signals(-code).name
            error = ProcessExitedException(f"process {failed} terminated with signal {name}",
                                           failed, p.pid, code, name)
        else:
            error = ProcessExitedException(f"process {failed} terminated with exit code {code}",
                                           failed, p.pid, code)
        _forksafe.mp.record_failure_for_launcher("ProcessExitedException", str(error), "")
        raise error

    def _drain_errors(self):
        while not self.error_queue.empty():
            try:
                i, type_name, message, tb = self.error_queue.get()
            except Exception:
                return
            self._errors.setdefault(i, (type_name, message, tb))

    def _end_others(self):
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + self.grace_period
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join()
        self.sentinels.clear()


def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn",
                    launch_env=True):
    """Starts nprocs processes running fn(i, *args) with `start_method`. join=True waits for all
    (raising the first failure); join=False returns the ProcessContext. launch_env=False: the
    children do not get torchrun's variables."""
    return _start_processes(fn, args, nprocs, join, daemon, start_method, launch_env)


def _start_processes(fn, args, nprocs, join, daemon, start_method, launch_env):
    # Called by start_processes and spawn alike: a warning here names their caller's line
    # (stacklevel 3).
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, not {nprocs}")
    ctx = get_context(start_method)
    envs = [None] * nprocs
    if launch_env:
        try:
            info = launch_info()
        except InvalidArgumentError as e:
            # Variables no launcher would leave (WORLD_SIZE without RANK, ...): not a launch to
            # nest in. The children get the environment as it is, as torch's spawn gives it
            # (it used to refuse to start them).
            import warnings
            warnings.warn(f"spawn: the launcher's variables are incomplete ({e.message}); the "
                          "children get the environment unchanged", RuntimeWarning, stacklevel=3)
            info = None
        if info is not None:
            alone = not info.master_addr and info.world_size == 1
            port = _forksafe.mp.free_loopback_port() if alone else 0
            envs = [_forksafe.mp.spawn_child_environment(nprocs, i, port)
                    for i in range(nprocs)]
    error_queue = SimpleQueue()
    processes = []
    try:
        for i in range(nprocs):
            p = ctx.Process(target=_wrap, args=(fn, i, args, error_queue, envs[i]), daemon=daemon)
            p.start()
            processes.append(p)
    except BaseException:
        for p in processes:
            p.kill()
            p.join()
        raise
    context = ProcessContext(processes, error_queue)
    if not join:
        return context
    while not context.join():
        pass
    return None


def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn", launch_env=True):
    """torch.multiprocessing.spawn: start_processes with the spawn method by default."""
    return _start_processes(fn, args, nprocs, join, daemon, start_method, launch_env)
