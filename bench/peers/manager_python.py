#!/usr/bin/python3
"""Python's multiprocessing.Manager() doing what bench/mp_benchmark.cc's BM_Manager* do.

  /usr/bin/python3 bench/peers/manager_python.py

- dict_set_get: d[1] = i; d[1]  (two proxy round trips), as BM_ManagerDictSetGet.
- value_get: v.value of a Manager().Value('i', 7) (one round trip), as BM_ManagerValueGet.
Each is run for at least 0.5 s, 3 repetitions; the median per-iteration time is printed in us
(the same rule as Google Benchmark's MinTime(0.5)->Repetitions(3) median). Start method "fork",
as the C++ benchmark.
"""
import multiprocessing as mp
import statistics
import time


def timed(fn, min_time=0.5, reps=3):
    medians = []
    for _ in range(reps):
        n = 1
        while True:
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
            n *= 2 if dt < min_time / 4 else 1
            if dt >= min_time / 4:
                n = int(n * min_time / dt * 1.1) + 1
        medians.append(dt / n * 1e6)
    return statistics.median(medians)


def main():
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        d = manager.dict()
        v = manager.Value("i", 7)

        def set_get(i):
            d[1] = i
            return d[1]

        def value_get(_):
            return v.value

        print(f"python {'.'.join(map(str, __import__('sys').version_info[:3]))}, "
              f"multiprocessing.Manager (fork)")
        print(f"  dict_set_get_us {timed(set_get):10.2f}")
        print(f"  value_get_us    {timed(value_get):10.2f}")


if __name__ == "__main__":
    main()
