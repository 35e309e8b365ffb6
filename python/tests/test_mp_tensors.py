"""numpy arrays and torch tensors across processes through forksafe's shared memory.

A receiver's writes are seen by the sender (no pickled copies); descriptors and /dev/shm entries
do not leak; bad input is a clear error. Processes end within bounded waits.
"""
import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import forksafe
import forksafe.multiprocessing as mp
from forksafe.multiprocessing import reduction

torch = pytest.importorskip("torch", reason="python3-torch is not installed")


def finish(procs, timeout=60):
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            pytest.fail(f"process {p.pid} did not end within {timeout} s")
    return [p.exitcode for p in procs]


def add_one_and_report(q, out):
    x = q.get(timeout=30)
    x += 1
    out.put(("done", type(x).__name__, tuple(x.shape)))


def add_one_to_arg(x, out):
    x += 1
    out.put("done")


def pipe_add_one(conn):
    t = conn.recv()
    t.add_(1) if hasattr(t, "add_") else np.add(t, 1, out=t)
    conn.send("done")


def pool_sum(x):
    return float(x.sum())


def pool_make(n):
    return np.full(n, 7.0)


def count_fds():
    return len(os.listdir("/proc/self/fd"))


def shm_entries():
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_receivers_writes_are_seen_by_the_sender_through_a_queue(method, kind):
    ctx = mp.get_context(method)
    x = mp.shared_ndarray((3, 4), "float32") if kind == "numpy" else torch.zeros(3, 4)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=add_one_and_report, args=(q, out))
    p.start()
    q.put(x)
    assert out.get(timeout=60) == ("done", type(x).__name__, (3, 4))
    assert finish([p]) == [0]
    assert float(x.sum()) == 12.0
    assert mp.is_shared(x)


def keep_and_add_on_signal(q, go, out):
    t = q.get(timeout=60)
    out.put("have it")
    go.wait(60)
    t.add_(1)
    out.put("added")


def test_torchs_own_is_shared_and_share_memory_know_forksafes_memory():
    # torch.Tensor.is_shared() says True once forksafe moved the tensor (as after a torch.mp
    # send), and share_memory_() then keeps it where the receiver has it: torch's own would have
    # copied it into torch's shared memory, and the receiver's later writes were lost.
    t = torch.zeros(4)
    assert not t.is_shared()
    q, out, go = mp.Queue(), mp.Queue(), mp.Event()
    p = mp.Process(target=keep_and_add_on_signal, args=(q, go, out))
    p.start()
    q.put(t)
    assert out.get(timeout=60) == "have it"
    assert t.is_shared() and mp.is_shared(t)
    assert t.share_memory_() is t
    go.set()
    assert out.get(timeout=60) == "added"
    assert finish([p]) == [0]
    assert t.tolist() == [1.0] * 4
    # Tensors forksafe never moved keep torch's own behaviour.
    u = torch.ones(3)
    assert not u.is_shared() and u.share_memory_().is_shared()


def fill_first_item(q, out):
    x = q.get(timeout=60)
    (x[0] if isinstance(x, tuple) else x).fill_(4)
    out.put("done")


def send_weight_then_train(model, q, go):
    q.put(model.weight)
    go.wait(60)
    with torch.no_grad():
        model.weight.fill_(9)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_share_memory_first_keeps_views_and_the_parent_aliased(method):
    # torch's share_memory_() (and model.share_memory()) puts the tensor in forksafe's shared
    # memory: a view sent later is over that same memory, so the receiver's writes reach the
    # sender's tensor. (Into torch's own shared memory, the first send copied it out again: the
    # sender's tensor stayed [0, 0, 0, 0].)
    ctx = mp.get_context(method)
    t = torch.zeros(4).share_memory_()
    assert t.is_shared() and mp.is_shared(t)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=fill_first_item, args=(q, out))
    p.start()
    q.put((t[2:], t))
    assert out.get(timeout=60) == "done"
    assert finish([p]) == [0]
    assert t.tolist() == [0.0, 0.0, 4.0, 4.0]


def test_a_hogwild_worker_that_sends_a_parameter_keeps_training_the_shared_model():
    # model.share_memory(), then a forked worker sends its parameter and trains on: the parent's
    # model must see the training (the send used to move the worker's parameter off the shared
    # memory, detaching it from the parent and the other workers).
    model = torch.nn.Linear(2, 1, bias=False)
    model.share_memory()
    q, go = mp.Queue(), mp.Event()
    p = mp.Process(target=send_weight_then_train, args=(model, q, go))
    p.start()
    sent = q.get(timeout=60)
    go.set()
    assert finish([p]) == [0]
    assert model.weight.tolist() == [[9.0, 9.0]] and sent.tolist() == [[9.0, 9.0]]


