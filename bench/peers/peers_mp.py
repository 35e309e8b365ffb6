"""bench/peers/peers_mp.py: the side-by-side workloads written with Python's multiprocessing and
numpy arrays.

Same work, same checks and same JSON lines as peers_forksafe.cc (see docs/peers.md):

    /usr/bin/python3 bench/peers/peers_mp.py --round 1 [--only w1,w6]

What "a tensor" is here, since multiprocessing has no tensor type:
  - already shared (workload 1): a multiprocessing.shared_memory.SharedMemory block viewed as a
    numpy array; its name crosses the Queue and the receiver attaches once per block (cached),
    as forksafe and torch map a segment once.
  - fresh (workload 2) and Pool inputs (workload 3): plain numpy arrays, pickled through the pipe
    (a copy), which is what multiprocessing does with them.
Start methods as the others: "fork" for Queue/Pool work, "spawn" and "fork" for workload 4.
multiprocessing has no spawn() helper with error propagation: peerlib.spawn2_by_hand is the
loop its users write (wait on the sentinels, terminate the others on the first failure).
"""
import multiprocessing as mp
import os
import statistics
import threading
import time
from multiprocessing import shared_memory

import numpy as np

import peerlib
from peerlib import now_us

SYSTEM = "mp"


# ---- 1. Queue round trip of an already-shared array ------------------------------------------------

def attach(name, n, cache):
    got = cache.get(name)
    if got is None:
        # Under "fork" the child shares the creator's resource tracker, so attaching registers
        # nothing new; the creator unlinks the block.
        shm = shared_memory.SharedMemory(name=name)
        got = cache[name] = (shm, np.ndarray((n,), np.float32, buffer=shm.buf))
    return got[1]


def shm_echo(inq, outq):
    peerlib.pin_child()
    cache = {}
    while True:
        m = inq.get()
        if m is None:
            return
        a = attach(m[0], m[1], cache)
        a[1] = a[0] + 1
        outq.put(m)


def round_trip(out, plan, nbytes):
    n = nbytes // 4
    # Created before the child starts, so that the child shares this process's resource tracker.
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    ctx = mp.get_context("fork")
    to, frm = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=shm_echo, args=(to, frm))
    p.start()
    a = np.ndarray((n,), np.float32, buffer=shm.buf)
    a[:] = 0
    cache = {shm.name: (shm, a)}
    msg = (shm.name, n)

    def it(i):
        a[0] = i
        t0 = now_us()
        to.put(msg)
        m = frm.get()
        us = now_us() - t0
        if attach(m[0], m[1], cache)[1] != i + 1:
            raise RuntimeError("round trip: the child's write is not visible")
        return us

    try:
        samples = peerlib.measure(plan, it)
    finally:
        to.put(None)
        p.join(10)
        del a, cache
        shm.close()
        shm.unlink()
    out.samples("w1_roundtrip", peerlib.size_name(nbytes), nbytes, plan, samples)


# ---- 2. Queue send of fresh arrays -----------------------------------------------------------------

def array_ack(inq, outq):
    peerlib.pin_child()
    while True:
        a = inq.get()
        if a is None:
            return
        outq.put(float(a[0]) + float(a[-1]))


def fresh_send(out, plan, nbytes, timed_creation=False):
    """Workload 2: a fresh tensor per iteration, sent to the acknowledging child. With
    `timed_creation`, np.full is timed too ("w2_create_send"; forksafe's C++ program makes its
    tensor born shared there); otherwise only put + the child's ack ("w2_fresh")."""
    n = nbytes // 4
    ctx = mp.get_context("fork")
    to, frm = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=array_ack, args=(to, frm))
    p.start()

    def it(i):
        t0 = now_us()
        a = np.full(n, i, np.float32)  # fresh, private, filled
        if not timed_creation:
            t0 = now_us()
        to.put(a)  # the feeder thread pickles it into the pipe
        ack = frm.get()
        us = now_us() - t0
        if ack != 2.0 * i:
            raise RuntimeError("fresh send: wrong acknowledgement")
        return us

    samples = peerlib.measure(plan, it)
    to.put(None)
    p.join(10)
    out.samples("w2_create_send" if timed_creation else "w2_fresh", peerlib.size_name(nbytes),
                nbytes, plan, samples)


