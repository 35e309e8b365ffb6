"""forksafe.multiprocessing.Pool and spawn(): results, errors, dead workers, lazy input.

Every wait is bounded (get(timeout), next(timeout)); Pools are terminated by their context
manager; conftest.py's watchdog ends the run past 120 s.
"""
import os
import signal
import sys
import threading
import time

import pytest

import forksafe
import forksafe.multiprocessing as mp
from conftest import run_python

T = 60  # seconds any single result may take before the test fails


def square(x):
    return x * x


def add(a, b):
    return a + b


def fail_on_three(x):
    if x == 3:
        raise KeyError(f"three is not allowed ({x})")
    return x


def kill_self_on_three(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def exit_on_zero(x):
    if x == 0:
        os._exit(5)
    return x


def sys_exit_on_two(x):
    if x == 2:
        sys.exit(4)  # SystemExit in a task: the worker ends with code 4, not the parent
    return x


def pid_of_worker(_):
    time.sleep(0.01)
    return os.getpid()


def broken_initializer():
    raise RuntimeError("the initializer failed")


def set_marker(value):
    global MARKER
    MARKER = value


def read_marker(_):
    return MARKER


def kwargs_call(a, b=0, *, c=0):
    return a + b + c


def sleep_long(_):
    time.sleep(60)


def child_raises(i, message):
    if i == 1:
        raise ValueError(f"{message} from {i}")
    time.sleep(0.1)


def child_killed(i):
    if i == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def child_ok(i, q):
    q.put(i)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_map_starmap_apply_and_imap(method):
    with mp.get_context(method).Pool(2) as pool:
        assert pool.map(square, range(20)) == [x * x for x in range(20)]
        assert pool.map(square, range(20), chunksize=7) == [x * x for x in range(20)]
        assert pool.starmap(add, [(1, 2), (3, 4)]) == [3, 7]
        assert pool.apply(kwargs_call, (1,), {"b": 2, "c": 3}) == 6
        assert list(pool.imap(square, range(10))) == [x * x for x in range(10)]
        assert sorted(pool.imap_unordered(square, range(10), chunksize=3)) == \
            [x * x for x in range(10)]
        assert pool.map(square, []) == []


def test_async_results_and_callbacks():
    got, errors, done = [], [], threading.Event()
    with mp.Pool(2) as pool:
        r = pool.apply_async(square, (9,), callback=got.append)
        assert r.get(T) == 81 and r.ready() and r.successful()
        m = pool.map_async(square, range(5), callback=lambda v: (got.append(v), done.set()))
        assert m.get(T) == [0, 1, 4, 9, 16]
        assert done.wait(T)
        e = pool.apply_async(fail_on_three, (3,), error_callback=errors.append)
        with pytest.raises(KeyError, match="three"):
            e.get(T)
        assert not e.successful()
        assert isinstance(errors[0], KeyError)
        assert got == [81, [0, 1, 4, 9, 16]]
        slow = pool.apply_async(time.sleep, (0.5,))
        with pytest.raises(mp.TimeoutError):
            slow.get(0.01)
        with pytest.raises(ValueError, match="not ready"):
            slow.successful()


def test_a_task_error_carries_the_remote_traceback():
    with mp.Pool(2) as pool:
        with pytest.raises(KeyError) as info:
            pool.map(fail_on_three, range(6), chunksize=1)
    assert "fail_on_three" in str(info.value.__cause__)


@pytest.mark.parametrize("target,how", [(kill_self_on_three, "killed by SIGKILL"),
                                        (exit_on_zero, "exit code 5"),
                                        (sys_exit_on_two, "exit code 4")])
def test_a_dead_worker_fails_its_task_instead_of_hanging(target, how):
    with mp.Pool(2) as pool:
        with pytest.raises(forksafe.ProcessFailedError, match=how):
            pool.map(target, range(6), chunksize=1)
        # The pool replaced the worker and goes on.
        assert pool.map(square, range(8)) == [x * x for x in range(8)]
        r = pool.apply_async(target, ({kill_self_on_three: 3, exit_on_zero: 0}.get(target, 2),))
        with pytest.raises(forksafe.ProcessFailedError, match="chunk 0"):
            r.get(T)


def pool_under_ignored_sigchld(q):
    # SIGCHLD ignored: the kernel reaps exited children at once, so a dead worker can never be
    # waited for. Its chunk used to wait for ever (as multiprocessing's does), with the
    # handler spinning on the dead worker's readable sentinel.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    with mp.Pool(2) as pool:
        try:
            pool.apply_async(exit_on_zero, (0,)).get(30)
            q.put("no error")
        except forksafe.ProcessFailedError as e:
            q.put(str(e))
        q.put(pool.map(square, range(5)))
        started = time.process_time()
        time.sleep(1)
        q.put(time.process_time() - started)


def test_a_dead_worker_fails_its_task_even_when_sigchld_is_ignored():
    q = mp.Queue()
    p = mp.Process(target=pool_under_ignored_sigchld, args=(q,))
    p.start()
    try:
        assert "SIGCHLD is ignored" in q.get(timeout=60)
        assert q.get(timeout=60) == [0, 1, 4, 9, 16]
        assert q.get(timeout=60) < 0.5  # CPU seconds in a second of idling: no spinning
        p.join(60)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def test_imap_reads_its_input_lazily():
    taken = []

    def numbers():
        for i in range(1000):
            taken.append(i)
            yield i

    with mp.Pool(2) as pool:
        it = pool.imap(square, numbers())
        assert [it.next(T) for _ in range(5)] == [0, 1, 4, 9, 16]
        time.sleep(0.2)
        # Only what the two workers could take: never the whole input up front.
        assert len(taken) < 20, f"imap read {len(taken)} items ahead"


def test_an_input_error_ends_imap():
    def numbers():
        yield 1
        raise RuntimeError("the input broke")

    with mp.Pool(1) as pool:
        it = pool.imap(square, numbers())
        assert it.next(T) == 1
        with pytest.raises(RuntimeError, match="input broke"):
            it.next(T)
        with pytest.raises(StopIteration):
            it.next(T)


def test_maxtasksperchild_replaces_workers_and_initializer_runs():
    with mp.Pool(1, initializer=set_marker, initargs=("set",), maxtasksperchild=2) as pool:
        pids = pool.map(pid_of_worker, range(6), chunksize=1)
        assert len(set(pids)) == 3, pids  # a new worker every two tasks
        assert pool.map(read_marker, range(3)) == ["set"] * 3


def test_a_failing_initializer_fails_the_pool_instead_of_restarting_for_ever():
    pool = mp.Pool(2, initializer=broken_initializer)
    try:
        # Before the workers reported, the task is taken and fails; after, submitting fails.
        with pytest.raises(RuntimeError, match="initializer failed"):
            pool.apply_async(square, (2,)).get(T)
        deadline = time.monotonic() + T
        while pool._broken is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="initializer failed"):
            pool.apply_async(square, (2,))
        assert not pool._workers or all(not w.ready for w in pool._workers)
    finally:
        pool.terminate()


