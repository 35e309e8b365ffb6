"""bench/peers/python_breakdown.py: where a forksafe.multiprocessing Queue message's time goes,
stage by stage, across two processes (workloads 1 and 2 of peers_torch.py, taken apart).

    PYTHONPATH=<assembled package> /usr/bin/python3 bench/peers/python_breakdown.py [--n N]

The package comes from `bash tools/python_package.sh` (or bench/peers/run.sh's assembly). Each
process stamps the end of each stage with time.perf_counter_ns (CLOCK_MONOTONIC: one clock for
both processes) and the parent prints the median of each stage: the pickling (`dumps`), the C++
put, the hop (from the put's return to the other side's get's return: the getter's wake-up and
the C++ get), the rebuild (`loads`) and the benchmark's own torch work. The parent runs on CPU 0
and the child on CPU 1, as peers_torch.py pins them. Internal names are used on purpose (the
queue's C++ handle, reduction.dumps/loads): the public put and get are those stages in a row.
"""
import argparse
import os
import pickle
import statistics
import time

import torch

import forksafe.multiprocessing as mp
from forksafe.multiprocessing import queues, reduction

ns = time.perf_counter_ns


def _echo(to, frm, results, n, fresh):
    # Workload 1's child (t[1] = t[0] + 1, send it back) or workload 2's (acknowledge a sum).
    os.sched_setaffinity(0, {1})
    marks = []
    hto, hfrm = to._handle, frm._handle
    for _ in range(n):
        msg = hto.get(True, None)
        a = ns()
        t = reduction.loads(*msg)
        b = ns()
        if fresh:
            reply = float(t[0]) + float(t[-1])
        else:
            t[1] = t[0] + 1
            reply = t
        c = ns()
        out = reduction.dumps(reply)
        d = ns()
        hfrm.put(out[0], out[1], out[2], True, None)
        e = ns()
        del t, reply
        marks.append((a, b, c, d, e))
    results.put(pickle.dumps(marks))


def run(nbytes, n, fresh):
    ctx = mp.get_context("fork")
    to, frm = ctx.Queue(), ctx.Queue()
    results = queues.Queue(ring_bytes=64 << 20)
    p = ctx.Process(target=_echo, args=(to, frm, results, n, fresh))
    p.start()
    os.sched_setaffinity(0, {0})
    hto, hfrm = to._handle, frm._handle
    count = nbytes // 4
    shared = torch.zeros(count).share_memory_()
    marks = []
    for i in range(n):
        t = torch.full((count,), float(i)) if fresh else shared
        if not fresh:
            t[0] = i
        s = ns()
        if fresh:
            reduction.share_memory(t)
        a = ns()
        msg = reduction.dumps(t)
        b = ns()
        hto.put(msg[0], msg[1], msg[2], True, None)
        c = ns()
        back = hfrm.get(True, None)
        d = ns()
        r = reduction.loads(*back)
        e = ns()
        if (r != 2.0 * i) if fresh else (r[1].item() != i + 1):
            raise RuntimeError("wrong reply")
        marks.append((s, a, b, c, d, e))
    child = pickle.loads(results.get(timeout=60))
    p.join(10)
    stages = {k: [] for k in ("parent: move into shared memory", "parent: dumps", "parent: put",
                              "hop to the child", "child: loads", "child: torch work",
                              "child: dumps", "child: put", "hop to the parent",
                              "parent: loads", "total")}
    for (s, a, b, c, d, e), (ca, cb, cc, cd, ce) in list(zip(marks, child))[n // 10:]:
        for key, v in zip(stages, (a - s, b - a, c - b, ca - c, cb - ca, cc - cb, cd - cc,
                                   ce - cd, d - ce, e - d, e - s)):
            stages[key].append(v)
    name = ("fresh tensor send" if fresh else "round trip of a shared tensor")
    print(f"{name}, {nbytes // 1024} KiB, {n} messages (medians, us):")
    for key, v in stages.items():
        if fresh or key != "parent: move into shared memory":
            print(f"  {key:34s} {statistics.median(v) / 1000:8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="messages per workload")
    args = parser.parse_args()
    run(4096, args.n, fresh=False)
    run(4096, args.n // 4, fresh=True)
    run(1 << 20, args.n // 4, fresh=True)
