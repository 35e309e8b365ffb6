"""forksafe.multiprocessing: processes, queues, pipes, locks, events, barriers, shared values.

Every test that starts a process bounds its wait (join with a timeout, get with a timeout) and
kills what it started when that runs out; conftest.py's watchdog ends the run past 120 s.
"""
import ctypes
import os
import pickle
import queue
import signal
import sys
import threading
import time

import pytest

import forksafe
import forksafe.multiprocessing as mp
from conftest import run_python

METHODS = ["fork", "spawn", "forkserver"]


def finish(procs, timeout=60):
    """Joins `procs`; kills (by pid) and fails on any that outlives `timeout`."""
    deadline = time.monotonic() + timeout
    stuck = []
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            stuck.append(p.pid)
            p.kill()
            p.join()
    assert not stuck, f"processes {stuck} did not end within {timeout} s"
    return [p.exitcode for p in procs]


# ---- targets (module level: spawn and forkserver import them by name) ------------------------

def put_hello(q, i):
    q.put(("hello", i, os.getpid()))


def echo_pipe(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            break
        conn.send(("echo", msg))
    conn.send_bytes(b"raw bytes")
    conn.close()


def count_under_lock(lock, counter, n):
    for _ in range(n):
        with lock:
            counter.value += 1


def die_holding(lock):
    lock.acquire()
    os._exit(7)


def wait_event_then_put(ev, q):
    q.put("waiting")
    q.put(ev.wait(30))


def barrier_party(barrier, q):
    q.put(barrier.wait(30))


def fill_values(v, a, raw):
    v.value = 2.5
    for i in range(len(a)):
        a[i] = a[i] * 10
    raw[0] = 99


def consume_joinable(q):
    while True:
        item = q.get(timeout=30)
        q.task_done()
        if item is None:
            return


def put_big_and_exit(q):
    q.put(b"x" * (4 << 20))  # out of band: bigger than a quarter of the ring
    os._exit(0)  # no atexit, no feeder thread to flush: the item is already in the queue


def notify_after(cond, flag):
    with cond:
        flag.value = 1
        cond.notify_all()


# ---- Process and contexts ---------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_process_and_queue_in_every_start_method(method):
    ctx = mp.get_context(method)
    assert ctx.get_start_method() == method
    q = ctx.Queue()
    procs = [ctx.Process(target=put_hello, args=(q, i)) for i in range(3)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=60)[:2] for _ in procs)
    assert finish(procs) == [0, 0, 0]
    assert got == [("hello", 0), ("hello", 1), ("hello", 2)]


class Doubler(mp.Process):
    def __init__(self, q, x):
        super().__init__()
        self.q, self.x = q, x

    def run(self):
        self.q.put(self.x * 2)


def test_a_process_subclass_runs_its_run_method():
    q = mp.Queue()
    p = Doubler(q, 21)
    p.start()
    assert q.get(timeout=30) == 42
    assert finish([p]) == [0]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_lambda_target_is_a_clear_error_before_any_child_starts(method):
    ctx = mp.get_context(method)
    p = ctx.Process(target=lambda: None)
    with pytest.raises(forksafe.InvalidArgumentError, match="lambda.*top level"):
        p.start()
    assert p.pid is None or not p.is_alive()


def test_start_methods_and_contexts():
    assert mp.get_all_start_methods() == ["fork", "spawn", "forkserver"]
    with pytest.raises(ValueError, match="cannot find context"):
        mp.get_context("threads")
    ctx = mp.get_context("spawn")
    assert ctx.Process is mp.SpawnProcess
    assert mp.get_context("fork").Process is mp.ForkProcess


def test_exit_codes_and_signals_are_reported():
    p = mp.Process(target=os._exit, args=(3,))
    p.start()
    assert finish([p]) == [3]
    p = mp.Process(target=time.sleep, args=(30,))
    p.start()
    p.terminate()
    assert finish([p]) == [-signal.SIGTERM]


# ---- Queue ------------------------------------------------------------------------------------

