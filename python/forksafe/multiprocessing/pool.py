"""Pool: a pool of worker processes (multiprocessing.Pool's API) that never hangs on a dead
worker.

How it works: each worker has a Pipe of its own; one handler thread in the parent dispatches a
chunk of work to a worker only when that worker is idle, reads results, and watches the workers'
sentinels. So the parent always knows which chunk each worker holds:
- a worker that dies (a crash, SIGKILL, os._exit) fails exactly its chunk's result with
  forksafe.ProcessFailedError (multiprocessing's and torch's Pools wait for ever there), and is
  replaced while the pool runs;
- imap and imap_unordered read their input lazily: a chunk is taken from the iterable only when
  the consumer has room for it (multiprocessing reads it all up front). Each imap's input is
  read on a thread of its own (a feeder), never under the pool's lock: an input that waits for
  this same pool (a second imap over the first's results, a generator that submits work)
  cannot stop the results, or another imap's input, from being read, and terminate() never
  waits for it;
- map_async and apply_async take their input at the call (a shallow copy of the list; apply's
  arguments pickled), so the caller may change or clear it afterwards;
- a worker whose initializer raises fails the pending results with that error and the pool
  stops starting workers (multiprocessing restarts them for ever).
- a Pool dropped while running is terminated (its threads hold its workings, _PoolCore, not
  the Pool), as multiprocessing's finalizer does; a result not yet got keeps it.
Arguments and results are pickled by forksafe's pickler: numpy arrays and torch tensors cross
through shared memory. Callbacks run on the handler thread; they must not block.
"""

import atexit
import collections
import itertools
import os
import signal
import threading
import time
import weakref
from multiprocessing import TimeoutError as _stdlib_TimeoutError
from multiprocessing import connection as _stdlib_connection
from multiprocessing.pool import ExceptionWithTraceback, MaybeEncodingError, \
    RemoteTraceback  # noqa: F401 (multiprocessing.pool's names)
# A pool of threads has no fork to make safe: multiprocessing's own, under its usual name.
from multiprocessing.pool import ThreadPool  # noqa: F401

from ..errors import ProcessFailedError
from .connection import Pipe
from .reduction import close_fds, dumps

__all__ = ["Pool", "ThreadPool", "ApplyResult", "AsyncResult", "MapResult", "IMapIterator"]

TimeoutError = _stdlib_TimeoutError  # `from multiprocessing.pool import TimeoutError`

_RUN, _CLOSE, _TERMINATE = "RUN", "CLOSE", "TERMINATE"


def _worker(conn, initializer, initargs, maxtasks):
    """A pool worker's main: initializer, then tasks from `conn` until None, EOF or maxtasks."""
    try:
        if initializer is not None:
            initializer(*initargs)
    except BaseException as e:
        conn.send(("init_error", ExceptionWithTraceback(e, e.__traceback__)))
        return
    conn.send(("ready", os.getpid()))
    parent = os.getppid()
    done = 0
    while maxtasks is None or done < maxtasks:
        try:
            # A worker whose parent died (SIGKILL, os._exit) ends: its pipe may never report
            # end-of-stream, as forked siblings hold copies of the parent's ends.
            while not conn.poll(1.0):
                if os.getppid() != parent:
                    return
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        func, star, chunk = task
        try:
            result = (True, [func(*a) if star else func(a) for a in chunk])
        except (SystemExit, KeyboardInterrupt):
            # The task ended its process (sys.exit) or was interrupted: the worker ends, with that
            # exit code, and its chunk fails in the parent with ProcessFailedError (what a dead
            # worker gives), which `except Exception` catches. Sent back as the result, it
            # used to end the parent itself.
            raise
        except BaseException as e:
            result = (False, ExceptionWithTraceback(e, e.__traceback__))
        try:
            conn.send(("result", result))
        except Exception as e:
            conn.send(("result", (False, MaybeEncodingError(e, result[1]))))
        done += 1