def test_sending_a_tensor_keeps_its_autograd_state_and_inference_tensors_cross():
    # The move into shared memory must not count as an in-place change: a tensor saved for
    # backward stayed at version 0 in torch, and set_ made backward() fail ("modified by an
    # inplace operation"). An inference tensor has no version counter; it crosses too.
    w = torch.ones(3, requires_grad=True)
    x = torch.arange(3.0)
    y = (x * w).sum()
    q = mp.Queue()
    q.put(x)
    assert x._version == 0 and x.is_shared()
    y.backward()
    assert w.grad.tolist() == [0.0, 1.0, 2.0]
    assert q.get(timeout=10).tolist() == [0.0, 1.0, 2.0]
    with torch.inference_mode():
        frozen = torch.ones(3)
    q.put(frozen)
    assert q.get(timeout=10).tolist() == [1.0] * 3 and frozen.is_shared()


def test_a_message_of_many_fresh_tensors_moves_each_once_without_rescanning_the_records(
        monkeypatch):
    # A prune (a scan of every record) per move made a message of n fresh tensors cost n^2
    # (8000 tensors: 14.8 s). Prunes now come as the records double.
    prunes = []
    real = reduction._prune_torch_records
    monkeypatch.setattr(reduction, "_prune_torch_records", lambda: (prunes.append(1), real()))
    tensors = [torch.zeros(2) for _ in range(4000)]
    data, shared, fds = reduction.dumps(tensors)
    assert len(shared) == 4000 and not fds
    assert len(prunes) <= 12, f"{len(prunes)} prunes for 4000 moves"
    del data, shared
    assert all(t.is_shared() for t in tensors)