def test_queue_empty_full_and_sizes():
    q = mp.Queue(maxsize=2)
    assert q.empty() and q.qsize() == 0
    q.put(1)
    q.put_nowait({"two": [2]})
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.05)
    assert q.get() == 1
    assert q.get_nowait() == {"two": [2]}
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):  # a negative timeout is 0, as in multiprocessing
        q.get(timeout=-1)
    q.close()
    with pytest.raises(forksafe.ClosedError):
        q.put(1)
    with pytest.raises(ValueError):  # multiprocessing's type for a closed queue
        q.get(timeout=1)


def test_an_unbounded_queue_takes_its_whole_input_before_any_get():
    # multiprocessing's unbounded queue never blocks a put: a program may put its whole input
    # first. 200,000 small items and 100 lists of 200 KiB (a 1 MiB ring held 18,761 and 4).
    # The timeouts turn a regression into a failure, not a hang.
    q = mp.Queue()
    for i in range(200_000):
        q.put(i, True, 30)
    big = [0.5] * 25_000
    for _ in range(100):
        q.put(big, True, 30)
    assert q.qsize() == 200_100
    assert [q.get(True, 30) for _ in range(200_000)] == list(range(200_000))
    assert all(q.get(True, 30) == big for _ in range(100))
    assert q.empty()


def test_an_item_put_just_before_exit_is_not_lost():
    q = mp.Queue()
    p = mp.Process(target=put_big_and_exit, args=(q,))
    p.start()
    assert finish([p]) == [0]  # the child exited before anyone read the item
    assert q.get(timeout=10) == b"x" * (4 << 20)


def test_joinable_queue_join_waits_for_task_done():
    q = mp.JoinableQueue()
    p = mp.Process(target=consume_joinable, args=(q,))
    p.start()
    for i in range(5):
        q.put(i)
    q.put(None)
    assert q.join(timeout=30) is True
    assert finish([p]) == [0]
    with pytest.raises(ValueError, match="too many times"):
        q.task_done()


def test_simple_queue():
    q = mp.SimpleQueue()
    assert q.empty()
    q.put("a")
    assert not q.empty()
    assert q.get() == "a"


def test_forksafe_objects_cannot_be_pickled_outside_forksafe():
    with pytest.raises(forksafe.InvalidArgumentError, match="cross processes"):
        pickle.dumps(mp.Queue())
    with pytest.raises(forksafe.InvalidArgumentError):
        pickle.dumps(mp.Lock())


def test_a_queue_crosses_inside_another_queue():
    outer, inner = mp.Queue(), mp.Queue()
    outer.put(inner)
    got = outer.get(timeout=5)
    got.put("through the copy")
    assert inner.get(timeout=5) == "through the copy"


# ---- Pipe -------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pipe_round_trips(method):
    ctx = mp.get_context(method)
    a, b = ctx.Pipe()
    p = ctx.Process(target=echo_pipe, args=(b,))
    p.start()
    b.close()
    for msg in [1, "two", {"three": (3,)}]:
        a.send(msg)
        assert a.poll(30)
        assert a.recv() == ("echo", msg)
    a.send(None)
    assert a.recv_bytes() == b"raw bytes"
    with pytest.raises(EOFError):
        a.recv()
    assert finish([p]) == [0]


def test_one_way_pipe_and_byte_slices():
    r, w = mp.Pipe(duplex=False)
    assert r.readable and not r.writable and w.writable and not w.readable
    w.send_bytes(b"0123456789", 2, 3)
    buf = bytearray(8)
    assert r.recv_bytes_into(buf, 1) == 3
    assert bytes(buf[1:4]) == b"234"
    w.send_bytes(b"too long")
    with pytest.raises(OSError, match="bad message length"):
        r.recv_bytes(maxlength=3)
    with pytest.raises(ValueError):
        w.send_bytes(b"abc", 5)


# ---- locks and the other primitives -----------------------------------------------------------

@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_lock_makes_increments_exclusive(method):
    ctx = mp.get_context(method)
    lock = ctx.Lock()
    counter = ctx.Value("i", 0, lock=False)
    procs = [ctx.Process(target=count_under_lock, args=(lock, counter, 500)) for _ in range(3)]
    for p in procs:
        p.start()
    assert finish(procs) == [0, 0, 0]
    assert counter.value == 1500