# ---- 3. Pool(2).map of a reduction over arrays ----------------------------------------------------

def array_sum(a):
    return float(a.sum())


def pool_map(out, plan, count, nbytes):
    n = nbytes // 4
    inputs = [np.full(n, i % 7, np.float32) for i in range(count)]
    expected = [float(n * (i % 7)) for i in range(count)]
    pool = mp.get_context("fork").Pool(2)

    def it(i):
        t0 = now_us()
        sums = pool.map(array_sum, inputs)
        us = now_us() - t0
        if sums != expected:
            raise RuntimeError("pool map: wrong sums")
        return us

    try:
        samples = peerlib.measure(plan, it)
    finally:
        pool.close()
        pool.join()
    out.samples("w3_poolmap", "%d x %s" % (count, peerlib.size_name(nbytes)), nbytes, plan,
                samples, tasks=count)

    # The reductions alone, serially in this process (for the breakdown of workload 3).
    def serial(i):
        t0 = now_us()
        sums = [array_sum(x) for x in inputs]
        us = now_us() - t0
        if sums != expected:
            raise RuntimeError("serial sums: wrong")
        return us

    out.samples("bd_sum_serial", "%d x %s" % (count, peerlib.size_name(nbytes)), nbytes, plan,
                peerlib.measure(plan, serial))


# ---- 4. two processes end to end, and a child's failure to the parent's error ---------------------

def trivial(i):
    pass


def spawn2(out, plan, method):
    ctx = mp.get_context(method)

    def it(i):
        t0 = now_us()
        procs = peerlib.spawn2_by_hand(ctx, trivial, lambda k: (k,))
        us = now_us() - t0
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError("spawn: a child failed")
        return us

    samples = peerlib.measure(plan, it)
    out.samples("w4_spawn" if method == "spawn" else "w4_spawn_fork", "start=" + method, 0, plan,
                samples)


def fail_one(i, path):
    if i == 1:
        peerlib.write_now(path)
        raise RuntimeError("boom")  # multiprocessing prints the traceback, exits with code 1
    time.sleep(30)


def failure_latency(out, plan):
    path = "/dev/shm/peers_fail_%d" % os.getpid()
    ctx = mp.get_context("fork")

    def it(i):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        try:
            peerlib.spawn2_by_hand(ctx, fail_one, lambda k: (k, path))
        except peerlib.ChildFailed as e:
            caught = time.monotonic_ns()
            if e.index != 1 or e.exitcode != 1:
                raise RuntimeError("failure: wrong error")
            return (caught - peerlib.read_ns(path)) / 1e3
        raise RuntimeError("failure: no error")

    # The failing child's traceback goes to stderr; keep the progress readable.
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    os.dup2(devnull, 2)
    try:
        samples = peerlib.measure(plan, it)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    os.unlink(path)
    out.samples("w4_failure", "start=fork", 0, plan, samples)


# ---- 5. Pool start + first result + close ---------------------------------------------------------

def square(x):
    return x * x


def pool_lifecycle(out, plan):
    """Also records the three phases (pool built, first result, closed + joined)."""
    ctx = mp.get_context("fork")
    phases = dict(start=[], first_result=[], close_join=[])

    def it(i):
        t0 = now_us()
        pool = ctx.Pool(2)
        t1 = now_us()
        r = pool.apply(square, (i,))
        t2 = now_us()
        pool.close()
        pool.join()
        t3 = now_us()
        if r != i * i:
            raise RuntimeError("pool: wrong result")
        if i >= plan["warmup"]:
            phases["start"].append(t1 - t0)
            phases["first_result"].append(t2 - t1)
            phases["close_join"].append(t3 - t2)
        return t3 - t0

    samples = peerlib.measure(plan, it)
    out.samples("w5_pool", "start=fork", 0, plan, samples,
                phases_us={k: round(statistics.median(v), 1) for k, v in phases.items()})