def test_two_threads_sending_the_same_fresh_tensors_move_each_once():
    # The record's check and the move were not atomic: two threads could each move the same
    # fresh tensor, and the receiver's writes through one of the two copies were lost.
    tensors = [torch.zeros(2) for _ in range(300)]
    seen = [[None] * len(tensors) for _ in range(2)]
    start = threading.Barrier(2)

    def send_all(k):
        start.wait(10)
        for i, t in enumerate(tensors):
            _, shared, _ = reduction.dumps((i, t))
            seen[k][i] = shared[0].data_ptr()

    threads = [threading.Thread(target=send_all, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert seen[0] == seen[1]
    assert all(t.data_ptr() == p for t, p in zip(tensors, seen[0]))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_process_arguments_share_memory(method):
    ctx = mp.get_context(method)
    # torch.share_memory_() first, as torch needs for fork (spawn would move it anyway).
    arr, ten, out = mp.shared_ndarray(5), torch.zeros(5).share_memory_(), ctx.Queue()
    procs = [ctx.Process(target=add_one_to_arg, args=(arr, out)),
             ctx.Process(target=add_one_to_arg, args=(ten, out))]
    for p in procs:
        p.start()
    assert [out.get(timeout=60) for _ in procs] == ["done", "done"]
    assert finish(procs) == [0, 0]
    assert arr.tolist() == [1.0] * 5 and ten.tolist() == [1.0] * 5


def test_views_dtypes_and_layouts_cross_intact():
    q = mp.Queue()
    base = mp.shared_ndarray((4, 6), "int16")
    base[...] = np.arange(24).reshape(4, 6)
    view = base[1:, ::2].T  # offset, strides, transposed
    q.put(view)
    got = q.get(timeout=5)
    assert got.dtype == np.int16 and got.shape == view.shape and (got == view).all()
    got[0, 0] = -1
    assert base[1, 0] == -1  # same memory
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4)[:, 1:3]
    q.put(t)
    back = q.get(timeout=5)
    assert back.dtype == torch.float64 and back.tolist() == t.tolist()
    assert back.stride() == t.stride() and back.storage_offset() == t.storage_offset()
    p = torch.nn.Parameter(torch.ones(2))
    q.put(p)
    got_p = q.get(timeout=5)
    assert isinstance(got_p, torch.nn.Parameter) and got_p.requires_grad


def test_a_private_numpy_array_is_copied_once_into_shared_memory():
    private = np.arange(6.0)
    assert not mp.is_shared(private)
    q = mp.Queue()
    q.put(private)
    got = q.get(timeout=5)
    # The receiver's own copy, as pickling's would be (in shared memory, but not shared).
    assert got.tolist() == private.tolist() and not mp.is_shared(got)
    shared = mp.share_memory(private)
    assert mp.is_shared(shared) and mp.share_memory(shared) is shared


def fill_and_snapshot(conn):
    buf = conn.recv()
    for i in range(3):
        buf[:] = i
        conn.send(buf)
    conn.close()


def normalize_in_place(a):
    a /= a.max()
    return float(a.sum())


def forward(conn_in, conn_out):
    conn_out.send(conn_in.recv())


def test_received_numpy_copies_are_the_receivers_own_and_shared_arrays_stay_shared():
    """A received array (a copy of a private one) was sent on by reference: a worker that sent
    a buffer three times after changing it delivered three times its last state, and a second
    Pool.map over the first's results normalised the parent's own results in place
    (multiprocessing and torch.multiprocessing copy). An array shared on purpose
    (shared_ndarray, share_memory) stays shared through every hop."""
    a, b = mp.Pipe()
    p = mp.Process(target=fill_and_snapshot, args=(b,))
    p.start()
    a.send(np.full(4, -1.0))
    assert [a.recv().tolist() for _ in range(3)] == [[0.0] * 4, [1.0] * 4, [2.0] * 4]
    p.join(60)
    with mp.Pool(2) as pool:
        res = pool.map(np.ones, [3, 3])
        res = [r * (i + 1) for i, r in enumerate(res)]
        pool.map(normalize_in_place, [r for r in pool.map(np.asarray, res)])
        assert [r.tolist() for r in res] == [[1.0] * 3, [2.0] * 3]
        got = pool.map(np.asarray, res)
        assert pool.map(normalize_in_place, got) == [3.0, 3.0]
        assert [g.tolist() for g in got] == [[1.0] * 3, [2.0] * 3]  # each hop a copy
    shared = mp.shared_ndarray(4)
    a1, b1 = mp.Pipe()
    a2, b2 = mp.Pipe()
    p = mp.Process(target=forward, args=(b1, a2))
    p.start()
    a1.send(shared)
    far = b2.recv()  # the parent's array, forwarded by the child
    far[:] = 5
    assert shared.tolist() == [5.0] * 4 and mp.is_shared(far)
    p.join(60)


def test_pipes_and_pools_carry_tensors():
    a, b = mp.Pipe()
    p = mp.Process(target=pipe_add_one, args=(b,))
    p.start()
    t = torch.zeros(4)
    a.send(t)
    assert a.recv() == "done"
    assert finish([p]) == [0]
    assert t.tolist() == [1.0] * 4
    with mp.Pool(2) as pool:
        assert pool.map(pool_sum, [np.ones(100) * i for i in range(6)]) == \
            [100.0 * i for i in range(6)]
        made = pool.map(pool_make, [3, 4])
    assert [m.tolist() for m in made] == [[7.0] * 3, [7.0] * 4]


def test_forksafe_tensors_cross_and_can_be_shared():
    private = forksafe.Tensor.zeros([1 << 20])
    view = np.asarray(private)  # a view of the private memory: sending must not free it
    q = mp.Queue()
    q.put(private)
    np.asarray(q.get(timeout=5))[:] = 5  # a shared copy crossed
    big = [np.ones(1 << 20, np.float32) for _ in range(4)]  # reuse any memory freed meanwhile
    assert not private.is_shared() and view.sum() == 0 and np.asarray(private).sum() == 0
    del big
    t = mp.share_memory(forksafe.Tensor.zeros([4]))
    assert t.is_shared() and mp.is_shared(t) and mp.share_memory(t) is t
    q = mp.Queue()
    q.put(t)
    got = q.get(timeout=5)
    np.asarray(got)[:] = 3
    assert np.asarray(t).tolist() == [3.0] * 4


def test_errors_are_clear():
    q = mp.Queue()
    x = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(forksafe.InvalidArgumentError, match="detach"):
        q.put(x)
    with pytest.raises(forksafe.InvalidArgumentError, match="numpy array, torch tensor"):
        mp.share_memory([1, 2])
    with pytest.raises(forksafe.InvalidArgumentError, match="object"):
        mp.shared_ndarray(3, object)
    assert q.empty()  # nothing half-put


def test_sharing_strategies():
    assert mp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    before = mp.get_sharing_strategy()
    assert before == "file_descriptor"
    with pytest.raises(forksafe.InvalidArgumentError, match="file_descriptor"):
        mp.set_sharing_strategy("carrier_pigeon")
    mine = f"forksafe_{os.getpid()}_"
    try:
        mp.set_sharing_strategy("file_system")
        q = mp.Queue()
        q.put(torch.full((1 << 20,), 2.0))  # 4 MiB, in a named segment
        assert float(q.get(timeout=5).sum()) == 2.0 * (1 << 20)
        assert any(n.startswith(mine) for n in shm_entries())
    finally:
        mp.set_sharing_strategy(before)
    del q
    gc.collect()
    reduction.release_cached_memory()
    assert not [n for n in shm_entries() if n.startswith(mine)], "a named segment was left"


_KILLED_PRODUCER = r"""
import gc, os, signal, sys, time
import numpy as np
import forksafe.multiprocessing as mp
from forksafe.multiprocessing import reduction


def produce(q):
    mp.set_sharing_strategy("file_system")
    a = mp.shared_ndarray(1 << 18, np.float32)  # 1 MiB in a named segment of this process
    a[:] = 7
    q.put(a)
    time.sleep(60)  # SIGKILLed long before


def entries(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"forksafe_{pid}_")]


def wait_for(cond, limit):
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    q = ctx.Queue()
    p = ctx.Process(target=produce, args=(q,))
    p.start()
    a = q.get(timeout=60)
    mine = entries(p.pid)
    assert mine, "the producer made no named segment"
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL, p.exitcode
    # Its manager keeps what this process still maps ...
    time.sleep(1.5)
    assert all(os.path.exists("/dev/shm/" + n) for n in mine), "removed while mapped here"
    assert float(a.sum()) == 7 * (1 << 18)
    # ... and removes it once nobody does.
    del a
    gc.collect()
    reduction.release_cached_memory()
    assert wait_for(lambda: not entries(p.pid), 10), f"left in /dev/shm: {entries(p.pid)}"
    print("clean")
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_killed_file_system_producer_leaves_nothing_in_dev_shm(method, tmp_path):
    """The file_system strategy's manager is the package's forksafe-shm-manager: before, the
    library spawned the interpreter itself with the manager's flag (python: "unknown option
    --forksafe-shm-manager"), no manager ran, and a SIGKILLed producer left its segments in
    /dev/shm for good."""
    script = tmp_path / "killed_producer.py"
    script.write_text(_KILLED_PRODUCER)
    done = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "clean" in done.stdout, out
    assert "unknown option" not in out and "unavailable" not in out, out


def test_the_shm_manager_program_ships_with_the_package():
    program = os.path.join(os.path.dirname(forksafe.__file__), "forksafe-shm-manager")
    assert os.access(program, os.X_OK), program
    done = subprocess.run([program], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "not run by hand" in done.stderr, done


def test_nothing_leaks_across_many_messages():
    q = mp.Queue()
    a, b = mp.Pipe()
    for _ in range(5):  # warm the arena and the caches
        q.put(np.ones(1000))
        q.get(timeout=5)
    gc.collect()
    fds, shm = count_fds(), shm_entries()
    for i in range(300):
        q.put({"a": np.full(1000, i), "t": torch.full((100,), float(i)), "l": mp.Lock()})
        got = q.get(timeout=5)
        assert got["a"][0] == i and got["t"][0] == i
        a.send(got)
        b.recv()
        del got
    gc.collect()
    assert count_fds() <= fds, "descriptors leaked"
    assert shm_entries() <= shm, f"/dev/shm entries leaked: {shm_entries() - shm}"


def test_structured_conjugated_and_sent_views_keep_their_values():
    q = mp.Queue()
    rec = mp.shared_ndarray(3, [("a", "<i4"), ("b", "<f8")])
    rec["a"] = [1, 2, 3]
    q.put(rec)
    got = q.get(timeout=5)
    assert got.dtype.names == ("a", "b") and got["a"].tolist() == [1, 2, 3]
    z = torch.tensor([1 + 2j, 3 - 4j]).conj()
    q.put(z)
    assert q.get(timeout=5).tolist() == z.tolist()
    n = torch.tensor([1.0, 2.0])._neg_view()
    q.put(n)
    assert q.get(timeout=5).tolist() == [-1.0, -2.0]


def write_first(arr, out):
    try:
        arr.flat[0] = 99
        out.put("written")
    except ValueError as e:
        out.put(f"refused: {e}")


def test_numpy_layouts_and_read_only_views_cross_as_they_are():
    """A column-major array arrives column-major (as pickling keeps it); a read-only view of
    shared memory arrives read-only, so a receiver cannot write what the sender protected (it
    arrived writable, and the write reached the sender's memory)."""
    q = mp.Queue()
    f = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    q.put(f)
    got = q.get(timeout=5)
    assert got.flags.f_contiguous and not got.flags.c_contiguous
    assert (got == f).all()
    fs = mp.share_memory(f)
    assert fs.flags.f_contiguous and (fs == f).all() and mp.is_shared(fs)
    b = np.broadcast_to(np.arange(3.0), (4, 3))  # stride 0: a compact copy, as pickling makes
    q.put(b)
    got = q.get(timeout=5)
    assert got.shape == (4, 3) and (got == b).all()

    shared = mp.shared_ndarray(4)
    view = shared[1:]
    view.flags.writeable = False
    out = mp.Queue()
    p = mp.Process(target=write_first, args=(view, out))
    p.start()
    assert out.get(timeout=60).startswith("refused")
    p.join(60)
    assert p.exitcode == 0
    assert shared[1] == 0
    p = mp.Process(target=write_first, args=(shared[1:], out))  # a writable view stays writable
    p.start()
    assert out.get(timeout=60) == "written"
    p.join(60)
    assert shared[1] == 99
    with pytest.raises(forksafe.InvalidArgumentError, match="order"):
        mp.shared_ndarray(3, order="K")


def ack_after_dropping(q, out):
    while True:
        t = q.get(timeout=30)
        if t is None:
            break
        total = float(t[0]) + float(t[-1])
        del t  # dropped before the ack: the sender's next allocation finds the block free
        out.put((total, len(reduction._torch_shared)))


def test_a_dropped_torch_tensor_gives_its_shared_memory_back_at_once():
    t = torch.full((1000,), 3.0)
    mp.share_memory(t)
    ptr = reduction._storage_ptr(t)
    assert mp.is_shared(t) and ptr in reduction._torch_shared
    view = t[10:]
    del t
    assert ptr in reduction._torch_shared, "a view still uses the memory"
    view += 1
    del view
    # No prune, no collection: the storage's release drops the record (and the memory) itself.
    assert ptr not in reduction._torch_shared


def test_repeated_fresh_large_sends_reuse_one_cached_segment():
    # A fresh large torch tensor per send (torch's own memory, moved into shared memory on
    # send): once the receiver drops each one, the sender's copies all land in one warm cached
    # segment (arena stats), not a new segment (and its first-touch faults) per send.
    n = (20 << 20) // 4  # 20 MiB: a dedicated (large) segment
    q, out = mp.Queue(), mp.Queue()
    p = mp.Process(target=ack_after_dropping, args=(q, out))
    p.start()
    try:
        for i in range(2):  # warm-up: the first segment is made here
            q.put(torch.full((n,), float(i)))
            assert out.get(timeout=30)[0] == 2.0 * i
        before = reduction._mp.arena_stats()
        for i in range(2, 8):
            q.put(torch.full((n,), float(i)))
            total, receiver_records = out.get(timeout=30)
            assert total == 2.0 * i
            assert receiver_records == 0, "the receiver still records a tensor it dropped"
        after = reduction._mp.arena_stats()
    finally:
        q.put(None)
        assert finish([p]) == [0]
    assert after["segments_created"] == before["segments_created"], (before, after)
    assert after["large_segments_reused"] - before["large_segments_reused"] == 6, (before, after)


def test_a_lone_tensor_crosses_in_the_short_form_with_its_layout_intact():
    # A message that is one plain CPU tensor skips the pickler (reduction._dumps_torch): every
    # layout must still arrive as it left, over the same memory.
    base = torch.arange(24, dtype=torch.float32)
    cases = {
        "flat": base,
        "matrix": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "slice": base[5:11],
        "transposed": torch.arange(6, dtype=torch.float64).reshape(2, 3).t(),
        "strided": base[::3],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0),
        "empty matrix": torch.zeros(3, 0, dtype=torch.int32),
        "expanded": torch.tensor([1, 2, 3], dtype=torch.int16).expand(4, 3),
        "half": torch.tensor([1.5, -2.0], dtype=torch.float16),
        "bool": torch.tensor([True, False, True]),
        "complex": torch.tensor([1 + 2j, 3 - 4j]),
        "leaf requiring grad": torch.ones(3, requires_grad=True),
    }
    q = mp.Queue()
    for name, t in cases.items():
        data, tensors, fds = reduction.dumps(t)
        if t.numel():
            assert data[:1] == b"\x00" and len(tensors) == 1 and fds == [], name
        else:  # no memory to share: the shape crosses in the pickle
            assert data[:1] != b"\x00" and tensors == [] and fds == [], name
        q.put(t)
        got = q.get(timeout=5)
        assert type(got) is torch.Tensor, name
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert got.stride() == t.stride() and got.storage_offset() == t.storage_offset(), name
        assert got.requires_grad == t.requires_grad, name
        assert torch.equal(got.detach(), t.detach()), name
        assert reduction.is_shared(t), name  # moved into shared memory in place
        if got.numel():  # in one process the very same memory, not a copy
            assert got.data_ptr() == t.data_ptr(), name
    # A write through the received tensor is the sender's: the same memory, not a copy.
    q.put(base)
    got = q.get(timeout=5)
    got[7] = -1.0
    assert base[7].item() == -1.0
    # A view made after the first send crosses over the same memory too.
    view = base[2:4]
    q.put(view)
    got = q.get(timeout=5)
    got[0] = 42.0
    assert base[2].item() == 42.0
    # A Parameter (a subclass) takes the pickler and stays a Parameter.
    p = torch.nn.Parameter(torch.zeros(2))
    assert reduction.dumps(p)[0][:1] != b"\x00"


def test_plain_values_cross_without_the_pickler_and_keep_their_types():
    q = mp.Queue()
    values = [0, -7, 2**100, 1.25, float("inf"), 3 - 1j, True, None, "", "päckchen", b"\x00\x80",
              [1, "two", 3.0], {"k": (1, 2)}]
    for v in values:
        data, tensors, fds = reduction.dumps(v)
        assert tensors == [] and fds == []
        q.put(v)
        got = q.get(timeout=5)
        assert got == v and type(got) is type(v), v
    # A message whose first byte would be the short form's is never a pickle: b"\x00" crosses
    # as bytes, not as a tensor.
    q.put(b"\x00")
    assert q.get(timeout=5) == b"\x00"


def test_a_tensor_over_known_memory_is_made_from_the_live_one_and_checked_first():
    # While a torch tensor over a message's memory lives here, the received tensor is made from
    # it (one op, no DLPack import); a live tensor that moved to other memory or joined an
    # autograd graph is not used.
    q = mp.Queue()
    t = torch.arange(8, dtype=torch.float32)
    q.put(t)  # t moves into shared memory
    ptr = t.data_ptr()
    got = q.get(timeout=5)
    assert got._base is t and got.data_ptr() == ptr
    got[0] = 5.0
    assert t[0].item() == 5.0
    t.unsqueeze_(0)  # t's metadata changes; its memory does not
    q.put(got)
    again = q.get(timeout=5)
    assert again.shape == (8,) and again.data_ptr() == ptr and again[0].item() == 5.0
    with torch.no_grad():
        t.set_(torch.zeros(3))  # t now over other memory: the message's memory is imported
    q.put(got)
    moved = q.get(timeout=5)
    assert moved.data_ptr() == ptr and moved[0].item() == 5.0 and moved.shape == (8,)
    assert moved._base is not t
    p = torch.nn.Parameter(torch.ones(4))
    q.put(p)
    got_p = q.get(timeout=5)  # p requires grad: a view of it would be part of its graph
    assert isinstance(got_p, torch.nn.Parameter) and got_p.is_leaf and got_p.grad_fn is None
    got_p.data[1] = 3.0
    assert p[1].item() == 3.0
    assert reduction.is_shared(moved) and reduction.is_shared(got)


def echo_tensors(q, out, n):
    for _ in range(n):
        t = q.get(timeout=30)
        t[1] = t[0] + 1
        out.put(t)
        del t


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_round_trip_comes_back_over_the_senders_own_tensor(method):
    # The reply's memory is the sender's tensor's: the received tensor is made from it (no new
    # import here), and the child's writes are there.
    ctx = mp.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo_tensors, args=(q, out, 20))
    p.start()
    t = torch.zeros(16, dtype=torch.float64)
    for i in range(20):
        t[0] = i
        q.put(t)
        back = out.get(timeout=30)
        assert back._base is t and back.data_ptr() == t.data_ptr()
        assert t[1].item() == i + 1 and back[1].item() == i + 1
    assert finish([p]) == [0]