def test_a_lock_whose_holder_died_is_recovered():
    lock = mp.Lock()
    p = mp.Process(target=die_holding, args=(lock,))
    p.start()
    assert finish([p]) == [7]
    assert lock.acquire(timeout=10), "a lock held by a dead process wedged its waiters"
    assert lock.previous_owner_died()
    lock.release()


def _blocking_call(name):
    # One blocking call of each kind that waits in C++ with the GIL released, set up to wait
    # forever (no timeout): what Ctrl-C must end.
    if name == "queue.get":
        return mp.Queue().get
    if name == "queue.put (full)":
        q = mp.Queue(maxsize=1)
        q.put(0)
        return lambda: q.put(1)
    if name == "joinablequeue.join":
        q = mp.JoinableQueue()
        q.put(0)
        return q.join
    reader, _writer = mp.Pipe(duplex=False)
    if name == "connection.recv":
        return lambda: (reader.recv(), _writer)
    if name == "connection.recv_bytes":
        return lambda: (reader.recv_bytes(), _writer)
    if name == "connection.poll(None)":
        return lambda: (reader.poll(None), _writer)
    if name == "semaphore.acquire":
        return mp.Semaphore(0).acquire
    if name == "event.wait":
        return mp.Event().wait
    if name == "lock.acquire (held by another thread)":
        lock, hold = mp.Lock(), threading.Event()
        holder = threading.Thread(target=lambda: (lock.acquire(), hold.wait(60), lock.release()),
                                  daemon=True)
        holder.start()
        while not hold.is_set() and lock.acquire(False):  # until the holder has it
            lock.release()
            time.sleep(0.01)
        return lambda: (lock.acquire(), hold)
    raise AssertionError(name)


def interrupt_blocking_call(name, q):
    call = _blocking_call(name)
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    try:
        call()
        q.put((name, "returned"))
    except KeyboardInterrupt:
        q.put((name, time.monotonic() - started))


@pytest.mark.parametrize("name", [
    "queue.get", "queue.put (full)", "joinablequeue.join", "connection.recv",
    "connection.recv_bytes", "connection.poll(None)", "semaphore.acquire", "event.wait",
    "lock.acquire (held by another thread)"])
def test_ctrl_c_ends_a_blocking_call(name):
    # As with multiprocessing, SIGINT during a blocking call raises KeyboardInterrupt at once
    # (the wait used to hold it until it ended: never). In a child, so that a call Ctrl-C cannot
    # end is a child killed after 30 s, not a stuck suite.
    q = mp.Queue()
    p = mp.Process(target=interrupt_blocking_call, args=(name, q))
    p.start()
    assert finish([p], timeout=30) == [0]
    got, waited = q.get(timeout=10)
    assert got == name and waited != "returned"
    assert 0.15 <= waited < 5.0, f"{name}: KeyboardInterrupt after {waited:.2f} s"


def drop_held_locks_then_use_others(q):
    for _ in range(5):
        lock = mp.Lock()
        lock.acquire()
        del lock  # its last handle goes while this thread holds it
        rlock = mp.RLock()
        rlock.acquire()
        del rlock
        fresh = [mp.Event() for _ in range(3)]  # new mappings take the freed addresses
        del fresh
    other = mp.Lock()
    for _ in range(100):
        with other:
            pass
    v = mp.Value("i", 0)
    with v.get_lock():
        v.value += 1
    q.put(v.value)


def test_dropping_a_held_lock_leaves_the_threads_other_locks_working():
    # The holder's robust-futex list links through a held lock's mutex: unmapping it made the
    # thread's next lock write into the freed page (a segfault in an unrelated Queue.put). In a
    # child: a crash is its exit code.
    q = mp.Queue()
    p = mp.Process(target=drop_held_locks_then_use_others, args=(q,))
    p.start()
    assert finish([p]) == [0]
    assert q.get(timeout=10) == 1


def test_rlock_recursion_and_release_errors():
    r = mp.RLock()
    assert r.acquire() and r.acquire(block=False)
    r.release()
    r.release()
    with pytest.raises(forksafe.FailedPreconditionError):
        r.release()
    lock = mp.Lock()
    assert lock.acquire()
    assert not lock.acquire(block=False)
    # An untimed acquire by the holder would wait for itself forever (multiprocessing deadlocks
    # there): forksafe says so instead. A timed one ends at its timeout, False, as in
    # multiprocessing.
    with pytest.raises(forksafe.FailedPreconditionError, match="use RLock"):
        lock.acquire()
    started = time.monotonic()
    assert lock.acquire(timeout=0.2) is False
    assert time.monotonic() - started >= 0.19
    lock.release()


