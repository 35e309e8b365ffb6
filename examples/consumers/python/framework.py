#!/usr/bin/python3
"""A Python program that uses an installed forksafe (tools/consumers.sh, "python"): imports the
package from the install given in argv[1] (its lib/python3.11/dist-packages), runs a task on a
forksafe pool, forks while the pool is busy and checks the child, and checks that the
file_system strategy's manager is the installed program. Exits non-zero on a mismatch."""
import os
import sys
import time

prefix = sys.argv[1]
sys.path.insert(0, os.path.join(prefix, "lib", "python3.11", "dist-packages"))
import forksafe  # noqa: E402

where = os.path.realpath(forksafe.__file__)
if not where.startswith(os.path.realpath(prefix) + os.sep):
    sys.exit(f"forksafe was imported from {where}, not from the install in {prefix}")
if forksafe.framework_lock() != "gil":
    sys.exit(f"framework lock is {forksafe.framework_lock()!r}, want 'gil'")

with forksafe.ThreadPool(2, name="consumer") as pool:
    futures = [pool.submit(sum, range(n)) for n in range(100)]
    pid = os.fork()
    if pid == 0:
        ok = pool.submit(pow, 2, 8).result(10) == 256 and forksafe.default_device() == "cpu"
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            sys.exit("the forked child did not end within 30 s")
        time.sleep(0.01)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the child failed: status {status}")
    if [f.result(10) for f in futures] != [sum(range(n)) for n in range(100)]:
        sys.exit("wrong results")

# The file_system strategy's manager is the program installed in <prefix>/lib/forksafe/ (the
# interpreter cannot serve as one): a child of this process once a named segment exists.
import forksafe.multiprocessing as mp  # noqa: E402

mp.set_sharing_strategy("file_system")
shared = mp.shared_ndarray(1024, "float32")
want = os.path.realpath(os.path.join(prefix, "lib", "forksafe", "forksafe-shm-manager"))
managers = []
for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid():
            managers.append(os.path.realpath(f"/proc/{entry}/exe"))
    except (OSError, ValueError, IndexError):
        pass
if want not in managers:
    sys.exit(f"no shm manager {want} among this process's children: {managers}")
print(f"python consumer: forksafe {forksafe.__version__} from {os.path.dirname(where)}; ok")
