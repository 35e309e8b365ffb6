"""bench/peers/python_ipc_floor.py: what the Python side of workload 1 costs with no queue at all
(the floor of the Python column's round trip, docs/peers.md "Python against Python").

    /usr/bin/python3 bench/peers/python_ipc_floor.py

Two processes of a torch-importing interpreter (fork), unpinned, play ping-pong over a
socketpair with 64-byte messages (os.write / os.read, no pickling), each side spinning on a
non-blocking read as forksafe's queues spin before they sleep (a blocking read adds the
kernel's wake-up, 55 us a round trip on the machine of docs/peers.md): the interpreter's own
cost of one message each way. Then the same ping-pong with workload 1's work added: the child writes
t[1] = t[0] + 1 into a torch tensor both processes share (created before the fork, so nothing
crosses but the 64 bytes); the parent sets t[0] and checks t[1] outside the timed span, as
peers_torch.py does. Prints medians of 20,000 round
trips after 1,000 warm-up ones, in microseconds. Compare with the C floor of the same run
(peers_floor's "socketpair ping-pong, 64 B there and back, unpinned") and with the Python
column's round trip.
"""
import os
import socket
import statistics
import time

import torch

WARMUP, N = 1000, 20000
MSG = b"x" * 64


def read_spinning(fd):
    while True:
        try:
            return os.read(fd, 64)
        except BlockingIOError:
            pass


def child(sock, t, work):
    while True:
        data = read_spinning(sock)
        if not data or data[0:1] == b"q":
            os._exit(0)
        if work:
            t[1] = t[0] + 1
        os.write(sock, data)


def ping_pong(work):
    t = torch.zeros(1024).share_memory_()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    pid = os.fork()
    if pid == 0:
        a.close()
        child(b.fileno(), t, work)
    b.close()
    fd = a.fileno()
    samples = []
    for i in range(WARMUP + N):
        t[0] = i
        t0 = time.perf_counter()
        os.write(fd, MSG)
        got = read_spinning(fd)
        us = (time.perf_counter() - t0) * 1e6
        if len(got) != 64 or (work and t[1].item() != i + 1):
            raise RuntimeError("ping-pong: a lost message or the child's write is missing")
        if i >= WARMUP:
            samples.append(us)
    os.write(fd, b"q" * 64)
    os.waitpid(pid, 0)
    a.close()
    return statistics.median(samples)


def main():
    print(f"python socketpair ping-pong, 64 B there and back, unpinned: {ping_pong(False):.1f} us")
    print(f"  + workload 1's torch work in the child (t[1] = t[0] + 1): {ping_pong(True):.1f} us")


if __name__ == "__main__":
    main()
