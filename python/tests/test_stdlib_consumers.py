"""The standard library's own users of a multiprocessing context, given forksafe's.

concurrent.futures.ProcessPoolExecutor(mp_context=forksafe.multiprocessing.get_context(m))
builds on what it expects of a context: a SimpleQueue whose ``_reader`` it waits on with
multiprocessing.connection.wait, and a multiprocessing.queues.Queue made over the context's
Lock and BoundedSemaphore (whose ``_semlock`` its full() reads). Every wait is bounded; the
executors are shut down by their context manager; conftest.py's watchdog ends a hang.
"""
import concurrent.futures as cf
import gc
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.queues
import os
import signal
import threading
import time

import numpy as np
import pytest

import forksafe
import forksafe.multiprocessing as mp

T = 60  # seconds any single result may take before the test fails


def square(x):
    return x * x


def fail(x):
    raise KeyError(f"no {x}")


def double(a):
    return a * 2


def set_global(v):
    global _GLOBAL
    _GLOBAL = v


def get_global(_):
    return _GLOBAL


def my_pid(_):
    return os.getpid()


def die(_):
    os.kill(os.getpid(), signal.SIGKILL)


def put_later(q, items):
    time.sleep(0.2)
    for x in items:
        q.put(x)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_process_pool_executor_runs_on_a_forksafe_context(method):
    """submit, map with chunksize, a task's exception, numpy arrays and torch tensors both ways,
    an initializer: as on multiprocessing's context (they failed: SimpleQueue had no _reader,
    the semaphore no _semlock, and every result timed out)."""
    import torch
    ctx = mp.get_context(method)
    with cf.ProcessPoolExecutor(max_workers=2, mp_context=ctx, initializer=set_global,
                                initargs=(42,)) as ex:
        assert ex.submit(square, 7).result(timeout=T) == 49
        assert list(ex.map(square, range(10), chunksize=3, timeout=T)) == [x * x for x in range(10)]
        with pytest.raises(KeyError, match="no 3"):
            ex.submit(fail, 3).result(timeout=T)
        a = np.arange(1000, dtype=np.float32)
        assert np.array_equal(ex.submit(double, a).result(timeout=T), a * 2)
        t = torch.arange(1000, dtype=torch.float64)
        assert torch.equal(ex.submit(double, t).result(timeout=T), t * 2)
        assert set(ex.map(get_global, range(4), timeout=T)) == {42}


def test_process_pool_executor_reports_a_killed_worker():
    """A worker SIGKILLed mid-task breaks the executor (BrokenProcessPool), as on
    multiprocessing's context; nothing hangs."""
    with cf.ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("fork")) as ex:
        assert ex.submit(square, 3).result(timeout=T) == 9
        with pytest.raises(cf.process.BrokenProcessPool):
            ex.submit(die, 0).result(timeout=T)


def test_process_pool_executor_max_tasks_per_child_and_cancel():
    """max_tasks_per_child=1 replaces each worker after its task (spawn); shutdown with
    cancel_futures cancels what had not started."""
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                                max_tasks_per_child=1) as ex:
        pids = [ex.submit(my_pid, i).result(timeout=T) for i in range(3)]
    assert len(set(pids)) == 3, pids
    ex = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("fork"))
    futures = [ex.submit(time.sleep, 0.2) for _ in range(20)]
    ex.shutdown(wait=True, cancel_futures=True)
    assert any(f.cancelled() for f in futures)
    assert all(f.done() for f in futures)


def test_a_queue_reader_is_readable_exactly_while_the_queue_holds_a_message():
    """A queue's _reader (what concurrent.futures waits on): wait() returns it only while a
    message is in the queue; recv() takes one. Items put by another process wake it."""
    q = mp.SimpleQueue()
    r = q._reader
    assert q._reader is r
    assert multiprocessing.connection.wait([r], timeout=0.1) == []
    p = mp.get_context("fork").Process(target=put_later, args=(q, ["a", "b", "c"]))
    p.start()
    got = []
    deadline = time.monotonic() + T
    while len(got) < 3 and time.monotonic() < deadline:
        if multiprocessing.connection.wait([r], timeout=T) == [r]:
            got.append(r.recv())
    p.join(T)
    assert got == ["a", "b", "c"]
    assert multiprocessing.connection.wait([r], timeout=0.2) == []
    assert not r.poll(0.05)
    q.put(np.arange(3))
    assert r.poll(T)
    assert multiprocessing.connection.wait([r], timeout=T) == [r]
    assert np.array_equal(q.get(), np.arange(3))  # a plain get() takes it too
    assert not r.poll(0.05)


def test_a_queue_reader_ends_its_thread_and_pipe_with_the_queue():
    """The reader's watcher thread and its pipe end once the queue is closed or dropped; a
    forked child gets a reader of its own (the parent's thread is not there)."""
    def watchers():
        return [t for t in threading.enumerate() if t.name == "forksafe-queue-reader"]

    def fds():
        return len(os.listdir("/proc/self/fd"))

    before_threads = len(watchers())
    q = mp.Queue()
    r = q._reader
    assert len(watchers()) == before_threads + 1
    q.put(1)
    assert multiprocessing.connection.wait([r], timeout=T) == [r]

    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()

    def child():
        r2 = q._reader
        out.put((r2 is not r, multiprocessing.connection.wait([r2], timeout=T) == [r2],
                 r2.recv()))

    p = ctx.Process(target=child)
    p.start()
    assert out.get() == (True, True, 1)
    p.join(T)
    assert p.exitcode == 0
    q.close()
    deadline = time.monotonic() + 10
    while len(watchers()) > before_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(watchers()) == before_threads
    with pytest.raises(OSError, match="closed"):
        r.fileno()

    before_fds = fds()
    q2 = mp.SimpleQueue()
    q2._reader  # noqa: B018 (made, then dropped with its queue)
    assert len(watchers()) == before_threads + 1
    del q2
    deadline = time.monotonic() + 10
    while len(watchers()) > before_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(watchers()) == before_threads
    assert fds() == before_fds, "the queue's or its reader's descriptors were left open"


