"""The fork protocol in Python (python/gil_lock.h): the GIL as the framework lock, every fork
covered (os.fork() from any thread), CPython's own fork bookkeeping intact, and no deadlock
between the GIL and the drain of forksafe's pools."""
import gc
import os
import threading
import time

import pytest

import forksafe
from forksafe import _forksafe
from conftest import run_forked, run_python


def events(report, *kinds):
    return [e for e in report["events"] if e["kind"] in kinds]


def test_os_fork_lets_a_pool_task_that_needs_the_gil_finish_before_the_fork():
    # The task sleeps (without the GIL), then needs the GIL to finish: os.fork() holds it as the
    # fork begins. The GIL is let go during the drain and taken back last, so the task finishes
    # before the fork instead of the drain running into its deadline (10 s here).
    state = {"done": False}
    started = threading.Event()

    def task():
        started.set()
        time.sleep(1.0)  # long enough that the fork starts while it runs
        x = sum(range(10000))  # Python code: needs the GIL
        state["done"] = True
        return x

    with forksafe.ThreadPool(1, name="gil_task", drain_deadline=10.0) as pool:
        future = pool.submit(task)
        assert started.wait(10)
        t0 = time.monotonic()
        code = run_forked(lambda: 0 if state["done"] else 3)
        took = time.monotonic() - t0
        report = forksafe.fork_report()
        assert code == 0, "the fork happened while the task was still running"
        assert not events(report, "drain_deadline_exceeded", "framework_lock_timeout"), report["text"]
        assert pool.stats()["drain_timeouts"] == 0
        assert pool.stats()["forks_drained"] >= 1
        assert future.result(10) == sum(range(10000))
        assert took < 9.0, f"the fork waited {took:.1f} s: it ran into the drain deadline"


def test_cpython_fork_hooks_and_the_child_interpreter_still_work():
    calls = []
    os.register_at_fork(before=lambda: calls.append("before"),
                        after_in_parent=lambda: calls.append("parent"),
                        after_in_child=lambda: calls.append("child"))

    def child():
        if calls[-2:] != ["before", "child"]:
            return 2
        # Threads work in the child (CPython's after-fork bookkeeping ran).
        out = []
        t = threading.Thread(target=out.append, args=(1,))
        t.start()
        t.join(10)
        if out != [1]:
            return 3
        # A forksafe pool works in the child, rebuilt.
        with forksafe.ThreadPool(2) as p:
            if p.submit(pow, 3, 3).result(10) != 27:
                return 4
        return 0 if forksafe.framework_lock() == "gil" else 5

    assert run_forked(child) == 0
    assert calls[-2:] == ["before", "parent"]


def test_a_fork_from_a_python_thread_while_the_main_thread_runs_python():
    stop = threading.Event()
    codes = []

    def forker():
        try:
            for _ in range(20):
                codes.append(run_forked(lambda: 0 if sum(range(1000)) == 499500 else 1))
        finally:
            stop.set()

    t = threading.Thread(target=forker)
    t.start()
    n = 0
    while not stop.is_set():
        n += sum(range(100))  # the main thread keeps the GIL busy
    t.join(60)
    assert not t.is_alive()
    assert codes == [0] * 20


def test_forks_from_two_threads_at_once_with_a_busy_pool():
    with forksafe.ThreadPool(2, name="busy_python", drain_deadline=10.0) as pool:
        stop = threading.Event()

        def feed():
            while not stop.is_set():
                pool.submit(lambda: sum(range(2000)))
                time.sleep(0.0005)

        feeder = threading.Thread(target=feed)
        feeder.start()
        results = {0: [], 1: []}

        def forker(i):
            for _ in range(15):
                results[i].append(run_forked(lambda: 0 if pool.submit(int, "7").result(10) == 7 else 1))

        forkers = [threading.Thread(target=forker, args=(i,)) for i in (0, 1)]
        for f in forkers:
            f.start()
        for f in forkers:
            f.join(100)
        stop.set()
        feeder.join(30)
        assert not any(f.is_alive() for f in forkers) and not feeder.is_alive()
        assert results == {0: [0] * 15, 1: [0] * 15}
        assert pool.stats()["drain_timeouts"] == 0, "a fork went ahead with a task in flight"


