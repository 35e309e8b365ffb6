#!/usr/bin/python3
# tests/mp/launchers_test.py: forksafe under the launchers users already have, for real, on this
# machine and over loopback only: Open MPI's mpirun, MPICH's mpiexec (Hydra) and torchrun
# (python3 -m torch.distributed.run, Debian's python3-torch) start tests/mp/launch_probe.cc.
#   - every rank sees its own rank and the world size, runs a Pool.map and exits 0; its default
#     pool size is its share of the CPUs;
#   - torchrun with two "nodes" on this machine, 2 processes each: ranks 0-3 each seen once;
#   - spawn() inside an mpirun rank nests: the children are ranks 0..3 of 4, each once;
#   - a rank whose spawn() fails: torchrun reports it with the child's exception, read from the
#     TORCHELASTIC_ERROR_FILE the rank wrote;
#   - the launcher ends a job mid-run (SIGTERM): no process of the job (ranks, their children,
#     their shm managers) and no /dev/shm segment of it survives.
# Interpreter: Debian's /usr/bin/python3 (the shebang), which has torch. Every launcher runs in a
# session of its own with a time limit; one that outlives it is killed with its whole group and
# the case fails. Writes JUnit XML to $XML_OUTPUT_FILE (one case per check) when Bazel sets it.
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from xml.sax.saxutils import quoteattr

PROBE = os.path.abspath(sys.argv[1])
LIMIT_S = 90
PYTHON = "/usr/bin/python3"


def base_env():
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "FORKSAFE_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"):
        env.pop(var, None)
    tmp = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
    env.setdefault("HOME", tmp)
    env["TMPDIR"] = tmp
    # Open MPI refuses root unless told (CI runs as root).
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env["OMPI_MCA_plm_rsh_agent"] = ""  # one node: never look for ssh
    return env


def start(cmd, env=None):
    return subprocess.Popen(cmd, env=env or base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc, limit=LIMIT_S):
    """The process's (returncode, output); kills its session and fails when it outlives `limit`."""
    try:
        out, _ = proc.communicate(timeout=limit)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{proc.args} still ran after {limit} s; killed. Output:\n{out}")


def run(cmd, env=None, limit=LIMIT_S):
    return finish(start(cmd, env), limit)


def lines(out, tag):
    """The key=value fields of every line starting with `tag`."""
    rows = []
    for line in out.splitlines():
        line = re.sub(r"^\[[a-z]+\d+\]:", "", line)  # torchrun's --tee prefix, "[default0]:"
        if line.startswith(tag + " "):
            rows.append(dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv))
    return rows


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nnodes, node_rank, nproc, port, *probe_args):
    # --redirects/--tee other than 0: Debian's torch 1.13 under Python 3.11 cannot parse their
    # default "0" (Std.from_str finds no flag for 0 there, since 3.11's Flag iteration skips it) and
    # fails before starting any worker; "--tee 1" also shows the ranks' stdout, prefixed.
    return [PYTHON, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--node_rank={node_rank}", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={port}", "--redirects", "2", "--tee", "1", "--no_python", PROBE,
            *probe_args]


MPIRUN = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none"]
MPIEXEC = ["mpiexec.mpich"]


def solo_default_threads():
    code, out = run([PROBE, "info"])
    assert code == 0, out
    return int(lines(out, "POOL")[0]["default_threads"])