# ---- 6. Fork while a numpy-heavy thread runs ------------------------------------------------------

def busy_fork(out, plan):
    a, b = np.random.rand(256, 256), np.random.rand(256, 256)
    x, y = np.random.rand(1 << 20), np.random.rand(1 << 20)
    ca, cb = np.random.rand(64, 64), np.random.rand(64, 64)
    ref_dot = ca @ cb
    ones = np.ones(1 << 20, np.float32)
    stop = threading.Event()
    work = [0]

    def busy():
        z = np.empty(1 << 20)
        while not stop.is_set():
            np.dot(a, b)               # BLAS (Debian's libblas.so.3 alternative)
            np.add(x, y, out=z)
            work[0] += 1

    th = threading.Thread(target=busy, daemon=True)
    th.start()
    while work[0] < 20:
        time.sleep(0.001)
    # Every trial counts towards trials/hangs/failures (warm-ups too); `status` holds the outcome
    # of each timed one (0 ok, 1 failed, 2 hung), so that latencies are read from the good ones.
    stats = dict(trials=0, hangs=0, failures=0, status=[])

    def it(i):
        stats["trials"] += 1
        t0 = now_us()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ok = np.array_equal(ca @ cb, ref_dot) and float(ones.sum()) == float(1 << 20)
                code = 0 if ok else 1
            finally:
                os._exit(code)
        r = peerlib.wait_bounded(pid, 2000)
        us = now_us() - t0
        if r == 2:
            stats["hangs"] += 1
        elif r == 1:
            stats["failures"] += 1
        if i >= plan["warmup"]:
            stats["status"].append(r)
        return us

    try:
        samples = peerlib.measure(plan, it)
    finally:
        stop.set()
        th.join()
    out.samples("w6_busy_fork", "", 0, plan, samples, **stats)


def main():
    args = peerlib.parse_args()
    plans = peerlib.load_plan(args.plan)
    out = peerlib.Emitter(SYSTEM, args.round, args.suffix, args.only)
    if args.wants("w1"):
        for b in peerlib.SIZES:
            out.guard("w1_roundtrip", peerlib.size_name(b),
                      lambda: round_trip(out, plans["w1_roundtrip"], b))
    if args.wants("w2"):
        for b in peerlib.SIZES:
            out.guard("w2_fresh", peerlib.size_name(b),
                      lambda: fresh_send(out, plans["w2_fresh"], b))
        for b in peerlib.SIZES:
            out.guard("w2_create_send", peerlib.size_name(b),
                      lambda: fresh_send(out, plans["w2_fresh"], b, True))
    if args.wants("w3"):
        out.guard("w3_poolmap", "2000 x 4 KiB",
                  lambda: pool_map(out, plans["w3_poolmap"], 2000, 4 * peerlib.KIB))
        out.guard("w3_poolmap", "500 x 1 MiB",
                  lambda: pool_map(out, plans["w3_poolmap"], 500, peerlib.MIB))
    if args.wants("w4"):
        out.guard("w4_spawn", "start=spawn", lambda: spawn2(out, plans["w4_spawn"], "spawn"))
        out.guard("w4_spawn_fork", "start=fork",
                  lambda: spawn2(out, plans["w4_spawn_fork"], "fork"))
        out.guard("w4_failure", "start=fork", lambda: failure_latency(out, plans["w4_failure"]))
    if args.wants("w5"):
        out.guard("w5_pool", "start=fork", lambda: pool_lifecycle(out, plans["w5_pool"]))
    if args.wants("w6"):
        out.guard("w6_busy_fork", "", lambda: busy_fork(out, plans["w6_busy_fork"]))


if __name__ == "__main__":
    main()