class ApplyResult:
    """The result of apply_async (multiprocessing.pool.AsyncResult)."""

    def __init__(self, pool, callback, error_callback):
        self._pool = pool
        self._event = threading.Event()
        self._callback = callback
        self._error_callback = error_callback
        self._value = None
        self._success = None
        self._owner = None  # the Pool (kept running while this result is held)

    def ready(self):
        return self._event.is_set()

    def successful(self):
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._success

    def wait(self, timeout=None):
        self._event.wait(timeout)

    def get(self, timeout=None):
        """The result; re-raises the task's exception; TimeoutError when not ready in time."""
        self.wait(timeout)
        if not self.ready():
            raise _stdlib_TimeoutError(f"the result was not ready within {timeout} s")
        if self._success:
            return self._value
        raise self._value

    # Called on the handler thread, once per chunk (one chunk here).
    def _set(self, index, ok, value):
        if self.ready():
            return
        self._success, self._value = ok, (value[0] if ok else value)
        self._finish()

    def _finish(self):
        try:
            if self._success and self._callback is not None:
                self._callback(self._value)
            elif not self._success and self._error_callback is not None:
                self._error_callback(self._value)
        finally:
            self._event.set()
            self._pool._job_done(self)


AsyncResult = ApplyResult


class MapResult(ApplyResult):
    """The result of map_async/starmap_async: a list in input order."""

    def __init__(self, pool, callback, error_callback):
        super().__init__(pool, callback, error_callback)
        self._parts = {}
        self._expected = None  # number of chunks, once the input is split

    def _set(self, index, ok, value):
        if self.ready():
            return
        if not ok:
            self._success, self._value = False, value
            self._finish()
            return
        self._parts[index] = value
        if self._expected is not None and len(self._parts) == self._expected:
            self._success = True
            self._value = list(itertools.chain.from_iterable(
                self._parts[i] for i in range(self._expected)))
            self._finish()

    def _input_ended(self, chunks):
        self._expected = chunks
        if not self.ready() and len(self._parts) == chunks:
            self._success = True
            self._value = list(itertools.chain.from_iterable(
                self._parts[i] for i in range(chunks)))
            self._finish()


class IMapIterator:
    """The iterator imap returns: results in input order, next(timeout) as multiprocessing."""

    def __init__(self, pool, ordered):
        self._pool = pool
        self._ordered = ordered
        self._cond = threading.Condition()
        self._items = collections.deque()  # chunks ready for the consumer
        self._current = collections.deque()  # results of the chunk being consumed
        self._taken = 0  # chunks handed to the consumer
        self._parts = {}
        self._next_index = 0
        self._expected = None
        self._received = 0
        self._owner = None  # the Pool (kept running while this iterator is held)

    def __iter__(self):
        return self

    def next(self, timeout=None):
        with self._cond:
            while True:
                if self._current:
                    return self._current.popleft()
                if self._items:
                    ok, value = self._items.popleft()
                    self._taken += 1  # a chunk handed to the consumer: the pool may read on
                    self._pool._wake()
                    if not ok:
                        raise value
                    self._current.extend(value)
                    continue
                if self._expected is not None and self._received == self._expected:
                    raise StopIteration
                if not self._cond.wait(timeout):
                    raise _stdlib_TimeoutError(f"no result within {timeout} s")

    __next__ = next

    # Handler thread.
    def _set(self, index, ok, value):
        with self._cond:
            self._received += 1
            if self._ordered:
                self._parts[index] = (ok, value)
                while self._next_index in self._parts:
                    ok2, v2 = self._parts.pop(self._next_index)
                    self._push(ok2, v2)
                    self._next_index += 1
            else:
                self._push(ok, value)
            self._cond.notify_all()
        self._maybe_done()

    def _push(self, ok, value):
        self._items.append((ok, value))  # one entry per chunk (a list of results, or an error)

    def _input_ended(self, chunks):
        with self._cond:
            self._expected = chunks
            self._cond.notify_all()
        self._maybe_done()

    def _maybe_done(self):
        if self._expected is not None and self._received == self._expected:
            self._pool._job_done(self)

    def ready(self):
        return self._expected is not None and self._received == self._expected