def test_threads_sending_and_dropping_tensors_at_once_keep_values_and_records_bounded():
    # Records are made, used and dropped (a storage's release runs on whichever thread lets go)
    # by several threads at once: every value arrives intact and no record outlives its memory.
    import threading
    errors = []
    gc.collect()
    reduction.release_cached_memory()
    records_before = len(reduction._torch_shared)

    def work(k):
        try:
            q = mp.Queue()
            shared = torch.zeros(64, dtype=torch.int64)
            for i in range(300):
                fresh = torch.full((32,), float(i))
                shared[0] = i
                q.put(fresh)
                q.put(shared)
                got_fresh, got_shared = q.get(timeout=10), q.get(timeout=10)
                assert got_fresh[5].item() == i and got_shared[0].item() == i
                got_shared[1] = k
                assert shared[1].item() == k
                del fresh, got_fresh, got_shared
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a sending thread did not finish within 120 s"
    assert not errors, errors
    gc.collect()
    reduction.release_cached_memory()
    assert len(reduction._torch_shared) <= records_before, (
        f"{len(reduction._torch_shared) - records_before} records outlived their memory")


def dense_back(q, out):
    for _ in range(3):
        t = q.get(timeout=30)
        out.put(t.to_dense() if t.is_sparse else t.dequantize())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sparse_and_quantized_tensors_cross_as_copies(method):
    # torch.multiprocessing cannot send these (its reducer asks a sparse tensor for its storage;
    # a quantized one arrives with an unknown quantizer). Here they take torch's own pickling:
    # a sparse tensor's indices and values through shared memory, a quantized one's bytes.
    import torch.multiprocessing  # noqa: F401 (registers torch's reducers: they must not be used)
    sent = [torch.tensor([[0, 2.0], [3, 0]]).to_sparse(),
            torch.quantize_per_tensor(torch.tensor([1.0, 2.5]), 0.1, 0, torch.quint8),
            torch.quantize_per_channel(torch.ones(2, 3), torch.tensor([0.1, 0.2]),
                                       torch.tensor([0, 1]), 0, torch.qint8)]
    q = mp.Queue()
    for t in sent:
        q.put(t)
        got = q.get(timeout=5)
        assert got.layout == t.layout and got.dtype == t.dtype and got.shape == t.shape
    ctx = mp.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=dense_back, args=(q, out))
    p.start()
    for t in sent:
        q.put(t)
        dense = out.get(timeout=30)
        assert torch.equal(dense, t.to_dense() if t.is_sparse else t.dequantize())
    assert finish([p]) == [0]