def test_semaphores():
    s = mp.Semaphore(2)
    assert s.acquire() and s.acquire(block=False)
    assert not s.acquire(timeout=0.01)
    assert s.get_value() == 0
    s.release(2)
    assert s.get_value() == 2
    b = mp.BoundedSemaphore(1)
    with b:
        pass
    with pytest.raises(ValueError, match="too many"):
        b.release()


def test_event_wakes_another_process():
    ev, q = mp.Event(), mp.Queue()
    p = mp.Process(target=wait_event_then_put, args=(ev, q))
    p.start()
    assert q.get(timeout=30) == "waiting"
    assert not ev.is_set()
    ev.set()
    assert q.get(timeout=30) is True
    assert finish([p]) == [0]
    ev.clear()
    assert ev.wait(0.01) is False


def test_condition_notify_across_processes():
    cond = mp.Condition()
    flag = mp.Value("i", 0, lock=False)
    with cond:
        p = mp.Process(target=notify_after, args=(cond, flag))
        p.start()
        assert cond.wait_for(lambda: flag.value == 1, timeout=30)
    assert finish([p]) == [0]
    with pytest.raises(forksafe.FailedPreconditionError):
        cond.notify()  # not held
    with pytest.raises(TypeError, match="Lock or RLock"):
        mp.Condition(threading.Lock())


def test_barrier_releases_all_parties_and_breaks_on_timeout():
    barrier, q = mp.Barrier(3), mp.Queue()
    procs = [mp.Process(target=barrier_party, args=(barrier, q)) for _ in range(2)]
    for p in procs:
        p.start()
    me = barrier.wait(30)
    others = [q.get(timeout=30) for _ in procs]
    assert sorted(others + [me]) == [0, 1, 2]
    assert finish(procs) == [0, 0]
    lonely = mp.Barrier(2)
    with pytest.raises(threading.BrokenBarrierError):
        lonely.wait(0.05)
    assert lonely.broken
    lonely.reset()
    assert not lonely.broken and lonely.parties == 2 and lonely.n_waiting == 0


# ---- Value and Array --------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_values_and_arrays_are_shared(method):
    ctx = mp.get_context(method)
    v = ctx.Value("d", 0.0)
    a = ctx.Array("i", range(5))
    raw = ctx.RawArray("q", 3)
    p = ctx.Process(target=fill_values, args=(v, a, raw))
    p.start()
    assert finish([p]) == [0]
    assert v.value == 2.5
    assert a[:] == [0, 10, 20, 30, 40]
    assert list(raw) == [99, 0, 0]


def test_value_typecodes_locks_and_errors():
    for code, value in [("b", -3), ("B", 3), ("h", -300), ("H", 300), ("i", -7), ("I", 7),
                        ("l", -8), ("L", 8), ("q", -9), ("Q", 9), ("f", 0.5), ("d", 0.25),
                        ("c", b"z"), ("u", "z")]:
        assert mp.Value(code, value).value == value
    v = mp.Value("i", 1)
    with v.get_lock():
        v.value += 1  # the lock is recursive, as multiprocessing's default
    assert v.value == 2
    raw = mp.Value("i", 5, lock=False)
    assert raw.value == 5 and not hasattr(raw, "get_lock")
    mine = mp.Lock()
    assert mp.Value("i", lock=mine).get_lock() is mine
    assert mp.Array("c", b"hey").value == b"hey"
    with pytest.raises(ValueError, match="unknown typecode"):
        mp.Value("x")
    with pytest.raises(AttributeError):
        mp.Value("i", lock="yes")
    assert len(mp.Array("d", 4)) == 4 and mp.RawValue("i").value == 0


def send_on_stdlib_connection(conn):
    conn.send("through multiprocessing's own Pipe")


def test_multiprocessings_own_objects_still_cross_to_a_spawned_child():
    import multiprocessing
    a, b = multiprocessing.Pipe()
    p = mp.get_context("spawn").Process(target=send_on_stdlib_connection, args=(b,))
    p.start()
    assert a.poll(60)
    assert a.recv() == "through multiprocessing's own Pipe"
    assert finish([p]) == [0]


