"""forksafe.multiprocessing under launchers: launch_info() reads torchrun's, Open MPI's, MPICH's
and Slurm's variables (the rules are C++'s: forksafe/runtime/launch_info.h); spawn() gives its
children nested torchrun variables under every start method; a failed spawn() is written to
TORCHELASTIC_ERROR_FILE; and a forksafe Python program runs under the real torchrun (two ranks,
each with a Pool and a nested spawn()).

Interpreter: /usr/bin/python3 (run by python/run_pytest.sh); torchrun is
`/usr/bin/python3 -m torch.distributed.run`, bounded by a timeout and killed with its session.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

import forksafe
import forksafe.multiprocessing as mp

LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
               "FORKSAFE_LAUNCHER", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
               "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "SLURM_PROCID", "SLURM_STEP_ID",
               "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASKS_PER_NODE"]


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_alone_is_rank_zero_of_one(clean_env):
    info = mp.launch_info()
    assert info == mp.LaunchInfo("none", 0, 0, 1, 1, 0, "", 0)


def test_each_launchers_variables(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "5")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "8")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    info = mp.launch_info()
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.node_rank) == \
        ("openmpi", 5, 8, 1, 1)
    # torchrun's variables win: they are what a spawn() child inside an MPI rank sees.
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    clean_env.setenv("MASTER_ADDR", "10.1.2.3")
    clean_env.setenv("MASTER_PORT", "29500")
    info = mp.launch_info()
    assert info.launcher == "torchrun" and info.rank == 3 and info.world_size == 4
    assert (info.master_addr, info.master_port) == ("10.1.2.3", 29500)


def test_rank_device(clean_env):
    n = sum(1 for d in forksafe.available_devices() if d.startswith("sim"))
    assert forksafe.rank_device("sim") == "sim:0"
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "3")
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    assert forksafe.rank_device("sim") == f"sim:{3 % n}"
    assert forksafe.rank_device("cpu") == "cpu"
    assert forksafe.default_device() == "cpu"


def test_malformed_variables_are_a_clear_error(clean_env):
    clean_env.setenv("RANK", "4")
    clean_env.setenv("WORLD_SIZE", "4")
    with pytest.raises(forksafe.InvalidArgumentError, match="RANK=4 is not below WORLD_SIZE=4"):
        mp.launch_info()
    clean_env.setenv("RANK", "two")
    with pytest.raises(forksafe.InvalidArgumentError, match='RANK="two" is not a whole number'):
        mp.launch_info()
    clean_env.delenv("RANK")
    with pytest.raises(forksafe.InvalidArgumentError, match="WORLD_SIZE is set but RANK is not"):
        mp.launch_info()
    # spawn() does not refuse: it starts the children with the environment unchanged, as torch
    # does (test_spawn_with_a_stray_world_size_starts_with_the_environment_unchanged).


def _check_place(i, parent_rank, parent_world, nprocs, probe):
    info = mp.launch_info()
    assert info.launcher == "spawn", info
    assert info.rank == parent_rank * nprocs + i, info
    assert info.world_size == parent_world * nprocs, info
    # A rendezvous is invented only for the children of a parent that is alone.
    assert bool(info.master_addr and info.master_port) == (parent_world == 1), info
    if probe:
        assert os.environ.get("LAUNCH_TEST_PROBE") == probe


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_spawn_children_get_nested_ranks(clean_env, method):
    # This process plays Open MPI's rank 1 of 2: its 2 children are ranks 2 and 3 of 4.
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    mp.spawn(_check_place, args=(1, 2, 2, ""), nprocs=2, start_method=method)
    assert "RANK" not in os.environ  # the parent's environment is untouched
    clean_env.delenv("OMPI_COMM_WORLD_RANK")
    clean_env.delenv("OMPI_COMM_WORLD_SIZE")
    mp.spawn(_check_place, args=(0, 1, 3, ""), nprocs=3, start_method=method)
    # launch_env=False: the children are left alone (and so see no launcher).
    with pytest.raises(mp.ProcessRaisedException, match="launcher"):
        mp.spawn(_check_place, args=(0, 1, 1, ""), nprocs=1, start_method=method,
                 launch_env=False)


def _fail_second(i):
    if i == 1:
        raise ValueError("rank one gave up")


def test_a_failed_spawn_is_written_for_torchelastic(clean_env, tmp_path):
    path = tmp_path / "error.json"
    clean_env.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(mp.ProcessRaisedException):
        mp.spawn(_fail_second, nprocs=2, start_method="fork")
    data = json.loads(path.read_text())
    assert data["message"]["message"].startswith("ProcessRaisedException:")
    assert "ValueError: rank one gave up" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0


TORCHRUN_PROGRAM = textwrap.dedent("""
    import forksafe.multiprocessing as mp

    def square(x):
        return x * x

    def child(i):
        info = mp.launch_info()
        print(f"CHILD rank={info.rank} world={info.world_size} launcher={info.launcher}",
              flush=True)

    if __name__ == "__main__":
        info = mp.launch_info()
        with mp.Pool(2) as pool:
            total = sum(pool.map(square, range(1, 11)))
        print(f"RANK rank={info.rank} world={info.world_size} local={info.local_rank} "
              f"launcher={info.launcher} pool={total}", flush=True)
        mp.spawn(child, nprocs=2, start_method="fork")
""")


def test_a_forksafe_program_under_torchrun(clean_env, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(TORCHRUN_PROGRAM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # --redirects/--tee 1: Debian's torch 1.13 on Python 3.11 cannot parse their default "0".
    cmd = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={port}", "--redirects", "2", "--tee", "1",
           str(script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun still ran after 90 s:\n{out}")
    assert proc.returncode == 0, out
    ranks = sorted(line.split("RANK ", 1)[1] for line in out.splitlines() if "RANK rank=" in line)
    assert ranks == ["rank=0 world=2 local=0 launcher=torchrun pool=385",
                     "rank=1 world=2 local=1 launcher=torchrun pool=385"], out
    children = sorted(line.split("CHILD ", 1)[1] for line in out.splitlines() if "CHILD " in line)
    assert children == [f"rank={r} world=4 launcher=spawn" for r in range(4)], out


def _report_env(i, q):
    q.put((os.environ.get("WORLD_SIZE"), os.environ.get("RANK")))


def test_spawn_with_a_stray_world_size_starts_with_the_environment_unchanged(clean_env):
    """WORLD_SIZE set alone (no launcher sets only that) made spawn() refuse to start with
    InvalidArgumentError; torch's spawn starts the children with the environment as it is."""
    clean_env.setenv("WORLD_SIZE", "2")
    q = mp.SimpleQueue()
    with pytest.warns(RuntimeWarning, match="WORLD_SIZE"):
        mp.spawn(_report_env, args=(q,), nprocs=1, start_method="fork")
    assert q.get() == ("2", None)