def test_queued_tasks_stay_with_the_parent_and_the_childs_pool_is_fresh():
    gate = threading.Event()
    ran = []
    with forksafe.ThreadPool(1, name="queued") as pool:
        blocker = pool.submit(gate.wait, 30)
        time.sleep(0.05)
        for i in range(50):
            pool.submit(ran.append, i)
        # The blocker is in flight: release it from a thread so that the drain can finish (the
        # queued tasks may start before the fork or not; what the child sees must not change).
        threading.Timer(0.1, gate.set).start()

        def child():
            seen = len(ran)
            if pool.submit(pow, 2, 5).result(10) != 32:  # starts the child's own worker
                return 3
            pool.wait()
            if len(ran) != seen:  # a parent task ran here
                return 2
            return 0 if pool.stats()["rebuilt_in_child"] == 1 else 4

        assert run_forked(child) == 0
        assert blocker.result(30) is True
        pool.wait()
        assert ran == list(range(50))


def test_the_childs_default_device_is_the_cpu():
    if "sim:0" not in forksafe.available_devices():
        pytest.skip("no simulated accelerator in this build")
    forksafe.set_default_device("sim:0")
    try:
        assert forksafe.default_device() == "sim:0"
        assert run_forked(lambda: 0 if forksafe.default_device() == "cpu" else 1) == 0
    finally:
        forksafe.set_default_device("cpu")


TORCH_FORKS = r"""
import os, sys, time
order = sys.argv[1] if len(sys.argv) > 1 else "%(order)s"
if order == "forksafe first":
    import forksafe, torch
else:
    import torch, forksafe
torch.set_num_threads(2)
assert float(torch.ones(1 << 21).exp().sum()) > 0  # an intra-op region (OpenMP)
pids = []
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        ok = float(torch.ones(1 << 21).mul(2).sum()) == 2.0 * (1 << 21)
        os._exit(0 if ok else 3)
    pids.append(pid)
deadline = time.monotonic() + 20
ran = hung = 0
for pid in pids:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ran += os.waitstatus_to_exitcode(status) == 0
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9); os.waitpid(pid, 0); hung += 1
            break
        time.sleep(0.01)
print(f"ran {ran} hung {hung}")
"""


