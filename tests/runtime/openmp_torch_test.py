#!/usr/bin/python3
# tests/runtime/openmp_torch_test.py: Debian's python3-torch (GNU libgomp) across os.fork(), in
# a fresh interpreter each time: without forksafe, children of a parent that ran an intra-op
# parallel region hang in their first one (the defect); with forksafe's runtime loaded
# (ctypes.CDLL of a shared object built from //runtime, after torch: its OpenMP runtime came
# first, with RTLD_LOCAL), every child runs it. Each run forks 10 children at once and gives them
# 5 s together; a child still running then is killed by its pid. Skips (exit 0, with the reason)
# when torch cannot be imported.
# Every process it starts ends: each interpreter runs in a process group of its own, and one that
# outlives its time limit is killed with its whole group (its forked children included), then
# waited for; this script is a child subreaper, so those children, orphaned, come back to it and
# are waited for too (no zombie, no process left). It checks that first, without torch.
import ctypes
import os
import signal
import subprocess
import sys
import time

CHILDREN = 10
DEADLINE_S = 5.0

WORKER = r"""
import ctypes, os, signal, sys, time
import torch
if sys.argv[1] == "with":
    ctypes.CDLL(sys.argv[2])  # forksafe arrives after torch and its libgomp
torch.set_num_threads(2)
big = torch.ones(1 << 21)
assert float(big.exp().sum()) > 0  # an intra-op parallel region (at::parallel_for, OpenMP)
pids = []
for _ in range(%(children)d):
    pid = os.fork()
    if pid == 0:
        try:
            ok = float(torch.ones(1 << 21).mul(2).sum()) == 2.0 * (1 << 21)
            os._exit(0 if ok else 3)
        except BaseException:
            os._exit(4)
    pids.append(pid)
deadline = time.monotonic() + %(deadline)f
ran = hung = failed = 0
for pid in pids:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                ran += 1
            else:
                failed += 1
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            hung += 1
            break
        time.sleep(0.01)
assert float(big.exp().sum()) > 0  # the parent still runs regions
print(ran, hung, failed)
""" % {"children": CHILDREN, "deadline": DEADLINE_S}


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("FAIL: prctl(PR_SET_CHILD_SUBREAPER): %s" % os.strerror(ctypes.get_errno()))


def reap_orphans(limit_s=10.0):
    """Waits for every child of this process that is left (orphans reparented to it)."""
    end = time.monotonic() + limit_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True  # none left
        if pid == 0:
            if time.monotonic() > end:
                return False
            time.sleep(0.01)


def run_bounded(args, timeout_s):
    """Runs args in a process group of its own; returns (returncode, stdout, stderr), with
    returncode None when it ran past timeout_s: then the whole group was killed, and every
    process of it waited for."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the interpreter and the children it forked
        except ProcessLookupError:
            pass
        out, err = proc.communicate()  # waits for it (and returns what it printed)
        if not reap_orphans():
            sys.exit("FAIL: processes of a timed-out run were still running 10 s after SIGKILL")
        return None, out, err


def check_reaping():
    """A run that hangs, with a forked child that hangs too: both end, and none is left."""
    script = ("import os, time\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    time.sleep(600)\n"
              "    os._exit(0)\n"
              "print(pid, flush=True)\n"
              "time.sleep(600)\n")
    returncode, out, _ = run_bounded([sys.executable, "-c", script], 2.0)
    if returncode is not None:
        sys.exit("FAIL: the hanging run was not reported as timed out")
    child = int(out.split()[0])
    try:
        os.kill(child, 0)
        sys.exit("FAIL: process %d, forked by the timed-out run, is still there" % child)
    except ProcessLookupError:
        pass
    try:
        sys.exit("FAIL: a child was left: %s" % (os.waitpid(-1, os.WNOHANG),))
    except ChildProcessError:
        pass
    print("reaping: a timed-out run and the child it forked were killed and waited for")


def run(mode, so):
    returncode, stdout, stderr = run_bounded([sys.executable, "-c", WORKER, mode, so], 120)
    if returncode is None:
        sys.exit("FAIL: the %s run did not end within 120 s (killed with its children)" % mode)
    if returncode != 0:
        sys.exit("FAIL: the %s run exited with %d: %s" % (mode, returncode, stderr[-2000:]))
    ran, hung, failed = (int(x) for x in stdout.split()[-3:])
    print("torch children %s forksafe: %d ran their region, %d hung (killed after %.0f s), "
          "%d failed" % (mode, ran, hung, DEADLINE_S, failed))
    return ran, hung, failed


def main():
    so = os.path.abspath(sys.argv[1])
    become_subreaper()
    check_reaping()
    probe = run_bounded([sys.executable, "-c", "import torch"], 120)
    if probe[0] is None:
        sys.exit("FAIL: `import torch` did not end within 120 s")
    if probe[0] != 0:
        print("SKIPPED: torch cannot be imported by %s (install Debian's python3-torch): %s"
              % (sys.executable, probe[2].strip().splitlines()[-1:]))
        return
    _, hung_without, _ = run("without", so)
    ran_with, hung_with, failed_with = run("with", so)
    if hung_without == 0:
        sys.exit("FAIL: without forksafe no torch child hung: this test no longer shows the "
                 "defect (did torch stop using GNU libgomp?)")
    if hung_with != 0 or failed_with != 0 or ran_with != CHILDREN:
        sys.exit("FAIL: with forksafe loaded, %d of %d torch children hung and %d failed"
                 % (hung_with, CHILDREN, failed_with))
    print("PASS")


if __name__ == "__main__":
    main()