def test_terminate_fails_what_is_pending_and_close_join_end_cleanly():
    pool = mp.Pool(1)
    r = pool.apply_async(sleep_long, (0,))
    time.sleep(0.2)
    pool.terminate()
    with pytest.raises(forksafe.CancelledError):
        r.get(T)
    pool.join()
    pool = mp.Pool(2)
    r = pool.map_async(square, range(10))
    pool.close()
    with pytest.raises(ValueError, match="not running"):
        pool.apply_async(square, (1,))
    pool.join()
    assert r.get(0) == [x * x for x in range(10)]
    running = mp.Pool(1)
    with pytest.raises(ValueError, match="still running"):
        running.join()
    running.terminate()
    running.join()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="at least 1"):
        mp.Pool(0)
    with pytest.raises(ValueError, match="maxtasksperchild"):
        mp.Pool(1, maxtasksperchild=0)
    with pytest.raises(TypeError, match="callable"):
        mp.Pool(1, initializer=3)
    with mp.Pool(1) as pool:
        with pytest.raises(forksafe.InvalidArgumentError, match="lambda"):
            pool.map(lambda x: x, [1])
        with pytest.raises(ValueError, match="chunksize"):
            pool.imap(square, [1], chunksize=0)
        assert pool.map(square, [3]) == [9]


# ---- spawn() ----------------------------------------------------------------------------------