@pytest.mark.parametrize("order", ["torch first", "forksafe first"])
def test_importing_forksafe_makes_torchs_forks_safe_for_openmp(order):
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch is not importable by /usr/bin/python3 (Debian's python3-torch)")
    code, out = run_python(TORCH_FORKS % {"order": order})
    assert code == 0, out
    assert "ran 5 hung 0" in out, out


@pytest.mark.parametrize("run_python", [False, True])
def test_a_fork_from_a_cpp_thread_takes_the_gil_and_the_child_runs_python(run_python):
    # A Python thread keeps running bytecode meanwhile (and asking for the GIL): the fork must wait
    # for the GIL; in the child CPython's bookkeeping has run, the GIL is free and fresh, and the
    # thread can take it and run Python.
    stop = threading.Event()
    spins = [0]

    def spin():
        while not stop.is_set():
            spins[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        for _ in range(5):
            assert _forksafe._fork_from_a_cpp_thread_for_test(run_python, 20.0) == 0
    finally:
        stop.set()
        t.join(10)
    assert spins[0] > 0
    report = forksafe.fork_report()
    assert not events(report, "framework_lock_timeout", "handler_threw"), report["text"]


def test_forksafe_calls_on_other_threads_never_wedge_a_fork():
    # While one thread forks (letting go of the GIL during prepare), others call into forksafe:
    # calls that wait for the registry's lock must release the GIL, or the fork could never take
    # it back (each of these hung for good before).
    stop = threading.Event()
    calls = [0]

    def poll():
        while not stop.is_set():
            forksafe.fork_report()
            forksafe.fork_count()
            forksafe._forksafe.handler_names()
            forksafe.default_device()
            with forksafe.ThreadPool(1, name="short") as p:
                p.submit(int).result(10)
            forksafe.Tensor.zeros([4])
            calls[0] += 1

    pollers = [threading.Thread(target=poll) for _ in range(2)]
    for p in pollers:
        p.start()
    try:
        codes = [run_forked(lambda: 0, timeout=30) for _ in range(30)]
    finally:
        stop.set()
        for p in pollers:
            p.join(30)
    assert not any(p.is_alive() for p in pollers)
    assert codes == [0] * 30
    assert calls[0] > 0


def test_a_fork_from_a_python_thread_that_released_the_gil():
    # C++ code on a Python thread forks with the GIL released: the child's thread takes the GIL
    # back where it released it (it hung there before: the child kept the GIL the fork took), also
    # while another thread keeps asking for the GIL (its drop request is copied into the child).
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(100))

    t = threading.Thread(target=spin)
    t.start()
    try:
        for _ in range(10):
            assert forksafe._forksafe._fork_with_the_gil_released_for_test(20.0) == 0
    finally:
        stop.set()
        t.join(10)


def test_a_parent_tasks_future_in_the_child_fails_instead_of_waiting_for_ever():
    gate = threading.Event()
    # drain_deadline=0: the fork does not wait for the running task, so `queued` cannot have run.
    with forksafe.ThreadPool(1, name="futures", drain_deadline=0.0) as pool:
        running = pool.submit(gate.wait, 30)
        queued = pool.submit(int, "5")

        def child():
            if queued.done():
                return 3
            try:
                queued.result()  # no timeout: it would wait for ever
            except forksafe.FailedPreconditionError as e:
                return 0 if "parent" in str(e) else 2
            return 1

        try:
            assert run_forked(child) == 0
        finally:
            gate.set()
        assert running.result(30) is True and queued.result(30) == 5


def test_closing_a_pool_from_its_own_task_is_an_error_and_dropping_it_there_is_safe():
    pool = forksafe.ThreadPool(1, name="self_close")
    with pytest.raises(forksafe.FailedPreconditionError, match="own tasks"):
        pool.submit(pool.close).result(10)
    holder = [pool]
    go, done = threading.Event(), threading.Event()

    def drop_last_reference():
        go.wait(10)  # until the main thread holds no reference of its own
        holder.clear()  # the last reference goes on the pool's own worker
        done.set()

    del pool
    f = holder[0].submit(drop_last_reference)
    go.set()
    assert done.wait(10)
    assert f.result(10) is None
    del f
    gc.collect()  # the pool object is gone; its threads end on a thread of their own
    with forksafe.ThreadPool(1) as other:
        assert other.submit(int, "3").result(10) == 3


_FORKS_WHILE_THREADS_SEND = r"""
import os, signal, sys, threading
import numpy as np
import torch
import forksafe.multiprocessing as mp

stop = False


def churn(i, q):
    while not stop:
        a = mp.shared_ndarray((1000,), np.float64)
        del a                                  # frees shared memory, GIL held by its caller
        t = torch.ones(1000 + i)
        t.share_memory_()
        del t
        q.put(torch.full((500 + i,), float(i)))  # a fresh tensor's move into shared memory
        q.get()


qs = [mp.Queue() for _ in range(3)]
threads = [threading.Thread(target=churn, args=(i, qs[i])) for i in range(3)]
for t in threads:
    t.start()
out = mp.Queue()
bad = []
for k in range(120):
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)  # a child that hangs ends by SIGALRM, not silently
        out.put(torch.full((3000,), 7.0))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        bad.append((k, status))
    elif float(out.get(timeout=10).sum()) != 21000.0:
        bad.append((k, "bad data"))
stop = True
for t in threads:
    t.join()
print("bad", bad)
sys.exit(1 if bad else 0)
"""


def test_forks_while_other_threads_free_and_send_shared_tensors():
    """120 os.fork()s while three threads make, free and send shared arrays and tensors. Each
    fork used to hang the parent for good (a thread freeing shared memory held the GIL and
    waited for the arena's lock, which the fork's prepare held while it waited for the GIL),
    and children hung on their first send (a lock of the sending threads, or the arena being
    made by one of them when the fork came, inherited as held)."""
    rc, out = run_python(_FORKS_WHILE_THREADS_SEND, timeout=100)
    assert rc == 0, out
