# The tutorial's Queue example (multiprocessing_in_pytorch_notes.md), with only the import changed.
import forksafe.multiprocessing as mp


def foo(q, i):
    q.put(f'hello from process {i}')


if __name__ == '__main__':
    mp.set_start_method('spawn')
    q = mp.Queue()
    procs = []
    for i in range(10):
        p = mp.Process(target=foo, args=(q, i))
        procs.append(p)
        p.start()
    print(q.qsize())
    got = sorted(q.get(timeout=60) for _ in range(10))
    for line in got:
        print(line)
    print("Waiting for the process to finish...")
    for p in procs:
        p.join(60)
    assert got == sorted(f'hello from process {i}' for i in range(10)), got
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    print("SEED OK")
