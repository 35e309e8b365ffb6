# The tutorial's Value/Array example (multiprocessing_in_pytorch_notes.md): only the import
# changed, run with the spawn start method.
from forksafe.multiprocessing import Array, Process, Value, set_start_method


def f(n, a):
    n.value = 3.1415927
    for i in range(len(a)):
        a[i] = -a[i]


if __name__ == '__main__':
    set_start_method('spawn')
    num = Value('d', 0.0)
    arr = Array('i', range(10))

    p = Process(target=f, args=(num, arr))
    p.start()
    p.join(60)

    print(num.value)
    print(arr[:])
    assert p.exitcode == 0
    assert num.value == 3.1415927
    assert arr[:] == [-i for i in range(10)]
    print("SEED OK")
