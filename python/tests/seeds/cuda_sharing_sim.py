# The CUDA-sharing rules example of the torch doc (torch_multiprocessing.rst, "Sharing CUDA
# tensors"), rewritten for what forksafe allows: the producer puts an accelerator tensor on a
# queue and EXITS; the consumer, started afterwards, still reads it on the device (torch: "the
# producer process must keep the original tensor as long as the consumer process has reference
# to it"). Runs on the simulated accelerator here; on "cuda:0" where a GPU is.
# Usage: cuda_sharing_sim.py DEVICE
import sys

import numpy as np

import forksafe
import forksafe.multiprocessing as mp


def producer(q, device):
    t = forksafe.Tensor.full([1024], 2.5, device=device)
    q.put(t)
    # returns at once: nothing waits for the consumer


def consumer(q, out):
    t = q.get(timeout=60)
    host = np.asarray(t.to("cpu"))
    out.put((t.device, float(host.sum()), host.shape))


if __name__ == '__main__':
    device = sys.argv[1]
    mp.set_start_method('spawn')
    q, out = mp.Queue(), mp.Queue()
    p = mp.Process(target=producer, args=(q, device))
    p.start()
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    c = mp.Process(target=consumer, args=(q, out))
    c.start()
    dev, total, shape = out.get(timeout=60)
    c.join(60)
    print(dev, total, shape)
    assert dev == device and total == 2.5 * 1024 and shape == (1024,), (dev, total, shape)
    assert c.exitcode == 0
    print("SEED OK")
