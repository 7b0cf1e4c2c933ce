"""Benchmark the shared-memory connector against a plain memcpy (not part of the test run).

    python bench/connectors.py [--reps 20] [--sizes-mib 1 64] [--threads 1]

What is measured, per transfer, producer in a spawned child process and consumer in this one:

- put: the producer's `put` (allocate pages + one copy of the tensor into the pool);
- get: the consumer's `get` (map once, then build zero-copy views; the data is not read);
- end to end: from just before `put` in the child to just after `get` here, including sending the
  handle over a pipe (``time.perf_counter`` is the system-wide monotonic clock on Linux);
- memcpy: ``dst.copy_(src)`` into a preallocated tensor of the same size, in this process.

Transfers run one at a time (the child puts when this process asks, after the previous release),
after warm-up transfers that fault the pool's pages in, so each row is the steady state of a reused
pool. Each transfer is preceded by one timed memcpy, so both see the same machine load (the CPU may
be shared). Reported numbers are medians; ratio = shm bandwidth / memcpy bandwidth = memcpy time /
shm end-to-end time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection

MIB = 1 << 20
WARMUP = 3


def _producer(size: int, threads: int, pipe: Connection) -> None:
    import torch

    from omni_core.connectors.shm import SharedMemoryConnector

    torch.set_num_threads(threads)
    connector = SharedMemoryConnector(capacity_bytes=2 * size + 4 * MIB)
    tensor = torch.rand(size // 4)
    try:
        while pipe.recv():  # True: put one; False: stop
            started = time.perf_counter()
            handle = connector.put({"tensor": tensor})
            put_done = time.perf_counter()
            pipe.send((started, put_done, handle))
    finally:
        connector.close()


def bench_size(size: int, reps: int, threads: int) -> dict[str, float]:
    """Median times (s) of put, get, shm end to end and memcpy, interleaved."""
    import torch

    from omni_core.connectors.shm import SharedMemoryConnector

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    child = context.Process(target=_producer, args=(size, threads, there), daemon=True)
    child.start()
    consumer = SharedMemoryConnector(capacity_bytes=MIB)
    source = torch.rand(size // 4)
    target = torch.empty_like(source)
    times: dict[str, list[float]] = {"put": [], "get": [], "total": [], "memcpy": []}
    try:
        for index in range(reps + WARMUP):
            copy_started = time.perf_counter()
            target.copy_(source)
            copy_time = time.perf_counter() - copy_started
            here.send(True)
            started, put_done, handle = here.recv()
            got = time.perf_counter()
            payload = consumer.get(handle)
            done = time.perf_counter()
            assert payload["tensor"].numel() * 4 == size
            del payload
            consumer.release(handle)
            if index >= WARMUP:
                times["put"].append(put_done - started)
                times["get"].append(done - got)
                times["total"].append(done - started)
                times["memcpy"].append(copy_time)
        here.send(False)
    finally:
        consumer.close()
        child.join(60)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 64])
    # One thread by default: on a shared CPU a 2-thread copy waits on a descheduled thread and the
    # medians turn into noise; both sides always use the same count, so the ratio stays fair.
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both processes (0: torch's default)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"shm connector vs memcpy; medians of {args.reps} transfers; torch threads: {threads}\n")
    print("| size | put (ms) | get (ms) | shm end to end (ms) | memcpy (ms) | shm GB/s | memcpy GB/s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size_mib in args.sizes_mib:
        size = int(size_mib * MIB) // 4 * 4
        shm = bench_size(size, args.reps, threads)
        memcpy = shm["memcpy"]
        print(
            f"| {size_mib:g} MiB | {shm['put'] * 1e3:.3f} | {shm['get'] * 1e3:.3f} | {shm['total'] * 1e3:.3f} "
            f"| {memcpy * 1e3:.3f} | {size / shm['total'] / 1e9:.2f} | {size / memcpy / 1e9:.2f} "
            f"| {memcpy / shm['total']:.2f}x |"
        )


if __name__ == "__main__":
    main()