def expected_share(solo, ranks):
    mask = len(os.sched_getaffinity(0))
    return max(1, solo // ranks) if mask >= (os.cpu_count() or 0) else solo


def check_ranks(rows, world, launcher, out):
    assert sorted(int(r["rank"]) for r in rows) == list(range(world)), out
    for r in rows:
        assert int(r["world"]) == world, out
        assert r["launcher"] == launcher, out


def test_openmpi_every_rank_knows_itself_and_runs_a_pool():
    solo = solo_default_threads()
    code, out = run(MPIRUN + ["-np", "4", PROBE, "info"])
    assert code == 0, out
    rows = lines(out, "LAUNCH")
    check_ranks(rows, 4, "openmpi", out)
    assert sorted(int(r["local_rank"]) for r in rows) == [0, 1, 2, 3], out
    pools = lines(out, "POOL")
    assert len(pools) == 4 and all(p["sum"] == "385" for p in pools), out
    share = expected_share(solo, 4)
    assert all(int(p["default_threads"]) == share for p in pools), (share, out)


def test_mpich_every_rank_knows_itself_and_runs_a_pool():
    code, out = run(MPIEXEC + ["-n", "4", PROBE, "info"])
    assert code == 0, out
    rows = lines(out, "LAUNCH")
    check_ranks(rows, 4, "mpich", out)
    assert sorted(int(r["local_rank"]) for r in rows) == [0, 1, 2, 3], out
    assert [p["sum"] for p in lines(out, "POOL")] == ["385"] * 4, out


def test_torchrun_two_nodes_on_one_machine():
    port = free_port()
    nodes = [start(torchrun(2, k, 2, port, "info")) for k in (0, 1)]
    results = [finish(p) for p in nodes]
    out = "\n".join(o for _, o in results)
    assert all(code == 0 for code, _ in results), out
    rows = lines(out, "LAUNCH")
    check_ranks(rows, 4, "torchrun", out)
    for r in rows:
        assert int(r["local_world"]) == 2 and int(r["node"]) == int(r["rank"]) // 2, out
        assert r["master"].startswith("127.0.0.1:"), out
    assert [p["sum"] for p in lines(out, "POOL")] == ["385"] * 4, out


def test_spawn_nests_inside_an_mpirun_rank():
    for method in ("spawn", "fork"):
        code, out = run(MPIRUN + ["-np", "2", PROBE, "spawn", "2", method])
        assert code == 0, out
        children = lines(out, "CHILD")
        check_ranks(children, 4, "spawn", out)
        parents = {r["pid"]: int(r["rank"]) for r in lines(out, "LAUNCH")
                   if r["launcher"] == "openmpi"}
        for c in children:
            # Child i of rank r is rank 2r + i.
            assert int(c["rank"]) // 2 == parents[c["ppid"]], out
            assert int(c["local_world"]) == 4, out


def test_torchrun_reports_a_failed_spawn_with_the_childs_error():
    code, out = run(torchrun(1, 0, 2, free_port(), "fail"))
    assert code != 0, out
    # Nothing of the job is left: the ranks and their children have all ended. Both ranks and
    # both failing children (child 1 of rank r is rank 2r + 1, and prints before it throws)
    # reported; a child 0 may be terminated by its rank's spawn() before it prints anything.
    launched, children = lines(out, "LAUNCH"), lines(out, "CHILD")
    assert len(launched) == 2, out
    assert {int(c["rank"]) for c in children} >= {1, 3}, out
    pids = [int(r["pid"]) for r in launched + children]
    assert not [p for p in pids if alive(p)], out
    # torchrun's summary carries the message that the rank wrote to its error file.
    assert "probe failure in rank" in out, out
    assert re.search(r"error_file:\s*/", out), out
    assert re.search(r"traceback :\s*ProcessRaisedException: process 1 .*terminated", out), out


def read_rank_files(folder, n, proc):
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        names = [os.path.join(folder, f"rank{r}") for r in range(n)]
        if all(os.path.exists(p) for p in names):
            pids, segments = [], []
            for p in names:
                with open(p) as f:
                    first, second = (f.read().split("\n") + [""])[:2]
                pids += [int(x) for x in first.split()]
                segments += second.split()
            return pids, segments
        if proc.poll() is not None:
            raise AssertionError("the job ended before every rank was ready:\n" + proc.stdout.read())
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    raise AssertionError("the ranks did not get ready in time")


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def sigterm_leaves_nothing(cmd, n):
    with tempfile.TemporaryDirectory() as folder:
        proc = start(cmd + ["hold", folder])
        pids, segments = read_rank_files(folder, n, proc)
        # Each rank: itself, its two children, its shm manager (which must end too).
        assert len(pids) == 4 * n and len(segments) >= n, (pids, segments)
        assert all(p > 0 for p in pids), pids
        assert all(os.path.exists("/dev/shm/" + s) for s in segments), segments
        proc.send_signal(signal.SIGTERM)  # the launcher, as a scheduler or a user ends a job
        code, out = finish(proc, 60)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = [p for p in pids if alive(p)]
            shm = [s for s in segments if os.path.exists("/dev/shm/" + s)]
            if not left and not shm:
                return
            time.sleep(0.1)
        for p in left:
            os.kill(p, signal.SIGKILL)
        raise AssertionError(f"after SIGTERM to the launcher (exit {code}): processes {left} and "
                             f"/dev/shm entries {shm} survived. Output:\n{out}")


def test_sigterm_to_mpirun_leaves_no_process_and_no_segment():
    sigterm_leaves_nothing(MPIRUN + ["-np", "2", PROBE], 2)


def test_sigterm_to_torchrun_leaves_no_process_and_no_segment():
    sigterm_leaves_nothing(torchrun(1, 0, 2, free_port())[:-1] + [PROBE], 2)


def main():
    tests = [(name, fn) for name, fn in globals().items() if name.startswith("test_")]
    only = sys.argv[2:]
    results = []
    for name, fn in tests:
        if only and name not in only:
            continue
        began = time.monotonic()
        try:
            fn()
            results.append((name, None, time.monotonic() - began))
            print(f"PASS {name} ({time.monotonic() - began:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001 - every failure is reported as the case's
            results.append((name, traceback.format_exc(), time.monotonic() - began))
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    failed = sum(1 for _, e, _ in results if e)
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        with open(xml, "w") as f:
            f.write(f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuites tests="{len(results)}" '
                    f'failures="{failed}" errors="0" skipped="0">\n'
                    f'<testsuite name="launchers_test" tests="{len(results)}" '
                    f'failures="{failed}" errors="0" skipped="0">\n')
            for name, err, secs in results:
                f.write(f'<testcase name="{name}" time="{secs:.2f}">')
                if err:
                    f.write(f"<failure message={quoteattr(err.splitlines()[-1])}>"
                            f"{quoteattr(err)[1:-1]}</failure>")
                f.write("</testcase>\n")
            f.write("</testsuite>\n</testsuites>\n")
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