def test_spawn_raises_the_childs_exception_with_its_traceback():
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(child_raises, args=("boom",), nprocs=3)
    e = info.value
    assert e.error_index == 1 and e.error_pid > 0
    assert e.exception_type == "builtins.ValueError"
    assert e.exception_message == "boom from 1"
    assert "child_raises" in e.traceback and "boom from 1" in str(e)
    assert isinstance(e, forksafe.ProcessFailedError) and isinstance(e, forksafe.Error)


def test_spawn_reports_a_child_killed_by_a_signal():
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(child_killed, nprocs=2, start_method="fork")
    assert info.value.error_index == 0
    assert info.value.exit_code == -signal.SIGKILL and info.value.signal_name == "SIGKILL"


def test_start_processes_without_join_returns_a_context():
    q = mp.Queue()
    ctx = mp.start_processes(child_ok, args=(q,), nprocs=3, join=False, start_method="fork")
    deadline = time.monotonic() + T
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "spawned processes did not end"
    assert sorted(q.get(timeout=5) for _ in range(3)) == [0, 1, 2]
    assert len(ctx.pids()) == 3
    assert mp.spawn(child_ok, args=(q,), nprocs=1) is None
    with pytest.raises(ValueError, match="nprocs"):
        mp.spawn(child_ok, args=(q,), nprocs=0)


# ---- the handler thread under stress (review findings) ----------------------------------------

def ident(x):
    return x


class Unbuildable:
    def __reduce__(self):
        return _refuse, ()


def _refuse():
    raise RuntimeError("this result cannot be rebuilt here")


def unbuildable(_):
    return Unbuildable()


