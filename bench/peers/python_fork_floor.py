"""bench/peers/python_fork_floor.py: what one fork of a torch-importing interpreter costs (the
floor of the Python process-creation workloads, docs/peers.md "Python against Python").

    /usr/bin/python3 bench/peers/python_fork_floor.py [--forksafe]

Prints the median of 30 os.fork() + os._exit(0) + waitpid, and of 20 multiprocessing fork
Process start + join; --forksafe imports forksafe first (its at-fork protocol then runs).
"""
import os
import statistics
import sys
import time

import torch  # noqa: F401 (the interpreter's size is the point)

if "--forksafe" in sys.argv:
    import forksafe  # noqa: F401

import multiprocessing


def bare_fork():
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return time.perf_counter() - t0


def nothing():
    pass


def process_fork():
    t0 = time.perf_counter()
    p = multiprocessing.get_context("fork").Process(target=nothing)
    p.start()
    p.join()
    return time.perf_counter() - t0


print("bare fork + _exit + waitpid: median %.0f us" %
      (statistics.median(bare_fork() for _ in range(30)) * 1e6))
print("multiprocessing fork Process start + join: median %.0f us" %
      (statistics.median(process_fork() for _ in range(20)) * 1e6))