class _Job:
    """Chunks of one call waiting for workers: (index, chunk) from an iterator. A lazy job's
    (imap) iterator is the caller's: the feeder thread reads it into `buffer`."""

    def __init__(self, result, func, star, chunks, lazy=False):
        self.result = result
        self.func = func
        self.star = star
        self.chunks = chunks  # iterator of lists
        self.next_index = 0
        self.retry = collections.deque()  # (index, chunk) to send again
        self.lazy = lazy
        self.buffer = collections.deque()  # lazy: (index, chunk) read by the feeder
        self.feeding = False  # lazy: the feeder is reading its input now (without the lock)
        self.exhausted = False  # lazy: its input ended (or raised), or the job was failed
        self.feeder = False  # lazy: a feeder thread runs for it
        self.cond = None  # lazy: its feeder waits here for room (on the pool's lock)


class _Prepared:
    """A task pickled when it was submitted (apply_async): what the caller changes afterwards
    does not reach the worker, as in multiprocessing, whose feeder pickles at once."""

    __slots__ = ("data", "tensors", "fds")

    def __init__(self, task):
        self.data, self.tensors, self.fds = dumps(task)

    def discard(self):
        close_fds(self.fds)
        self.fds = ()


class _PreparedChunks:
    """The one chunk of apply_async, pickled at the call: an iterator over it."""

    def __init__(self, prepared):
        self._prepared = prepared

    def __iter__(self):
        return self

    def __next__(self):
        if self._prepared is None:
            raise StopIteration
        p, self._prepared = self._prepared, None
        return p

    def discard(self):
        if self._prepared is not None:
            self._prepared.discard()
            self._prepared = None


class _WorkerSlot:
    def __init__(self, process, conn):
        self.process = process
        self.conn = conn
        self.ready = False
        self.task = None  # (job, index) running now
        self.done = 0


