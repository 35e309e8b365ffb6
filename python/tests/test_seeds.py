"""The seeds' examples (../shared/seeds), each a script under seeds/ with only its import line
changed to forksafe.multiprocessing, run as a program (spawn and forkserver re-import its
__main__) with this interpreter, bounded by a timeout; each asserts its own results and ends
with "SEED OK"."""
import os
import subprocess
import sys

import pytest

import forksafe

HERE = os.path.dirname(os.path.abspath(__file__))


def run_seed(script, *args, timeout=180):
    try:
        done = subprocess.run([sys.executable, os.path.join(HERE, "seeds", script), *args],
                              capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    except subprocess.TimeoutExpired as e:  # run() killed the script by its pid
        pytest.fail(f"{script} {' '.join(args)} did not end within {timeout} s:\n"
                    f"{e.stdout}\n{e.stderr}")
    assert done.returncode == 0 and "SEED OK" in done.stdout, \
        f"{script} {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_tutorial_process_and_queue():
    out = run_seed("tutorial_queue.py")
    assert out.count("hello from process") == 10


def test_tutorial_lock():
    assert "hello from process" in run_seed("tutorial_lock.py")


def test_tutorial_value_and_array():
    out = run_seed("tutorial_value_array.py")
    assert "3.1415927" in out and "[0, -1, -2, -3, -4, -5, -6, -7, -8, -9]" in out


def test_tutorial_manager():
    out = run_seed("tutorial_manager.py")
    assert "{1: '1', '2': 2, 0.25: None}" in out and "[9, 8, 7, 6, 5, 4, 3, 2, 1, 0]" in out


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_hogwild(method):
    pytest.importorskip("torch", reason="python3-torch is not installed")
    assert "weight error" in run_seed("torch_hogwild.py", method)


def test_accelerator_sharing_with_an_exited_producer_on_sim():
    assert "sim:0 2560.0" in run_seed("cuda_sharing_sim.py", "sim:0")


def test_accelerator_sharing_with_an_exited_producer_on_cuda():
    if not any(d.startswith("cuda") for d in forksafe.available_devices()):
        pytest.skip("no CUDA device on this machine (forksafe.available_devices() has none)")
    assert "cuda:0 2560.0" in run_seed("cuda_sharing_sim.py", "cuda:0")


def test_mindspore_fork_after_accelerator_use():
    out = run_seed("mindspore_fork.py")
    assert "on cpu" in out
