"""bench/peers/peers_torch.py: the side-by-side workloads written with torch.multiprocessing
(and, with PEERS_PY_SYSTEM=forksafe_py, the same script on forksafe.multiprocessing).

Same work, same checks and same JSON lines as peers_forksafe.cc (see docs/peers.md). Run with
Debian's interpreter, which has python3-torch:

    /usr/bin/python3 bench/peers/peers_torch.py --round 1 [--only w1,w6]

torch's defaults are kept: start method "fork" for Queue/Pool work (torch.multiprocessing.Pool
is multiprocessing's Pool with torch's reductions), "spawn" for torch.multiprocessing.spawn, and
the "file_descriptor" sharing strategy.
"""
import ctypes
import os
import statistics
import threading
import time

import torch

import peerlib
from peerlib import now_us

# PEERS_PY_SYSTEM=forksafe_py runs the same script on forksafe.multiprocessing (the Python
# package, on PYTHONPATH: bench/peers/run.sh assembles it): Python against Python, with only the
# import changed.
SYSTEM = os.environ.get("PEERS_PY_SYSTEM", "torch")
if SYSTEM == "forksafe_py":
    import forksafe.multiprocessing as tmp
elif SYSTEM == "torch":
    import torch.multiprocessing as tmp
else:
    raise SystemExit(f"PEERS_PY_SYSTEM={SYSTEM!r}: use torch (the default) or forksafe_py")


# ---- 1. Queue round trip of an already-shared tensor ---------------------------------------------

def tensor_echo(inq, outq):
    peerlib.pin_child()
    while True:
        t = inq.get()
        if t is None:
            return
        t[1] = t[0] + 1
        outq.put(t)
        del t


def round_trip(out, plan, nbytes):
    n = nbytes // 4
    ctx = tmp.get_context("fork")
    to, frm = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=tensor_echo, args=(to, frm))
    p.start()
    t = torch.zeros(n).share_memory_()

    def it(i):
        t[0] = i
        t0 = now_us()
        to.put(t)
        r = frm.get()
        us = now_us() - t0
        if r.numel() != n or r[1].item() != i + 1:
            raise RuntimeError("round trip: the child's write is not visible")
        return us

    samples = peerlib.measure(plan, it)
    to.put(None)
    p.join(10)
    out.samples("w1_roundtrip", peerlib.size_name(nbytes), nbytes, plan, samples)


# ---- 2. Queue send of fresh tensors ----------------------------------------------------------------

def tensor_ack(inq, outq):
    peerlib.pin_child()
    while True:
        t = inq.get()
        if t is None:
            return
        outq.put(float(t[0]) + float(t[-1]))
        del t


def fresh_send(out, plan, nbytes, timed_creation=False):
    """Workload 2: a fresh tensor per iteration, sent to the acknowledging child. With
    `timed_creation`, torch.full is timed too ("w2_create_send"; forksafe's C++ program makes its
    tensor born shared there); otherwise only put + the child's ack ("w2_fresh")."""
    n = nbytes // 4
    ctx = tmp.get_context("fork")
    to, frm = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=tensor_ack, args=(to, frm))
    p.start()

    def it(i):
        t0 = now_us()
        t = torch.full((n,), float(i))  # fresh, private, filled
        if not timed_creation:
            t0 = now_us()
        to.put(t)  # the feeder thread moves it to shared memory and sends the handle
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


# ---- 3. Pool(2).map of a reduction over tensors ---------------------------------------------------

def tensor_sum(t):
    return float(t.sum())


def pool_map(out, plan, count, nbytes):
    n = nbytes // 4
    inputs = [torch.full((n,), float(i % 7)).share_memory_() for i in range(count)]
    expected = [float(n * (i % 7)) for i in range(count)]
    pool = tmp.Pool(2)

    def it(i):
        t0 = now_us()
        sums = pool.map(tensor_sum, inputs)
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
        sums = [tensor_sum(x) for x in inputs]
        us = now_us() - t0
        if sums != expected:
            raise RuntimeError("serial sums: wrong")
        return us

    out.samples("bd_sum_serial", "%d x %s" % (count, peerlib.size_name(nbytes)), nbytes, plan,
                peerlib.measure(plan, serial))


# ---- 4. spawn(nprocs=2), and a child's failure to the parent's error ------------------------------

def trivial(i):
    pass


