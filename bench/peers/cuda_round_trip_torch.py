"""bench/peers/cuda_round_trip_torch.py: torch.multiprocessing's Queue round trip of a CUDA tensor.

The peer of BM_CudaTensorSendAck in bench/device_tensor_benchmark.cc, run on the same GPU
machine in the same command so the two can be compared as a ratio (docs/peers.md, "CUDA"):
a child started with "spawn" gets each tensor and answers with its element count; one iteration
is put + get of the answer; the tensor is on the device and was sent once before timing.
torch's rule applies (the producer keeps the tensor alive while the child holds it), which the
loop satisfies. The child cannot send the tensor itself back, as forksafe's echo does: torch
refuses ("Attempted to send CUDA tensor received from another process; this is not currently
supported. Consider cloning before sending.").

    python3 bench/peers/cuda_round_trip_torch.py [seconds_per_size]

Prints one line per size: median microseconds per round trip over three timed runs.
"""
import statistics
import sys
import time

import torch
import torch.multiprocessing as tmp


def ack(inq, outq):
    while True:
        t = inq.get()
        if t is None:
            return
        outq.put(t.numel())
        del t


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
    if not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device")
        return 0
    ctx = tmp.get_context("spawn")
    for nbytes in (4 << 10, 1 << 20, 16 << 20):
        inq, outq = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=ack, args=(inq, outq))
        child.start()
        t = torch.zeros(nbytes // 4, dtype=torch.float32, device="cuda:0")
        inq.put(t)
        outq.get(timeout=60)  # warm: the child opened the handle once
        runs = []
        for _ in range(3):
            n = 0
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                inq.put(t)
                back = outq.get(timeout=60)
                del back
                n += 1
            runs.append((time.perf_counter() - start) / n * 1e6)
        inq.put(None)
        child.join(30)
        if child.exitcode is None:
            child.kill()
        print(f"torch CUDA tensor send + ack {nbytes // 1024} KiB: {statistics.median(runs):.1f} us "
              f"(runs {', '.join(f'{r:.1f}' for r in runs)}; {torch.__version__})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