def join_within(pool, seconds):
    t = threading.Thread(target=pool.join, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_terminate_while_results_are_in_flight_stops_every_worker():
    for _ in range(5):
        pool = mp.Pool(2)
        r = pool.map_async(ident, range(100000), chunksize=1)
        time.sleep(0.1)
        pool.terminate()
        assert not pool._handler.is_alive()
        assert all(not w.process.is_alive() for w in pool._workers)
        with pytest.raises(forksafe.CancelledError):
            r.get(T)


def test_close_and_join_end_when_workers_leave_after_close():
    pool = mp.Pool(2, maxtasksperchild=1)
    r = pool.map_async(square, range(10), chunksize=1)
    pool.close()
    assert r.get(T) == [x * x for x in range(10)]
    assert join_within(pool, T)


def test_close_and_join_do_not_wait_for_the_imap_consumer():
    pool = mp.Pool(2)
    it = pool.imap(square, range(50))
    pool.close()
    assert join_within(pool, T), "join() waited for an imap nobody consumed yet"
    assert list(it) == [x * x for x in range(50)]


def test_a_result_that_cannot_be_rebuilt_fails_its_task_and_the_pool_goes_on():
    with mp.Pool(1) as pool:
        with pytest.raises(RuntimeError, match="cannot be rebuilt"):
            pool.apply_async(unbuildable, (0,)).get(T)
        assert pool.map(square, range(4)) == [0, 1, 4, 9]


def test_a_callback_may_submit_more_work():
    done = threading.Event()
    results = []
    with mp.Pool(2) as pool:
        def again(value):
            results.append(value)
            if len(results) < 3:
                pool.apply_async(square, (value,), callback=again)
            else:
                done.set()
        pool.apply_async(square, (2,), callback=again)
        assert done.wait(T)
    assert results == [4, 16, 256]


def test_every_result_arrives_without_waiting_for_the_handlers_poll():
    # The handler thread wakes on each event it acts on; its poll (Pool._poll_s) is a safety net
    # only. With the poll made 300 s, maps, imaps and async work of more chunks than workers
    # must still finish at once: a delivery held back until the poll (the end of a map's input
    # used to be) now costs 300 s, and the bounded waits below turn that into a failure.
    pool = mp.Pool(2)
    try:
        pool._core._poll_s = 300
        time.sleep(0.1)
        pool.apply(abs, (-1,))  # the handler's first wait (the 1 s one) has ended
        for chunksize in (1, 3, 7, 40):
            for _ in range(4):
                got = pool.map_async(abs, range(-40, 0), chunksize).get(timeout=30)
                assert got == list(range(40, 0, -1))
        assert pool.starmap_async(pow, [(2, i) for i in range(9)], 2).get(timeout=30) == \
            [2 ** i for i in range(9)]
        it = pool.imap(abs, range(-9, 0), 2)
        assert [it.next(timeout=30) for _ in range(9)] == list(range(9, 0, -1))
        it = pool.imap_unordered(abs, range(-9, 0), 2)
        assert sorted(it.next(timeout=30) for _ in range(9)) == list(range(1, 10))
        assert [pool.apply_async(abs, (-i,)).get(timeout=30) for i in range(5)] == list(range(5))
        pool.close()
        assert join_within(pool, 30), "close() + join() waited for the handler's poll"
    finally:
        pool.terminate()


def slow_on_nine(x):
    if x == 9:
        time.sleep(0.3)
    return x + 1


def take(it, n, timeout=30):
    return [it.next(timeout=timeout) for _ in range(n)]


def test_an_imap_whose_input_is_another_imap_of_the_same_pool_ends():
    """The pool's one thread read imap's input under its lock: an input waiting for results of
    the same pool (a second stage over the first's results, a generator that submits work)
    stopped every result from being read (multiprocessing: done in 0.5 s), and terminate() then
    waited for ever. The input is read by a feeder thread now, without the lock."""
    with mp.Pool(2) as pool:
        assert take(pool.imap(square, pool.imap(slow_on_nine, range(10))), 10) == \
            [(x + 1) ** 2 for x in range(10)]

        def submits():
            for i in range(3):
                yield pool.apply_async(square, (i,)).get(timeout=30)
        assert take(pool.imap(square, submits()), 3) == [0, 1, 16]


def test_terminate_returns_while_imaps_input_waits():
    release = threading.Event()

    def waits():
        yield 1
        release.wait(60)
        yield 2
    pool = mp.Pool(2)
    it = pool.imap(square, waits())
    assert it.next(timeout=30) == 1
    started = time.monotonic()
    pool.terminate()
    took = time.monotonic() - started
    release.set()
    pool.join()
    assert took < 20, f"terminate() took {took:.1f} s"


def length(x):
    return len(x)


def test_map_async_and_apply_async_take_their_input_at_the_call():
    """The chunks were made from the caller's list as workers freed up: clearing it after
    map_async returned 4 of 40 results without an error; apply_async's arguments were pickled
    when a worker took them, so a later change reached the worker."""
    with mp.Pool(1) as pool:
        blocker = pool.apply_async(time.sleep, (0.3,))
        batch = list(range(40))
        r = pool.map_async(square, batch, chunksize=2)
        args = [1, 2, 3]
        a = pool.apply_async(length, (args,))
        batch.clear()
        args.append(4)
        assert r.get(timeout=60) == [x * x for x in range(40)]
        assert a.get(timeout=60) == 3
        blocker.get(timeout=60)
        unpicklable = pool.apply_async(length, (threading.Lock(),))
        with pytest.raises(TypeError):
            unpicklable.get(timeout=60)


def test_a_pool_dropped_without_close_is_terminated_and_a_held_result_keeps_it():
    """Pool(2).map(...) in a loop, never closed: each pool's workers, threads and descriptors
    lived until the interpreter exited (10 pools: 20 processes, 11 threads, 86 descriptors).
    Dropped, a running Pool is terminated, as multiprocessing's finalizer does; a result still
    held keeps its pool running."""
    import gc
    import warnings
    threads = threading.active_count()
    fds = len(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        for _ in range(10):
            assert mp.Pool(2).map(square, range(4)) == [0, 1, 4, 9]
        r = mp.Pool(2).map_async(square, range(50))  # the Pool itself is dropped at once
        gc.collect()
        assert r.get(timeout=60) == [x * x for x in range(50)]
        del r
        gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (mp.active_children() or
                                           threading.active_count() > threads):
        time.sleep(0.05)
    assert mp.active_children() == []
    assert threading.active_count() <= threads
    assert len(os.listdir("/proc/self/fd")) <= fds


def fail_always(x):
    raise ValueError(f"bad {x}")


_DROPPED_AND_FAILED = r"""
import threading
import forksafe.multiprocessing as mp


def bad(x):
    raise ValueError(f"bad {x}")


if __name__ == "__main__":
    errors = []
    mp.Pool(1).map_async(bad, range(100), chunksize=1, error_callback=errors.append)
    import time
    deadline = time.monotonic() + 30
    while not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    print("error_callback", [str(e) for e in errors][:1])
    # Terminated by its own handler once dropped: its threads and worker end now, not at exit.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (threading.active_count() > 1 or
                                           mp.active_children()):
        time.sleep(0.01)
    print("threads", threading.active_count(), "children", len(mp.active_children()))
"""


def test_a_pool_dropped_on_its_own_thread_ends_and_the_program_exits(tmp_path):
    """Neither the Pool nor its result kept: the handler dropped the last reference while it
    held the pool's lock, Pool.__del__'s terminate() waited for that lock for ever, and the
    program hung at exit (multiprocessing exits)."""
    import subprocess
    script = tmp_path / "dropped.py"
    script.write_text(_DROPPED_AND_FAILED)
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=60, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the program did not exit within 60 s: {e.stdout} {e.stderr}")
    assert done.returncode == 0 and "bad 0" in done.stdout, done.stdout + done.stderr
    assert "threads 1 children 0" in done.stdout, done.stdout + done.stderr


def batches_of(it, n):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield sum(batch)
            batch = []
    if batch:
        yield sum(batch)


def test_chained_imaps_with_large_chunks_and_batching_inputs_end():
    """One feeder thread for the pool stayed blocked in the outer imap's input waiting for the
    inner imap's results, whose input it was the only one to read (outer chunksize 10: no
    result in 10 s). Each imap reads its input on a thread of its own."""
    with mp.Pool(2) as pool:
        it = pool.imap(square, pool.imap(slow_on_nine, range(40)), chunksize=10)
        assert take(it, 40) == [(x + 1) ** 2 for x in range(40)]
        it = pool.imap(square, batches_of(pool.imap(slow_on_nine, range(40)), 8))
        assert take(it, 5) == [sum(range(8 * i + 1, 8 * i + 9)) ** 2 for i in range(5)]


def keyword(x=None):
    return x


def test_unpicklable_keyword_arguments_fail_at_get_as_in_multiprocessing():
    errors = []
    with mp.Pool(1) as pool:
        r = pool.apply_async(keyword, (), {"x": threading.Lock()}, error_callback=errors.append)
        with pytest.raises(TypeError, match="pickle"):
            r.get(timeout=30)
        assert len(errors) == 1 and isinstance(errors[0], TypeError)
        assert pool.apply(keyword, (), {"x": 5}) == 5


def test_many_open_imaps_do_not_slow_the_pool_or_keep_threads():
    """A condition shared by all feeders woke each of them at every result (200 open imaps: a
    map of 3000 one-item chunks took 10 s, not 0.9), and an imap left unconsumed kept its
    feeder thread until close. Each feeder waits on its own imap's condition and ends when
    idle."""
    threads = threading.active_count()
    with mp.Pool(2) as pool:
        its = [pool.imap(square, range(100)) for _ in range(100)]
        for it in its:
            assert it.next(timeout=30) == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and threading.active_count() > threads + 1:
            time.sleep(0.05)
        assert threading.active_count() <= threads + 1  # the handler; feeders idle out
        assert pool.map(square, range(3000), chunksize=1) == [x * x for x in range(3000)]
        assert take(its[7], 5) == [1, 4, 9, 16, 25]  # a feeder starts again when room comes


_POOLS_FROM_THREADS_AT_EXIT = r"""
import threading, time
import forksafe.multiprocessing as mp
ready = threading.Semaphore(0)


def body():
    pool = mp.Pool(1)
    result = pool.apply_async(time.sleep, (60,))
    ready.release()
    try:
        result.get()
    except Exception:
        pass


for _ in range(16):
    threading.Thread(target=body, daemon=True).start()
for _ in range(16):
    ready.acquire()
time.sleep(0.5)  # the tasks are running
print("main returns", flush=True)
"""


def test_pools_started_from_many_threads_end_at_exit():
    """16 daemon threads each start a Pool and wait on a 60 s task; the program returns. The
    pools are terminated at exit and it ends at once (it took 10 s per pool or more: a
    worker's end was awaited on its sentinel, which a worker forked meanwhile by another thread
    kept open). The bound is a hang's, not a speed target: ending takes about 1 s."""
    rc, out = run_python(_POOLS_FROM_THREADS_AT_EXIT, timeout=8)
    assert rc == 0 and "main returns" in out, out