def spawn_child_puts(q, i):
    q.put(i)


def test_processes_started_from_several_threads_at_once_get_their_own_descriptors():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=spawn_child_puts, args=(q, i)) for i in range(6)]
    threads = [threading.Thread(target=p.start) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(q.get(timeout=60) for _ in procs) == list(range(6))
    assert finish(procs) == [0] * 6


class Point(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_double)]


def move_point(v):
    with v.get_lock():
        v.x += 1
        v.y *= 2


def test_multiprocessings_other_names_are_here_too():
    # The stdlib's submodules and names a drop-in program imports (the thread-based ones are
    # multiprocessing's own: threads have no fork to make safe).
    from forksafe.multiprocessing import dummy, managers, shared_memory
    from forksafe.multiprocessing.connection import Client, Listener, wait
    from forksafe.multiprocessing.pool import ThreadPool
    from forksafe.multiprocessing.queues import Empty, Full
    from forksafe.multiprocessing.sharedctypes import copy, synchronized
    assert Empty is queue.Empty and Full is queue.Full
    assert managers.SyncManager and shared_memory.SharedMemory and Client and Listener
    with ThreadPool(2) as tp:
        assert tp.map(abs, [-1, -2]) == [1, 2]
    assert dummy.Pool(1).apply(abs, (-3,)) == 3
    a, b = mp.Pipe()
    b.send("ready")
    assert wait([a], timeout=10) == [a]
    for name in ("util", "process", "reducer", "SUBDEBUG", "SUBWARNING", "SpawnContext",
                 "init_reductions", "reductions"):
        assert hasattr(mp, name), name
    assert mp.get_context("spawn").reducer.ForkingPickler
    mp.init_reductions()
    # sharedctypes: copy, synchronized, a Structure's fields under the lock, any lock object.
    raw = mp.RawArray("i", [1, 2, 3])
    dup = copy(raw)
    dup[0] = 9
    assert list(raw) == [1, 2, 3] and list(dup) == [9, 2, 3]
    assert synchronized(raw)[:] == [1, 2, 3]
    point = mp.Value(Point, 1, 2.5)
    assert (point.x, point.y) == (1, 2.5)
    p = mp.Process(target=move_point, args=(point,))
    p.start()
    assert finish([p]) == [0]
    assert (point.x, point.y) == (2, 5.0)
    guarded = mp.Value("i", 3, lock=threading.Lock())
    guarded.value += 1  # .value takes the lock (a threading.Lock is not recursive)
    assert guarded.value == 4 and isinstance(guarded.get_lock(), type(threading.Lock()))


def exit_with(i, code):
    sys.exit(code)


def test_sys_exit_in_a_spawned_function_is_its_exit_code_as_in_torch():
    # torch.multiprocessing.spawn: sys.exit(0) is a clean end, sys.exit(3) exit code 3
    # (ProcessExitedException), not a raised exception.
    mp.spawn(exit_with, args=(0,), nprocs=2, start_method="fork")
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(exit_with, args=(3,), nprocs=2, start_method="fork")
    assert info.value.exit_code == 3


def test_bad_arguments_of_the_primitives_are_clear_errors():
    with pytest.raises(ValueError, match="parties"):
        mp.Barrier(0)
    with pytest.raises(ValueError):
        mp.Semaphore(-1)
    with pytest.raises(ValueError, match="negative size"):
        mp.RawArray("i", -1)
    with pytest.raises(ValueError, match="NaN|nan|finite"):
        mp.Queue().get(timeout=float("nan"))
    # Negative timeouts are 0, as in multiprocessing (a deadline loop's last, overdue wait).
    lock, event, (a, b) = mp.Lock(), mp.Event(), mp.Pipe()
    assert lock.acquire(True, -1) is True and lock.acquire(True, -1) is False
    assert event.wait(-1) is False and a.poll(-1) is False
    from forksafe.multiprocessing.context import _DefaultContext
    fresh = _DefaultContext()  # the module's own default stays untouched
    assert fresh.get_start_method(allow_none=True) is None
    fresh.set_start_method("spawn")
    with pytest.raises(RuntimeError, match="already been set"):
        fresh.set_start_method("fork")
    fresh.set_start_method("fork", force=True)
    assert fresh.get_start_method() == "fork"


