#!/usr/bin/python3
# tests/runtime/openmp_torch_test.py: Debian's python3-torch (GNU libgomp) across os.fork(), in
# a fresh interpreter each time: without forksafe, children of a parent that ran an intra-op
# parallel region hang in their first one (the defect); with forksafe's runtime loaded
# (ctypes.CDLL of a shared object built from //runtime, after torch: its OpenMP runtime came
# first, with RTLD_LOCAL), every child runs it. Each run forks 10 children at once and gives them
# 5 s together; a child still running then is killed by its pid. Skips (exit 0, with the reason)
# when torch cannot be imported.
import os
import subprocess
import sys

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


def run(mode, so):
    out = subprocess.run([sys.executable, "-c", WORKER, mode, so], capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        sys.exit("FAIL: the %s run exited with %d: %s" % (mode, out.returncode, out.stderr[-2000:]))
    ran, hung, failed = (int(x) for x in out.stdout.split()[-3:])
    print("torch children %s forksafe: %d ran their region, %d hung (killed after %.0f s), "
          "%d failed" % (mode, ran, hung, DEADLINE_S, failed))
    return ran, hung, failed


def main():
    so = os.path.abspath(sys.argv[1])
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True)
    if probe.returncode != 0:
        print("SKIPPED: torch cannot be imported by %s (install Debian's python3-torch): %s"
              % (sys.executable, probe.stderr.strip().splitlines()[-1:]))
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