class _FailsToRebuild:
    def __reduce__(self):
        return (_FailsToRebuild.rebuild, ())

    @staticmethod
    def rebuild():
        raise ValueError("cannot rebuild")


def put_tensor_then(q, done, extra):
    q.put([torch.ones(4), extra] if extra is not None else torch.ones(4))
    done.wait(30)


@pytest.mark.parametrize("case", ["a rebuild raises", "an operator raises"])
def test_a_received_tensor_freed_while_an_exception_is_raised_keeps_that_exception(case):
    """A received tensor's release notice ran Python code that cleared the exception being
    raised: the caller got SystemError ("returned NULL without setting an exception") instead of
    the ValueError of a failed rebuild or torch's TypeError."""
    q, done = mp.Queue(), mp.Event()
    extra = _FailsToRebuild() if case == "a rebuild raises" else None
    p = mp.Process(target=put_tensor_then, args=(q, done, extra))
    p.start()
    try:
        if case == "a rebuild raises":
            with pytest.raises(ValueError, match="cannot rebuild"):
                q.get(timeout=60)
        else:
            with pytest.raises(TypeError, match="Tensor"):
                torch.stack([q.get(timeout=60), "not a tensor"])
    finally:
        done.set()
        p.join(60)
    q.put("next")
    assert q.get(timeout=5) == "next"


