"""bench/peers/peerlib.py: the measuring loop and JSON-lines output of the Python peers.

The same rule as bench/peers/harness.h (the C++ side): `warmup` untimed iterations, then timed
ones until max_iters, or min_iters and max_s seconds, or cap_s seconds (bench/peers/plan.txt).
One JSON object per line on stdout; progress on stderr.
"""
import argparse
import json
import os
import select
import signal
import statistics
import sys
import time

KIB = 1 << 10
MIB = 1 << 20
SIZES = [4 * KIB, 1 * MIB, 64 * MIB]


def size_name(b):
    if b >= MIB:
        return "%d MiB" % (b // MIB)
    if b >= KIB:
        return "%d KiB" % (b // KIB)
    return "%d B" % b


def load_plan(path):
    plans = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, warmup, mn, mx, max_s, cap_s = line.split()[:6]
            plans[name] = dict(warmup=int(warmup), min_iters=int(mn), max_iters=int(mx),
                               max_s=float(max_s), cap_s=float(cap_s))
    return plans


def measure(plan, it):
    """it(i) runs iteration i and returns the microseconds of its timed part (raises if wrong)."""
    for i in range(plan["warmup"]):
        it(i)
    samples = []
    start = time.monotonic()
    for i in range(plan["max_iters"]):
        samples.append(it(plan["warmup"] + i))
        s = time.monotonic() - start
        if len(samples) >= plan["min_iters"] and s >= plan["max_s"]:
            break
        if s >= plan["cap_s"]:
            break
    return samples


def pin_child():
    """In the child of a round trip: pins it to CPU $PEERS_CHILD_CPU when that is set (run.sh
    pins the parent with taskset), to measure the cross-CPU case deterministically."""
    cpu = os.environ.get("PEERS_CHILD_CPU")
    if cpu:
        os.sched_setaffinity(0, {int(cpu)})


def now_us():
    return time.perf_counter_ns() / 1e3


class Emitter:
    def __init__(self, system, rnd, suffix="", only=()):
        self.system = system
        self.round = rnd
        self.suffix = suffix  # appended to every param (" [1 CPU]" for the pinned runs)
        self.only = list(only)  # --only's prefixes: guard() runs only the workloads they name

    def _head(self, workload, param):
        return {"system": self.system, "round": self.round, "workload": workload,
                "param": param + self.suffix}

    def samples(self, workload, param, nbytes, plan, samples, **extra):
        d = self._head(workload, param)
        d.update(bytes=nbytes, unit="us", warmup=plan["warmup"],
                 samples=[round(s, 2) for s in samples])
        d.update(extra)
        print(json.dumps(d), flush=True)
        print("  [%s r%d] %-14s %-12s median %11.1f us  (n=%d)" % (
            self.system, self.round, workload, param + self.suffix, statistics.median(samples),
            len(samples)),
            file=sys.stderr, flush=True)

    def error(self, workload, param, what):
        d = self._head(workload, param)
        d["error"] = what
        print(json.dumps(d), flush=True)
        print("  [%s r%d] %s %s FAILED: %s" % (self.system, self.round, workload, param, what),
              file=sys.stderr, flush=True)

    def guard(self, workload, param, fn):
        if self.only and not any(workload.startswith(o) for o in self.only):
            return
        try:
            fn()
        except Exception as e:  # reported as an error line; the run goes on
            self.error(workload, param, "%s: %s" % (type(e).__name__, e))


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--plan", default=os.path.join(os.path.dirname(__file__), "plan.txt"))
    ap.add_argument("--only", default="")
    ap.add_argument("--suffix", default="")
    a = ap.parse_args()
    a.only = [o for o in a.only.split(",") if o]
    # A group ("w2") is wanted when a prefix names it or one of its members ("w2_fresh"), as in
    # harness.h's Args::Wants; Emitter.guard then runs only the members named.
    a.wants = lambda w: not a.only or any(w.startswith(o) or o.startswith(w) for o in a.only)
    return a


def wait_bounded(pid, timeout_ms):
    """Waits for a forked child at most timeout_ms (pidfd + poll); kills it on timeout.
    Returns 0 (exited 0), 1 (failed) or 2 (hung, killed)."""
    pfd = os.pidfd_open(pid)
    p = select.poll()
    p.register(pfd, select.POLLIN)
    ready = p.poll(timeout_ms)
    os.close(pfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if not ready:
        return 2
    return 0 if os.waitstatus_to_exitcode(status) == 0 else 1


def spawn2_by_hand(ctx, target, args_of):
    """Two Processes of `ctx` running target(*args_of(i)); waits on their sentinels and, on the
    first non-zero exit, terminates and joins the other and raises (what users of plain
    multiprocessing write for themselves: it has no spawn() helper)."""
    from multiprocessing.connection import wait
    procs = [ctx.Process(target=target, args=args_of(i)) for i in range(2)]
    for p in procs:
        p.start()
    pending = {p.sentinel: (i, p) for i, p in enumerate(procs)}
    while pending:
        for s in wait(list(pending)):
            i, p = pending.pop(s)
            p.join()
            if p.exitcode != 0:
                for _, q in pending.values():
                    q.terminate()
                for _, q in pending.values():
                    q.join()
                raise ChildFailed(i, p.exitcode)
    return procs


class ChildFailed(Exception):
    def __init__(self, index, exitcode):
        super().__init__("process %d exited with code %d" % (index, exitcode))
        self.index = index
        self.exitcode = exitcode


def write_now(path):
    with open(path, "w") as f:
        f.write(str(time.monotonic_ns()))


def read_ns(path):
    with open(path) as f:
        return int(f.read())