def spawn2(out, plan, method):
    def it(i):
        t0 = now_us()
        # What start_processes(join=True) does, keeping the context to check the exit codes.
        ctx = tmp.start_processes(trivial, nprocs=2, join=False, start_method=method)
        while not ctx.join():
            pass
        us = now_us() - t0
        if any(p.exitcode != 0 for p in ctx.processes):
            raise RuntimeError("spawn: a child failed")
        return us

    samples = peerlib.measure(plan, it)
    out.samples("w4_spawn" if method == "spawn" else "w4_spawn_fork", "start=" + method, 0, plan,
                samples)


def fail_one(i, path):
    if i == 1:
        peerlib.write_now(path)
        raise RuntimeError("boom")
    time.sleep(30)


def failure_latency(out, plan):
    path = "/dev/shm/peers_fail_%d" % os.getpid()

    def it(i):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        try:
            tmp.start_processes(fail_one, args=(path,), nprocs=2, start_method="fork")
        except tmp.ProcessRaisedException as e:
            caught = time.monotonic_ns()
            if e.error_index != 1 or "boom" not in str(e):
                raise RuntimeError("failure: wrong exception")
            return (caught - peerlib.read_ns(path)) / 1e3
        raise RuntimeError("failure: spawn did not raise")

    samples = peerlib.measure(plan, it)
    os.unlink(path)
    out.samples("w4_failure", "start=fork", 0, plan, samples)


# ---- 5. Pool start + first result + close ---------------------------------------------------------

def square(x):
    return x * x


def pool_lifecycle(out, plan):
    """Also records the three phases (pool built, first result, closed + joined)."""
    phases = dict(start=[], first_result=[], close_join=[])

    def it(i):
        t0 = now_us()
        pool = tmp.Pool(2)
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


# ---- 6. Fork while the intra-op thread pool is busy -----------------------------------------------

def busy_fork(out, plan, workaround, param=None):
    """workaround: the child calls torch.set_num_threads(1) before its op, as torch's DataLoader
    workers do (a forked child that enters an OpenMP region its parent's forking thread had used
    hangs in libgomp: docs/peers.md). param: the row's name, when not one of those two."""
    torch.set_num_threads(2)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)
    # The forking thread has used the intra-op pool too (as a training loop would have).
    ca, cb = torch.randn(64, 64), torch.randn(64, 64)
    ref_mm = torch.mm(ca, cb)
    ones = torch.ones(1 << 20)
    stop = threading.Event()
    work = [0]

    def busy():
        z = torch.empty(1 << 20)
        while not stop.is_set():
            torch.mm(a, b)              # BLAS
            torch.add(x, y, out=z)      # at::parallel_for over the OpenMP pool (2 threads)
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
                if workaround:
                    torch.set_num_threads(1)
                ok = torch.equal(torch.mm(ca, cb), ref_mm) and float(ones.sum()) == float(1 << 20)
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
    if param is None:
        param = "child set_num_threads(1)" if workaround else ""
    out.samples("w6_busy_fork", param, 0, plan, samples, **stats)


def load_forksafe():
    """Loads libforksafe.so (path in PEERS_FORKSAFE_LIB; bench/peers/run.sh builds it) into this
    process, as a framework that embeds forksafe would. Loading it registers forksafe's at-fork
    handlers, the OpenMP one among them (runtime/openmp_fork.h): torch's own os.fork() then goes
    through them. Once loaded it stays, so this is the last variant main() runs."""
    path = os.environ.get("PEERS_FORKSAFE_LIB", "")
    if not path:
        raise RuntimeError("PEERS_FORKSAFE_LIB is not set: point it at libforksafe.so "
                           "(bazel build //:libforksafe.so)")
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


FORKSAFE_LOADED = "forksafe loaded (libforksafe.so)"


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
    if args.wants("w6") and SYSTEM == "forksafe_py":
        # forksafe is loaded (imported): its at-fork handlers cover torch's os.fork().
        out.guard("w6_busy_fork", "", lambda: busy_fork(out, plans["w6_busy_fork"], False))
    elif args.wants("w6"):
        out.guard("w6_busy_fork", "", lambda: busy_fork(out, plans["w6_busy_fork"], False))
        out.guard("w6_busy_fork", "child set_num_threads(1)",
                  lambda: busy_fork(out, plans["w6_busy_fork"], True))
        # Last: once loaded, forksafe stays in this process.
        out.guard("w6_busy_fork", FORKSAFE_LOADED,
                  lambda: (load_forksafe(),
                           busy_fork(out, plans["w6_busy_fork"], False, FORKSAFE_LOADED)))


if __name__ == "__main__":
    main()