def row_sum(r):
    return float(r.sum())


def test_rows_of_an_unshared_tensor_move_only_their_own_bytes():
    """Each view of an unshared tensor moved (copied) its whole storage: Pool.map over the 800
    rows of an 8 MB tensor copied 6.4 GB (20 s, 7.6 GB resident; torch 0.2 s). A view moves
    only the bytes it spans, with its strides."""
    from forksafe import _forksafe
    t = torch.arange(800 * 2500, dtype=torch.float32).reshape(800, 2500)
    before = _forksafe.mp.arena_stats()["bytes_reserved"]
    rows = list(t[:200])
    q = mp.Queue()
    for r in rows:
        q.put(r)
        q.get(timeout=5)
    grew = _forksafe.mp.arena_stats()["bytes_reserved"] - before
    assert grew < 64 << 20, f"200 rows of 10 KB reserved {grew >> 20} MiB"
    assert all(mp.is_shared(r) for r in rows) and rows[7][3] == 7 * 2500 + 3
    col = t[:, 5]  # spread over far more memory than it holds: a compact copy moves
    q.put(col)
    back = q.get(timeout=5)
    assert col.stride() == (1,) and back.stride() == (1,)
    assert torch.equal(back, torch.arange(800, dtype=torch.float32) * 2500 + 5)
    block = t[10:20, 100:2400]  # within twice its size: its span moves, strides kept
    q.put(block)
    assert block.stride() == (2500, 1) and torch.equal(q.get(timeout=5), block)
    with mp.Pool(2) as pool:
        assert pool.map(row_sum, t) == [float(r.sum()) for r in t]