def test_a_multiprocessing_queue_over_forksafe_locks_reports_full_and_qsize():
    """multiprocessing.queues.Queue(ctx=forksafe's context) (ProcessPoolExecutor's call queue)
    reads its semaphore's _semlock in full() and qsize()."""
    q = multiprocessing.queues.Queue(2, ctx=mp.get_context("fork"))
    try:
        assert not q.full() and q.qsize() == 0
        q.put(1)
        q.put(2)
        assert q.full() and q.qsize() == 2
        assert q.get(timeout=T) == 1
        assert not q.full()
    finally:
        q.close()
        q.join_thread()


class _Squares:
    """A map-style dataset of dicts of tensors; item `bad` raises."""

    def __init__(self, n, bad=-1):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch
        if i == self.bad:
            raise KeyError(f"item {i} is bad")
        return {"x": torch.full((3,), float(i)), "i": i}


def _seed_worker(worker_id):
    import torch
    torch.manual_seed(worker_id)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_dataloader_takes_a_forksafe_context(method):
    """DataLoader(multiprocessing_context=forksafe's context): it refused it (not a
    BaseContext); now two epochs of persistent workers, a worker's exception and an iterator
    dropped half-way behave as on torch's context."""
    import torch
    from torch.utils.data import DataLoader
    ctx = mp.get_context(method)
    assert isinstance(ctx, multiprocessing.context.BaseContext)
    dl = DataLoader(_Squares(32), batch_size=4, num_workers=2, multiprocessing_context=ctx,
                    persistent_workers=True, worker_init_fn=_seed_worker, timeout=T)
    for _ in range(2):
        batches = list(dl)
        assert len(batches) == 8
        assert sum(float(b["x"].sum()) for b in batches) == 3 * sum(range(32))
        assert torch.equal(torch.cat([b["i"] for b in batches]), torch.arange(32))
    del dl, batches
    it = iter(DataLoader(_Squares(32), batch_size=2, num_workers=2,
                         multiprocessing_context=ctx, timeout=T))
    next(it)
    del it
    with pytest.raises(KeyError, match="item 5 is bad") as raised:
        list(DataLoader(_Squares(16, bad=5), batch_size=2, num_workers=2,
                        multiprocessing_context=ctx, timeout=T))
    del raised  # its traceback holds the iterator, whose end stops its workers (as in torch)
    gc.collect()


def test_a_concrete_context_stays_itself():
    """get_context() of a concrete context is that context (it returned the default's, so code
    handed a spawn context started fork processes); set_start_method on it raises, as
    multiprocessing's."""
    for method in ("fork", "spawn", "forkserver"):
        ctx = mp.get_context(method)
        assert ctx.get_context() is ctx
        assert ctx.get_start_method() == method
        assert ctx.get_context("spawn") is mp.get_context("spawn")
        with pytest.raises(ValueError, match="concrete context"):
            ctx.set_start_method("spawn")
    assert mp.get_context()._name == mp.get_start_method()


IMPORT_LINES = [
    "import {m}.util",
    "from {m}.util import Finalize, register_after_fork",
    "import {m}.process",
    "import {m}.forkserver",
    "import {m}.resource_tracker",
    "import {m}.heap",
    "from {m}.reduction import ForkingPickler, register",
    "from {m} import reduction; reduction.ForkingPickler.register",
    "from {m}.managers import DictProxy, ListProxy, AutoProxy, Namespace, BaseProxy",
    "from {m}.pool import TimeoutError, ThreadPool",
    "from {m}.context import BaseContext, assert_spawning",
    "from {m}.sharedctypes import Synchronized, SynchronizedArray, SynchronizedString",
]


@pytest.mark.parametrize("line", IMPORT_LINES)
def test_multiprocessing_import_lines_work_with_the_import_swapped(line):
    """Lines that work with multiprocessing work with forksafe.multiprocessing (submodules
    that were attributes only, names its modules' __all__ leaves out)."""
    exec(line.format(m="multiprocessing"), {})
    exec(line.format(m="forksafe.multiprocessing"), {})


def test_shared_values_are_the_classes_multiprocessing_names():
    """Value and Array are instances of the sharedctypes classes under multiprocessing's names;
    a Value pickled outside forksafe's channels says what it is and what to do."""
    import pickle

    from forksafe.multiprocessing import sharedctypes
    assert isinstance(mp.Value("i", 1), sharedctypes.Synchronized)
    assert isinstance(mp.Array("c", b"ab"), sharedctypes.SynchronizedString)
    assert mp.Array("c", b"ab").value == b"ab"
    assert not isinstance(mp.Array("i", 2), sharedctypes.SynchronizedString)
    with pytest.raises(forksafe.InvalidArgumentError, match=r"Value, Array.*get_context"):
        pickle.dumps(mp.Value("i", 1))