def _raises(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001 (the type is what is compared)
        return e
    return None


def _other_thread_releases(lib):
    r = lib.RLock()
    r.acquire()
    got = []
    t = threading.Thread(target=lambda: got.append(_raises(r.release)))
    t.start()
    t.join(30)
    r.release()
    return got[0]


def _send_to_closed_peer(lib):
    a, b = lib.Pipe()
    b.close()
    return _raises(lambda: a.send(1))


def _send_bytes_to_closed_peer(lib):
    a, b = lib.Pipe()
    b.close()
    return _raises(lambda: a.send_bytes(b"x"))


def _use_own_closed_end(op):
    def case(lib):
        a, b = lib.Pipe()
        a.close()
        return _raises(lambda: op(a))
    return case


def _over_release(lib):
    s = lib.BoundedSemaphore(1)
    return _raises(s.release)


def _task_done(lib):
    q = lib.JoinableQueue()
    return _raises(q.task_done)


MISUSES = {
    "Lock.release unheld": lambda lib: _raises(lib.Lock().release),
    "RLock.release unheld": lambda lib: _raises(lib.RLock().release),
    "RLock.release by another thread": _other_thread_releases,
    "Condition.wait unheld": lambda lib: _raises(lambda: lib.Condition().wait(0.01)),
    "Condition.notify unheld": lambda lib: _raises(lib.Condition().notify),
    "Condition.notify_all unheld": lambda lib: _raises(lib.Condition().notify_all),
    "send to a closed peer": _send_to_closed_peer,
    "send_bytes to a closed peer": _send_bytes_to_closed_peer,
    "send on an own closed end": _use_own_closed_end(lambda c: c.send(1)),
    "recv on an own closed end": _use_own_closed_end(lambda c: c.recv()),
    "poll on an own closed end": _use_own_closed_end(lambda c: c.poll()),
    "fileno of an own closed end": _use_own_closed_end(lambda c: c.fileno()),
    "send_bytes on an own closed end": _use_own_closed_end(lambda c: c.send_bytes(b"x")),
    "recv_bytes on an own closed end": _use_own_closed_end(lambda c: c.recv_bytes()),
    "BoundedSemaphore over-release": _over_release,
    "task_done too many": _task_done,
    "Value of an unknown typecode": lambda lib: _raises(lambda: lib.Value("zz", 1)),
    "Array of an unknown typecode": lambda lib: _raises(lambda: lib.Array("zz", 3)),
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_misuse_raises_what_multiprocessing_raises_and_a_forksafe_error(case):
    """Code written for multiprocessing catches what it caught there (ValueError from
    Lock.release, AssertionError from RLock and Condition, BrokenPipeError from send, OSError
    from a Connection used after its own close(), TypeError from a typecode); every one is also a forksafe.Error carrying the C++ code."""
    import multiprocessing
    theirs = MISUSES[case](multiprocessing)
    ours = MISUSES[case](mp)
    assert theirs is not None and ours is not None, (theirs, ours)
    for cls in type(theirs).__mro__:
        if cls not in (object, BaseException, Exception, ConnectionError):
            assert isinstance(ours, cls), f"{case}: {type(ours).__mro__} is not a {cls}"
    assert isinstance(ours, forksafe.Error), type(ours).__mro__
    assert ours.code in ("failed_precondition", "closed", "invalid_argument"), ours.code
    if isinstance(theirs, OSError):
        assert ours.errno == theirs.errno


class _OwnsItsProcess:
    """The common pattern: an object whose own method is its Process's target."""

    def __init__(self, ctx, q):
        self.q = q
        self.proc = ctx.Process(target=self.loop)

    def loop(self):
        self.q.put(("loop ran", self.proc.name))


_GETSTATE_SCRIPT = r"""
import sys, threading
import forksafe.multiprocessing as mp


class Worker(mp.Process):
    def __init__(self, q):
        super().__init__()
        self.q = q
        self.lock = threading.Lock()  # cannot be pickled: dropped by __getstate__

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def run(self):
        with self.lock:
            self.q.put("rebuilt")


if __name__ == "__main__":
    mp.set_start_method(sys.argv[1])
    q = mp.Queue()
    w = Worker(q)
    w.start()
    print(q.get(timeout=60))
    w.join(60)
    print("exit", w.exitcode)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_processes_pickle_as_python_objects_do(method, tmp_path):
    """A Process reachable from its own target (self.proc = Process(target=self.loop)) raised
    RecursionError under spawn and forkserver, and a subclass's __getstate__/__setstate__ were
    ignored (TypeError: cannot pickle '_thread.lock'); multiprocessing runs both."""
    ctx = mp.get_context(method)
    q = ctx.Queue()
    owner = _OwnsItsProcess(ctx, q)
    owner.proc.start()
    assert q.get(timeout=60) == ("loop ran", owner.proc.name)
    owner.proc.join(60)
    assert owner.proc.exitcode == 0
    script = tmp_path / "getstate.py"
    script.write_text(_GETSTATE_SCRIPT)
    import subprocess
    done = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    assert done.stdout.split() == ["rebuilt", "exit", "0"], done.stdout + done.stderr


class _Tagged:
    def __init__(self, tag=None):
        self.tag = tag


def _make_tagged(tag):
    return _Tagged(tag)


class _Untagged:
    pass


def test_a_reducer_replaced_or_removed_is_what_pickles_next():
    """Reducers were merged into a table cached by the sizes of copyreg's and ForkingPickler's:
    one replaced (or removed while another was added) kept pickling with the first for good."""
    import copyreg
    from multiprocessing.reduction import ForkingPickler
    q = mp.Queue()

    def round_trip():
        q.put([_Tagged(), 1])  # through the pickler, not the one-value shortcut
        return getattr(q.get(timeout=5)[0], "tag", None)
    try:
        copyreg.pickle(_Tagged, lambda o: (_make_tagged, ("v1",)))
        assert round_trip() == "v1"
        copyreg.pickle(_Tagged, lambda o: (_make_tagged, ("v2",)))
        assert round_trip() == "v2"
        del copyreg.dispatch_table[_Tagged]  # removed while another is added: same size
        copyreg.pickle(_Untagged, lambda o: (_Untagged, ()))
        assert round_trip() is None
        ForkingPickler.register(_Tagged, lambda o: (_make_tagged, ("f1",)))
        assert round_trip() == "f1"
        ForkingPickler.register(_Tagged, lambda o: (_make_tagged, ("f2",)))
        assert round_trip() == "f2"
    finally:
        copyreg.dispatch_table.pop(_Tagged, None)
        copyreg.dispatch_table.pop(_Untagged, None)
        ForkingPickler._extra_reducers.pop(_Tagged, None)


def test_small_api_shapes_match_multiprocessing_and_torch():
    """JoinableQueue.join() returns None (it returned True), pool workers are numbered
    as multiprocessing's (ForkPoolWorker-N, SpawnPoolWorker-N, ...: by the count that numbers
    every Process, so names do not repeat across pools), ProcessExitedException.signal_name is None for
    a plain exit (it was "")."""
    q = mp.JoinableQueue()
    q.put(1)
    q.get()
    q.task_done()
    assert q.join() is None
    assert q.join(timeout=1) is True  # forksafe's timeout: False when it runs out
    names = set()
    for _ in range(2):
        with mp.Pool(2) as pool:
            names |= {w.process.name for w in pool._workers}
    assert len(names) == 4 and all(n.startswith("ForkPoolWorker-") for n in names), names
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool._workers[0].process.name.startswith("SpawnPoolWorker-")
    e = mp.ProcessExitedException("exit code 3", 0, 1, 3)
    assert e.signal_name is None


def test_send_and_send_bytes_interoperate_as_in_multiprocessing():
    """multiprocessing's send() is send_bytes(pickle.dumps(x)), and programs mix the two:
    recv_bytes() of a send() message raised UnpicklingError at pickle.loads, recv() of a
    send_bytes(pickle.dumps(x)) message raised "malformed message"."""
    import pickle
    a, b = mp.Pipe()
    a.send({"k": [1, 2]})
    assert pickle.loads(b.recv_bytes()) == {"k": [1, 2]}
    a.send_bytes(pickle.dumps([1, 2]))
    assert b.recv() == [1, 2]
    a.send_bytes(b"not a pickle")
    with pytest.raises(pickle.UnpicklingError):
        b.recv()
    a.send_bytes(b"raw")
    assert b.recv_bytes() == b"raw"
    try:
        import numpy as np
    except ImportError:
        return
    a.send(mp.shared_ndarray(3))  # carries shared memory: only recv() can take it
    with pytest.raises(forksafe.InvalidArgumentError, match="recv"):
        b.recv_bytes()
    a.send("next")
    assert b.recv() == "next"


_BLOCKED_AT_EXIT = r"""
import sys, threading, time
import forksafe
import forksafe.multiprocessing as mp
kind = sys.argv[1]
q = mp.Queue(1)
if kind == "get":
    target = q.get
elif kind == "put":
    q.put(0)
    target = lambda: q.put(1)
elif kind == "event":
    target = mp.Event().wait
elif kind == "lock":
    lock = mp.Lock(); lock.acquire(); target = lock.acquire
elif kind == "semaphore":
    target = mp.Semaphore(0).acquire
elif kind == "condition":
    c = mp.Condition()
    def target():
        with c:
            c.wait()
elif kind == "barrier":
    target = mp.Barrier(2).wait
elif kind == "recv":
    a, b = mp.Pipe(); target = a.recv
elif kind == "join":
    q2 = mp.JoinableQueue(); q2.put(1); target = q2.join
elif kind == "reader":
    target = lambda: q._reader.recv()
threading.Thread(target=target, daemon=True).start()


class _SlowToDie:  # keeps the interpreter finalizing for a while, GIL released
    def __del__(self):
        time.sleep(0.3)


slow = _SlowToDie()
time.sleep(0.3)
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("kind", ["get", "put", "event", "lock", "semaphore", "condition",
                                  "barrier", "recv", "join", "reader"])
def test_a_daemon_thread_blocked_in_a_wait_does_not_abort_the_exit(kind):
    """A daemon thread blocked in a forksafe wait when the program ends: the program exits with
    its own status. It aborted (exit code 134, "terminate called without an active exception"):
    CPython ends such a thread with a forced unwind, which pybind11's GIL release met in its
    noexcept destructor (python/nogil.h)."""
    for status in (0, 3):
        code = _BLOCKED_AT_EXIT.replace("sys.argv[1]", repr(kind)).replace(
            "int(sys.argv[2])", str(status))
        rc, out = run_python(code, timeout=60)
        assert rc == status, f"{kind}: exit code {rc}, not {status}:\n{out}"
        assert "terminate called" not in out, out


_UNDER_LIMITS = r"""
import resource, sys
import forksafe
import forksafe.multiprocessing as mp
which = sys.argv[1]
if which == "fsize":
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    q = mp.Queue()                      # a 64 KiB ring fits under the limit
    q.put("small")
    assert q.get(timeout=10) == "small"
    try:
        q.put(b"x" * (3 << 20))         # out of band: a file over the limit
    except forksafe.ResourceExhaustedError as e:
        assert "ulimit -f" in str(e), e
    else:
        raise SystemExit("a 3 MB item under a 1 MiB file size limit did not fail")
    q.put("after")
    assert q.get(timeout=10) == "after"
else:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (40, hard))
    made = []
    try:
        for _ in range(100):
            made.append(mp.Queue())
    except forksafe.ResourceExhaustedError as e:
        assert "ulimit -n" in str(e) or "descriptors" in str(e), e
    else:
        raise SystemExit("100 queues under a limit of 40 descriptors did not fail")
print("ok")
"""


@pytest.mark.parametrize("limit", ["fsize", "nofile"])
def test_queues_under_tight_limits_fail_clearly(limit):
    """Under a 1 MiB file size limit a Queue still works (its ring shrinks) and an item over the
    limit raises ResourceExhaustedError naming `ulimit -f` (it could not be made at all, and
    the item raised InternalError); out of descriptors, ResourceExhaustedError, not an
    InternalError from socketpair()."""
    code = "import signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n" + \
        _UNDER_LIMITS.replace("sys.argv[1]", repr(limit))
    rc, out = run_python(code, timeout=60)
    assert rc == 0 and "ok" in out, out