class TaggedTensor(torch.Tensor):
    pass


class MyParameter(torch.nn.Parameter):
    pass


def test_tensor_subclasses_keep_their_class_and_attributes():
    """A torch.Tensor subclass arrived as a plain Tensor without its attributes, a Parameter's
    subclass as a plain Tensor (torch.multiprocessing keeps the class and the attributes, and
    sends a Parameter's subclass as a Parameter)."""
    q = mp.Queue()
    t = torch.ones(3).as_subclass(TaggedTensor)
    t.meta = "A"
    p = MyParameter(torch.ones(2))
    empty = torch.empty(0).as_subclass(TaggedTensor)
    q.put([t, p, empty])
    got_t, got_p, got_empty = q.get(timeout=5)
    assert type(got_t) is TaggedTensor and got_t.meta == "A" and got_t.tolist() == [1.0] * 3
    assert isinstance(got_p, torch.nn.Parameter) and got_p.requires_grad
    assert type(got_empty) is TaggedTensor and got_empty.shape == (0,)
    got_t[0] = 5  # the same shared memory
    assert t[0] == 5


def scale_in_place(a):
    a *= 2
    return float(a.sum())


def test_private_read_only_arrays_arrive_as_writable_copies_and_plain_tensors_stay_plain():
    """A read-only private array (np.frombuffer of bytes, a broadcast) arrived read-only, so a
    worker could not scale its own copy (multiprocessing gives a writable copy). A plain
    tensor sent back over memory the sender held as a subclass arrived as that subclass."""
    with mp.Pool(1) as pool:
        assert pool.map(scale_in_place, [np.frombuffer(b"\0" * 8 + b"\1" * 8, np.uint8),
                                         np.broadcast_to(np.ones(2), (2, 2))]) == [16.0, 8.0]
    q = mp.Queue()
    t = torch.arange(4.0).as_subclass(TaggedTensor)
    q.put(t)
    got = q.get(timeout=5)
    assert type(got) is TaggedTensor
    q.put(got.as_subclass(torch.Tensor)[1:])
    back = q.get(timeout=5)
    assert type(back) is torch.Tensor and back.tolist() == [1.0, 2.0, 3.0]


