"""Helpers of the Python package's tests (run by python/run_pytest.sh with /usr/bin/python3).

Every process a test starts ends: forked children are waited for with a deadline and killed by
their pid when they outlive it (the test then fails with a message), subprocesses run with a
timeout.
"""
import faulthandler
import os
import signal
import subprocess
import sys
import time
import traceback

import pytest


_fd = int(os.environ.get("FORKSAFE_PYTEST_STACKS_FD", "2"))
_WATCHDOG_OUT = os.fdopen(os.dup(_fd), "w")


@pytest.fixture(autouse=True)
def watchdog():
    """Every test ends within 120 s: past that every thread's stack is printed and the
    interpreter exits (a hang inside os.fork in the parent cannot be bounded any other way). The
    stacks go to the descriptor run_pytest.sh kept for them (pytest captures stderr)."""
    faulthandler.dump_traceback_later(120, exit=True, file=_WATCHDOG_OUT)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def no_children_left():
    """Every multiprocessing child a test started has ended when it returns: one still alive
    5 s after is killed by its pid and fails the test (a leaked Pool worker, say)."""
    import multiprocessing
    yield
    deadline = time.monotonic() + 5
    left = multiprocessing.active_children()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = multiprocessing.active_children()
    for p in left:
        p.kill()
        p.join()
    assert not left, f"processes left running by the test: {[(p.name, p.pid) for p in left]}"


def run_forked(fn, timeout=20.0):
    """Forks; the child runs fn() and exits with its return value (0 when None, 101 when it
    raised). Returns the child's exit code; fails the test if it outlives `timeout` seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 101
        try:
            code = int(fn() or 0)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return wait_child(pid, timeout)


def wait_child(pid, timeout):
    """Waits for child `pid` for at most `timeout` seconds; kills it and fails after that."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"child {pid} did not end within {timeout} s (killed)")
        time.sleep(0.002)


def run_python(code, timeout=120.0):
    """Runs `code` in a fresh /usr/bin/python3 with this package importable; returns
    (exit code, stdout + stderr). Fails the test if it outlives `timeout` seconds."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=dict(os.environ), start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the interpreter did not end within {timeout} s:\n{e.output}\n{e.stderr}")
    return done.returncode, done.stdout + done.stderr
