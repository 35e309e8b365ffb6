# The tutorial's Manager example (multiprocessing_in_pytorch_notes.md): only the import changed,
# run with the spawn start method.
from forksafe.multiprocessing import Manager, Process, set_start_method


def f(d, l):
    d[1] = '1'
    d['2'] = 2
    d[0.25] = None
    l.reverse()


if __name__ == '__main__':
    set_start_method('spawn')
    with Manager() as manager:
        d = manager.dict()
        l = manager.list(range(10))

        p = Process(target=f, args=(d, l))
        p.start()
        p.join(60)

        print(d)
        print(l)
        assert p.exitcode == 0
        assert dict(d) == {1: '1', '2': 2, 0.25: None}, dict(d)
        assert list(l) == list(range(9, -1, -1)), list(l)
    print("SEED OK")