class _PoolCore:
    """A Pool's workings: its workers, its handler and feeder threads (which hold this, never
    the Pool the user holds: a Pool dropped without close() is terminated, as in
    multiprocessing), its jobs."""

    # The handler's longest wait: a safety net only. Every event it acts on (a result, a worker's
    # end, new work, close) wakes it at once; the tests lengthen it to prove that.
    _poll_s = 1.0

    def __init__(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None,
                 context=None):
        from .context import get_context
        if processes is None:
            processes = os.cpu_count() or 1
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int)
                                             or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        self._ctx = context if context is not None else get_context()
        self._processes = processes
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._maxtasks = maxtasksperchild
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._wake_lock = threading.Lock()  # the wake pipe's descriptors (closed by join)
        self._jobs = collections.deque()  # _Job with chunks left
        self._pending = set()  # results not finished
        self._state = _RUN
        self._broken = None  # the initializer's error
        self._outbox = collections.deque()  # results to deliver, outside self._lock
        self._deliver_lock = threading.RLock()
        self._abandoned = False  # the Pool was dropped on one of this pool's own threads
        self._workers = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the handler
        try:
            for _ in range(processes):
                self._workers.append(self._start_worker())
        except BaseException:  # the Nth could not start: end the ones that did
            for w in self._workers:
                w.process.kill()
                w.process.join()
                w.conn.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._handler = threading.Thread(target=self._handle, name="forksafe-pool-handler",
                                         daemon=True)
        self._handler.start()
        _live_pools.add(self)

    # ---- workers ---------------------------------------------------------------------------
    def _start_worker(self):
        parent_end, child_end = Pipe()
        try:
            p = self._ctx.Process(target=_worker,
                                  args=(child_end, self._initializer, self._initargs,
                                        self._maxtasks),
                                  daemon=True)
            # Numbered as multiprocessing's ForkPoolWorker-N: by the process-wide count that
            # numbers every Process, so names do not repeat across pools.
            p.name = p.name.replace("Process", "PoolWorker", 1)
            p.start()
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        return _WorkerSlot(p, parent_end)

    def _wake(self):
        with self._wake_lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except OSError:  # BlockingIOError: full, the handler will wake anyway
                pass

    # ---- the handler thread ------------------------------------------------------------------
    def _handle(self):
        try:
            self._handle_loop()
        except BaseException as e:  # a bug or a resource failure: fail what waits, never hang
            with self._lock:
                if self._state != _TERMINATE:
                    self._state = _TERMINATE
                from ..errors import InternalError
                err = InternalError(f"the Pool's handler thread failed ({type(e).__name__}: {e}); "
                                    "the pool is terminated")
                err.__cause__ = e
                self._fail_all_locked(err)
            try:
                self._flush()
            except BaseException:
                pass
        finally:
            self._stop_workers()
            if self._abandoned:  # nobody will call join(): the wake pipe goes here
                self._close_wake()

    def _handle_loop(self):
        while True:
            with self._lock:
                if self._state == _TERMINATE:
                    break
                if self._state == _CLOSE and not self._pending and not self._jobs:
                    break
                if self._abandoned and self._state == _RUN:
                    self._terminate_locked()
                    break
                self._dispatch_locked()
                self._wake_feeders_locked()
                waitables = [self._wake_r]
                for w in self._workers:
                    waitables.append(w.conn)
                    waitables.append(w.process.sentinel)
            # What the dispatch queued is delivered before the wait, not after it: the end of a
            # map's input is found there (the first dispatch after its last chunk), and when
            # every result is in already nothing else would wake the wait. Held back, it cost a
            # map its handler's whole poll (1 s) whenever it had more chunks than workers and
            # its last result came in before its input was seen to end.
            self._flush()
            ready = _stdlib_connection.wait(waitables, timeout=self._poll_s)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            with self._lock:
                for w in list(self._workers):
                    if w.conn in ready:
                        self._read_locked(w)
                for w in list(self._workers):
                    if w.process.sentinel in ready or not w.process.is_alive():
                        self._reap_locked(w)
            self._flush()
        self._flush()

    def _read_locked(self, w):
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            return  # the sentinel says what happened
        except Exception as e:  # a result that cannot be rebuilt here: that task fails with it
            if w.task is not None:
                job, index = w.task
                w.task = None
                w.done += 1
                self._deliver(job.result, index, False, e)
            return
        if kind == "ready":
            w.ready = True
        elif kind == "init_error":
            self._broken = payload
            self._fail_all_locked(payload)
        elif kind == "result":
            if w.task is None:
                return  # its result was failed already (terminate, an initializer's error)
            job, index = w.task
            w.task = None
            w.done += 1
            ok, value = payload
            self._deliver(job.result, index, ok, value)

    def _reap_locked(self, w):
        w.process.join(timeout=5)
        if w.process.exitcode is None and not _stdlib_connection.wait([w.process.sentinel], 0):
            return  # alive
        # Ended: its exit code, or None where it ended but cannot be waited for (the program
        # ignores SIGCHLD, so the kernel reaped it: its chunk must fail all the same, and its
        # sentinel, readable for ever, must not keep this loop spinning).
        for _ in range(4):  # what it sent before it ended: a result, an initializer's error
            if not w.conn.poll(0):
                break
            self._read_locked(w)
        self._workers.remove(w)
        w.conn.close()
        if w.task is not None:
            job, index = w.task
            code = w.process.exitcode
            how = ("exit status unknown: SIGCHLD is ignored, so the system reaped it"
                   if code is None else f"killed by {signal.Signals(-code).name}" if code < 0
                   else f"exit code {code}")
            err = ProcessFailedError(
                f"a pool worker (pid {w.process.pid}) died ({how}) while running chunk {index} "
                f"of {job.func.__qualname__ if hasattr(job.func, '__qualname__') else job.func}; "
                "that chunk's result fails with this error and the pool replaced the worker")
            self._deliver(job.result, index, False, err)
        # Replaced while the pool runs, and after close() while work is left (maxtasksperchild,
        # a crash): close() + join() must not wait for ever on chunks nobody can take.
        busy = bool(self._jobs) or any(x.task is not None for x in self._workers)
        if self._broken is None and (self._state == _RUN or (self._state == _CLOSE and busy)):
            self._workers.append(self._start_worker())

    # ---- feeder threads: each reads one imap's input without the pool's lock --------------------
    # A feeder thread per imap with room to read: an input that waits for another imap of this
    # pool (a second stage over the first's results) must not keep that one's input from being
    # read. Each waits on its own job's condition (woken only when its job has room: one
    # condition for all woke every feeder at every result, and with 200 open imaps a map took
    # 10 s instead of 0.9), and ends after _feeder_idle_s without room (an imap left
    # unconsumed keeps no thread); the handler starts one again when room comes.
    _feeder_idle_s = 1.0

    def _wants_input_locked(self, job):
        if job.exhausted or job.feeding:
            return False
        # While the pool runs, at most 2 * processes chunks are read ahead of the consumer;
        # after close() the input is read to its end (join waits for it).
        return self._state != _RUN or job.next_index - job.result._taken < 2 * self._processes

    def _wake_feeders_locked(self):
        # A result taken or a chunk sent: room to read. (A method, not a loop in the handler's
        # own frame, whose loop variable would keep the last job, its result and so its Pool
        # alive: a dropped Pool was never terminated.)
        for job in self._jobs:
            if job.lazy and self._wants_input_locked(job):
                if job.feeder:
                    job.cond.notify()
                else:
                    self._start_feeder_locked(job)

    def _start_feeder_locked(self, job):
        if job.cond is None:
            job.cond = threading.Condition(self._lock)
        job.feeder = True
        try:
            threading.Thread(target=self._feed, args=(job,), daemon=True,
                             name="forksafe-pool-feeder").start()
        except BaseException:
            job.feeder = False
            raise

    def _feed(self, job):
        ended = False
        try:
            self._feed_job(job)
            ended = True
        finally:
            with self._lock:
                job.feeder = False
                if ended and self._wants_input_locked(job) and self._state != _TERMINATE:
                    self._start_feeder_locked(job)  # room came as this one was ending

    def _feed_job(self, job):
        while True:
            with self._lock:
                while True:
                    if self._state == _TERMINATE or job.exhausted:
                        return
                    if self._wants_input_locked(job):
                        break
                    if not job.cond.wait(self._feeder_idle_s):
                        if not self._wants_input_locked(job):
                            return  # idle: the handler starts a feeder again when room comes
                job.feeding = True
            chunk, end, err = None, False, None
            try:
                chunk = next(job.chunks)
            except StopIteration:
                end = True
            except BaseException as e:  # the caller's iterable raised: its chunk fails with it
                err = e
            with self._lock:
                job.feeding = False
                if job.exhausted:
                    continue  # failed meanwhile (terminate, an initializer's error)
                if err is not None:
                    self._deliver(job.result, job.next_index, False, err)
                    job.next_index += 1
                    job.exhausted = True
                elif end:
                    job.exhausted = True
                else:
                    job.buffer.append((job.next_index, chunk))
                    job.next_index += 1
            self._wake()

    def _deliver(self, result, index, ok, value):
        # Queued under self._lock, run by _flush without it: callbacks may submit more work.
        self._outbox.append((result, index, ok, value))

    def _flush(self):
        with self._deliver_lock:
            while self._outbox:
                result, index, ok, value = self._outbox.popleft()
                try:
                    if ok is None:
                        result._input_ended(value)
                    else:
                        result._set(index, ok, value)
                except Exception:  # a callback raised: as in multiprocessing, the pool goes on
                    import traceback
                    traceback.print_exc()

    def _next_chunk_locked(self):
        for job in self._jobs:
            if job.retry:  # chunks whose worker was gone when they were sent
                index, chunk = job.retry.popleft()
                return job, index, chunk
        return self._fresh_chunk_locked()

    def _fresh_chunk_locked(self):
        """(job, index, chunk) for an idle worker, or None. An imap job gives a chunk only while
        fewer than 2 * processes of its chunks are running or waiting for the consumer: its
        input is read as results are consumed, never all at once."""
        for job in list(self._jobs):
            if job.result.ready() and not isinstance(job.result, IMapIterator):
                self._jobs.remove(job)  # failed already: skip its other chunks
                continue
            if job.lazy:
                if job.buffer:
                    index, chunk = job.buffer.popleft()
                    return job, index, chunk
                if job.exhausted and not job.feeding:
                    self._jobs.remove(job)
                    self._end_input(job)
                continue
            try:
                chunk = next(job.chunks)
            except StopIteration:
                self._jobs.remove(job)
                self._end_input(job)
                continue
            except BaseException as e:  # the caller's iterable raised
                self._jobs.remove(job)
                self._deliver(job.result, job.next_index, False, e)
                job.next_index += 1
                self._end_input(job)
                continue
            job.next_index += 1
            return job, job.next_index - 1, chunk
        return None

    def _dispatch_locked(self):
        for w in self._workers:
            if not self._jobs:
                return
            if not w.ready or w.task is not None:
                continue
            if self._maxtasks is not None and w.done >= self._maxtasks:
                continue
            while True:
                picked = self._next_chunk_locked()
                if picked is None:
                    return
                job, index, chunk = picked
                try:
                    if isinstance(chunk, _Prepared):
                        w.conn._send_dumped(chunk.data, chunk.tensors, chunk.fds)
                        chunk.discard()  # sent: its descriptors are the worker's now
                    else:
                        w.conn.send((job.func, job.star, chunk))
                except (OSError, EOFError):  # the worker died idle: another one takes the chunk
                    job.retry.append((index, chunk))
                    if job not in self._jobs:
                        self._jobs.appendleft(job)
                    w.ready = False
                    break
                except Exception as e:  # an argument cannot be pickled: that chunk fails
                    self._deliver(job.result, index, False, e)
                    continue
                w.task = (job, index)
                break

    def _end_input(self, job):
        if isinstance(job.result, (MapResult, IMapIterator)):
            self._deliver(job.result, None, None, job.next_index)  # "the input had n chunks"

    def _fail_all_locked(self, err):
        for w in self._workers:
            if w.task is not None:
                job, index = w.task
                w.task = None
                self._deliver(job.result, index, False, err)
        for job in list(self._jobs):
            while job.retry:
                index, chunk = job.retry.popleft()
                if isinstance(chunk, _Prepared):
                    chunk.discard()
                self._deliver(job.result, index, False, err)
            while job.buffer:
                self._deliver(job.result, job.buffer.popleft()[0], False, err)
            job.exhausted = True
            if job.cond is not None:
                job.cond.notify()  # its feeder ends
            if isinstance(job.chunks, _PreparedChunks):
                job.chunks.discard()
            self._deliver(job.result, job.next_index, False, err)
            job.next_index += 1
            if isinstance(job.result, (MapResult, IMapIterator)):
                self._deliver(job.result, None, None, job.next_index)
        self._jobs.clear()

    def _job_done(self, result):
        self._pending.discard(result)

    def _stop_workers(self):
        with self._lock:
            workers = list(self._workers)
            terminate = self._state == _TERMINATE
        for w in workers:
            if terminate:
                if w.process.is_alive():
                    w.process.kill()
            else:
                try:
                    w.conn.send(None)
                except Exception:
                    pass
        # Each worker's end is polled (its exit status, or its sentinel), not waited for on the
        # sentinel alone: a worker's sentinel pipe stays open while any process forked at the
        # moment it started holds its other end (Pools started from several threads at once),
        # and that wait ran its whole 10 s per worker at exit.
        deadline = time.monotonic() + 10
        for w in workers:
            if not _wait_ended(w.process, deadline):
                w.process.kill()
                _wait_ended(w.process, time.monotonic() + 10)
            w.conn.close()

    # ---- submitting ---------------------------------------------------------------------------
    def _check_running(self):
        if os.getpid() != self._pid:
            raise RuntimeError("this Pool belongs to the process that made it (pid "
                               f"{self._pid}); make a new Pool in the child")
        if self._state != _RUN:
            raise ValueError("Pool not running")
        if self._broken is not None:
            raise self._broken

    @staticmethod
    def _check_func(func):
        # A function that cannot reach the workers (a lambda, a local function) fails here,
        # with forksafe.InvalidArgumentError naming it.
        _, _, fds = dumps(func)
        close_fds(fds)

    def _submit(self, result, func, star, chunks, lazy=False, checked=False):
        if not checked:
            self._check_func(func)
        with self._lock:
            try:
                self._check_running()
            except BaseException:
                if isinstance(chunks, _PreparedChunks):
                    chunks.discard()
                raise
            self._pending.add(result)
            self._jobs.append(_Job(result, func, star, chunks, lazy))
            if lazy:
                self._start_feeder_locked(self._jobs[-1])
        self._wake()
        return result

    @staticmethod
    def _chunks(iterable, chunksize):
        it = iter(iterable)
        while True:
            chunk = list(itertools.islice(it, chunksize))
            if not chunk:
                return
            yield chunk

    def _default_chunksize(self, n):
        chunksize, extra = divmod(n, self._processes * 4)
        return chunksize + 1 if extra else max(chunksize, 1)

    def apply_async(self, func, args=(), kwds={}, callback=None, error_callback=None):
        """func(*args, **kwds) in a worker; an ApplyResult."""
        result = ApplyResult(self, callback, error_callback)
        self._check_func(func)  # (the arguments fail at get(), as in multiprocessing)
        call = _Call(func, kwds)
        try:
            task = _Prepared((call, True, [tuple(args)]))
        except Exception as e:  # an argument that cannot be pickled: the result fails with it
            with self._lock:
                self._check_running()
            result._set(0, False, e)
            return result
        return self._submit(result, call, True, _PreparedChunks(task), checked=True)

    def apply(self, func, args=(), kwds={}):
        return self.apply_async(func, args, kwds).get()

    def map_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._map_async(func, iterable, False, chunksize, callback, error_callback)

    def starmap_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._map_async(func, iterable, True, chunksize, callback, error_callback)

    def _map_async(self, func, iterable, star, chunksize, callback, error_callback):
        # A shallow copy, taken now: the caller may clear or refill its list meanwhile (the
        # chunks are made as workers free up).
        items = list(iterable)
        if chunksize is None:
            chunksize = self._default_chunksize(len(items))
        if chunksize < 1:
            raise ValueError(f"chunksize must be at least 1, not {chunksize}")
        result = MapResult(self, callback, error_callback)
        return self._submit(result, func, star, self._chunks(items, chunksize))

    def map(self, func, iterable, chunksize=None):
        """[func(x) for x in iterable], computed by the workers, in order."""
        return self.map_async(func, iterable, chunksize).get()

    def starmap(self, func, iterable, chunksize=None):
        """[func(*args) for args in iterable], computed by the workers, in order."""
        return self.starmap_async(func, iterable, chunksize).get()

    def imap(self, func, iterable, chunksize=1):
        """An iterator of func(x) in input order; the input is read as workers free up."""
        if chunksize < 1:
            raise ValueError(f"chunksize must be at least 1, not {chunksize}")
        return self._submit(IMapIterator(self, True), func, False,
                            self._chunks(iterable, chunksize), lazy=True)

    def imap_unordered(self, func, iterable, chunksize=1):
        """Like imap, in the order results arrive."""
        if chunksize < 1:
            raise ValueError(f"chunksize must be at least 1, not {chunksize}")
        return self._submit(IMapIterator(self, False), func, False,
                            self._chunks(iterable, chunksize), lazy=True)

    # ---- ending -----------------------------------------------------------------------------
    def close(self):
        """No more tasks; the workers exit once the submitted ones are done (join waits)."""
        with self._lock:
            if self._state == _RUN:
                self._state = _CLOSE
        self._wake()

    def _terminate_locked(self):
        from ..errors import CancelledError
        self._state = _TERMINATE
        self._fail_all_locked(CancelledError("the Pool was terminated before this task "
                                             "finished"))

    def _is_own_thread(self):
        me = threading.current_thread()
        return me is self._handler or me.name == "forksafe-pool-feeder"

    def terminate(self):
        """Stops the workers now; results not finished fail with forksafe.CancelledError."""
        with self._lock:
            if self._state == _TERMINATE:
                return
            self._terminate_locked()
        self._flush()
        self._wake()
        if os.getpid() == self._pid and threading.current_thread() is not self._handler:
            self._handler.join()
            self._close_wake()

    def join(self):
        """Waits for the workers to exit; call close() or terminate() first."""
        if self._state == _RUN:
            raise ValueError("Pool is still running: call close() or terminate() first")
        if threading.current_thread() is self._handler:
            raise RuntimeError("Pool.join() from one of its own callbacks would wait for itself")
        if os.getpid() == self._pid:
            self._handler.join()
        self._close_wake()

    def _close_wake(self):
        with self._wake_lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


