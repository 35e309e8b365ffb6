# The tutorial's Lock example (multiprocessing_in_pytorch_notes.md), with only the import changed.
import forksafe.multiprocessing as mp


def foo(l, q, i):
    l.acquire()
    try:
        q.put(f'hello from process {i}')
    finally:
        l.release()


if __name__ == '__main__':
    mp.set_start_method('spawn')
    lock = mp.Lock()
    q = mp.Queue()
    procs = []
    for i in range(10):
        p = mp.Process(target=foo, args=(lock, q, i))
        procs.append(p)
        p.start()
    first = q.get(timeout=60)
    print(first)
    print("Waiting for the process to finish...")
    for p in procs:
        p.join(60)
    rest = [q.get(timeout=10) for _ in range(9)]
    assert sorted([first] + rest) == sorted(f'hello from process {i}' for i in range(10))
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    print("SEED OK")