def test_columns_of_an_unshared_tensor_move_as_compact_copies():
    """A column spans nearly its whole storage: Pool.map over the 400 columns of a 4 MB tensor
    copied the storage per column (1.9 GB resident). A view spread over more than twice the
    memory it holds moves as a compact copy (its strides become contiguous)."""
    from forksafe import _forksafe
    t = torch.arange(2500 * 400, dtype=torch.float64).reshape(2500, 400)  # exact sums
    before = _forksafe.mp.arena_stats()["bytes_reserved"]
    cols = list(t.T)
    q = mp.Queue()
    for c in cols[:100]:
        q.put(c)
        q.get(timeout=5)
    grew = _forksafe.mp.arena_stats()["bytes_reserved"] - before
    assert grew < 64 << 20, f"100 columns of 10 KB reserved {grew >> 20} MiB"
    assert cols[3].stride() == (1,) and torch.equal(cols[3], t[:, 3]) and mp.is_shared(cols[3])
    with mp.Pool(2) as pool:
        assert pool.map(row_sum, t.T) == [float(c.sum()) for c in t.T]


def send_shared_arrays(conn, n):
    for _ in range(n):
        conn.send(np.ones(1 << 18))  # 2 MiB each, copied into shared memory per message
    conn.send("end")
    conn.recv()


def test_recv_bytes_refusing_a_message_with_arrays_gives_their_memory_back():
    """recv_bytes() refused a send() message that carried shared memory without decoding it:
    the memory stayed counted for good (a sender's resident memory grew by 825 MB over 800
    messages of 1 MiB)."""
    from forksafe import _forksafe
    a, b = mp.Pipe()
    n = 40
    p = mp.Process(target=send_shared_arrays, args=(b, n))
    p.start()
    for _ in range(n):
        with pytest.raises(forksafe.InvalidArgumentError, match="recv"):
            a.recv_bytes()
    assert a.recv() == "end"
    a.send("ok")
    p.join(60)
    assert p.exitcode == 0
    # In one process: the sender's arena reuses the refused messages' blocks.
    c, d = mp.Pipe()
    c.send(np.ones(1 << 18))
    with pytest.raises(forksafe.InvalidArgumentError):
        d.recv_bytes()
    before = _forksafe.mp.arena_stats()["bytes_reserved"]
    for _ in range(n):
        c.send(np.ones(1 << 18))
        with pytest.raises(forksafe.InvalidArgumentError):
            d.recv_bytes()
    grew = _forksafe.mp.arena_stats()["bytes_reserved"] - before
    assert grew < 16 << 20, f"{n} refused messages of 2 MiB kept {grew >> 20} MiB"