class Pool:
    """A pool of `processes` worker processes (os.cpu_count() by default)."""

    def __init__(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None,
                 context=None):
        self._core = _PoolCore(processes, initializer, initargs, maxtasksperchild, context)

    def __getattr__(self, name):
        # The workings' state (_workers, _state, ...), for tests and debugging.
        if name == "_core":
            raise AttributeError(name)
        return getattr(self._core, name)

    def _owned(self, result):
        result._owner = self  # a result not yet got keeps its Pool running
        return result

    def apply_async(self, func, args=(), kwds={}, callback=None, error_callback=None):
        """func(*args, **kwds) in a worker; an ApplyResult."""
        return self._owned(self._core.apply_async(func, args, kwds, callback, error_callback))

    def apply(self, func, args=(), kwds={}):
        return self.apply_async(func, args, kwds).get()

    def map_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._owned(self._core.map_async(func, iterable, chunksize, callback,
                                                error_callback))

    def starmap_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._owned(self._core.starmap_async(func, iterable, chunksize, callback,
                                                    error_callback))

    def map(self, func, iterable, chunksize=None):
        """[func(x) for x in iterable], computed by the workers, in order."""
        return self.map_async(func, iterable, chunksize).get()

    def starmap(self, func, iterable, chunksize=None):
        """[func(*args) for args in iterable], computed by the workers, in order."""
        return self.starmap_async(func, iterable, chunksize).get()

    def imap(self, func, iterable, chunksize=1):
        """An iterator of func(x) in input order; the input is read as the consumer takes."""
        return self._owned(self._core.imap(func, iterable, chunksize))

    def imap_unordered(self, func, iterable, chunksize=1):
        """Like imap, in the order results arrive."""
        return self._owned(self._core.imap_unordered(func, iterable, chunksize))

    def close(self):
        """No more tasks; the workers exit once the submitted ones are done (join waits)."""
        self._core.close()

    def terminate(self):
        """Stops the workers now; results not finished fail with forksafe.CancelledError."""
        self._core.terminate()

    def join(self):
        """Waits for the workers to exit; call close() or terminate() first."""
        self._core.join()

    def __enter__(self):
        self._core._check_running()
        return self

    def __exit__(self, *exc):
        self.terminate()

    def __del__(self):
        # Dropped while running (no close(), no with): terminated, as multiprocessing's Pool is
        # by its finalizer, with the same ResourceWarning. Its workers and threads used to live
        # until the interpreter exited (10 x Pool(2).map(...) left 20 processes).
        core = self.__dict__.get("_core")
        if core is None or core._state != _RUN or os.getpid() != core._pid:
            return
        try:
            import warnings
            warnings.warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning,
                          source=self)
            if core._is_own_thread():
                # Dropped on the pool's own thread (a finished job let go of its last result),
                # which may hold the pool's lock here: the handler terminates it (terminate()
                # here waited for that lock for ever, and so did the program's exit).
                core._abandoned = True
                core._wake()
            else:
                core.terminate()
        except Exception:
            pass

    def __reduce__(self):
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")


_live_pools = weakref.WeakSet()


def _wait_ended(process, deadline):
    """True once `process` has ended (reaped, or its sentinel readable: with SIGCHLD ignored
    there is no status to reap), polling until `deadline`."""
    pause = 0.001
    while True:
        if process.exitcode is not None or _stdlib_connection.wait([process.sentinel], 0):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


@atexit.register
def _terminate_live_pools():
    # A Pool nobody closed: its handler thread keeps it alive, so end it at exit, before
    # multiprocessing's own exit handler waits for children.
    for pool in list(_live_pools):
        try:
            if pool._state != _TERMINATE and os.getpid() == pool._pid:
                pool.terminate()
        except Exception:
            pass


class _Call:
    """func with keyword arguments, picklable when func is."""

    def __init__(self, func, kwds):
        self.func = func
        self.kwds = dict(kwds)
        self.__qualname__ = getattr(func, "__qualname__", repr(func))

    def __call__(self, *args):
        return self.func(*args, **self.kwds)
