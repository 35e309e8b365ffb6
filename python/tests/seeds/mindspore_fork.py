# The MindSpore example (mindspore_multiprocessing_zh.md): a parent that computed on the
# accelerator forks; the child's backend is reset to the CPU and it computes there. Only the
# import changed (forksafe's Tensor stands in for MindSpore's; the simulated accelerator for
# Ascend).
import math

import numpy as np

import forksafe
import forksafe.multiprocessing as multiprocessing


def log_of_two():
    t = forksafe.Tensor.full([1], 2.0, device=forksafe.default_device())
    return t.device, math.log(float(np.asarray(t.to("cpu"))[0]))


def child_process(q):
    q.put((forksafe.default_device(),) + log_of_two())


if __name__ == '__main__':
    forksafe.set_default_device("sim:0")
    multiprocessing.set_start_method("fork", force=True)
    print("parent process: log(2.0)=", log_of_two())
    q = multiprocessing.Queue()
    p = multiprocessing.Process(target=child_process, args=(q,))
    p.start()
    default, device, value = q.get(timeout=60)
    print("child process: log(2.0)=", value, "on", device)
    p.join(60)
    assert p.exitcode == 0
    assert default == "cpu" and device == "cpu", (default, device)
    assert abs(value - math.log(2.0)) < 1e-6
    with multiprocessing.Pool(processes=2) as pool:
        outputs = pool.map(math.log, [2.0, 2.0])
    print("pool: log(2.0)=", outputs)
    assert outputs == [math.log(2.0)] * 2
    print("SEED OK")
