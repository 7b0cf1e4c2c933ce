"""Benchmark the connectors against the raw calls they wrap (not part of the test run).

    python bench/connectors.py [--reps-small 300] [--reps-large 12] [--threads 1]
    python bench/connectors.py --systems shm memcpy        # without Mooncake

Every transfer has its producer in a spawned child process and its consumer in this one, as
between two stage workers. One transfer: this process asks the child for a payload; the child
puts it and sends the handle back over a pipe; this process gets it (zero-copy views, not read)
and then releases it. Timed per transfer (medians, then p90 for the small size):

- put: the producer's call in the child;
- get: the consumer's call here;
- end to end: from just before the put in the child to just after the get here, pipe included
  (``time.perf_counter`` is the system-wide monotonic clock on Linux);
- release: the consumer's release here (not part of end to end: a stage releases after its
  step).

Systems (a single float32 tensor per payload, 4 KiB and 64 MiB by default):

- ``shm``, ``mooncake-store``, ``mooncake-te``: the connectors, through put/get/release;
- ``store raw``: what mooncake-store wraps, on buffers registered beforehand: ``put_from`` of the
  tensor's bytes in the child (it already lies in registered memory, so no copy), ``get_into`` a
  registered buffer here, ``remove`` as the release;
- ``te raw``: what mooncake-te wraps: the child only sends the address of the bytes in its
  registered memory; here one ``transfer_sync_read`` into a registered buffer;
- ``memcpy``: ``dst.copy_(src)`` of the same size in this process, the floor of any copy.

Transfers run round robin over the systems (one of each, then the next round; small ones in
blocks of `SMALL_BLOCK` back to back), after warm-up rounds that fault every buffer in, so every
system sees the same machine load (the CPU may be shared). Ratios: the raw call's end-to-end time over the connector's (bandwidth ratio; goal >= 0.8
at the large size) and the connector's added time (connector minus raw, p50; goal < 100 us at the
small size). A master for the store runs on 127.0.0.1 for the duration.

"added (paired)" is a second estimate of the same difference, less moved by a shared CPU: per
round, the median of the connector's block minus the median of the raw call's block (run right
before it), then the median over rounds; a load that changes between rounds cancels out, where
the plain p50s of two long series each take in whatever load their samples met.

A second table runs the same with the producer in this process (`--no-same-process` skips it):
no pipe, no process waking up per transfer, so its differences are the connectors' own work. On a
small shared CPU the wake-ups of the first table cost more than the connectors themselves, and
vary from run to run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

KIB = 1 << 10
MIB = 1 << 20
WARMUP = 3
SMALL_BLOCK = 10
"""Small transfers run this many back to back per system and round: one edge's steady state, with
its code and data warm, as a busy edge has them."""
SYSTEMS = ("memcpy", "shm", "store raw", "mooncake-store", "te raw", "mooncake-te")
WRAPS = {"mooncake-store": "store raw", "mooncake-te": "te raw", "shm": "memcpy"}


def _registered(register: Any, nbytes: int) -> Any:
    """A page-aligned uint8 array of `nbytes`, registered with `register(ptr, size)` and faulted in."""
    from omni_mooncake.buffers import aligned_zeros

    array = aligned_zeros(nbytes)
    array[:] = 1
    assert register(array.ctypes.data, array.nbytes) == 0
    return array


def _new_store(master: str, segment: int) -> Any:
    from omni_mooncake.mooncake_bridge import import_store

    store_cls, _ = import_store()
    store = store_cls()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", max(segment, 16 * MIB), 16 * MIB, "tcp", "", master) == 0
    return store


class Producer:
    """One system's producing side, in the child: `put()` returns a handle for the consumer."""

    def __init__(self, system: str, size: int, master: str) -> None:
        import torch

        self.tensor = torch.rand(size // 4)
        self.size = size
        capacity = 4 * size + 4 * MIB
        if system == "shm":
            from omni_core.connectors.shm import SharedMemoryConnector

            self.connector: Any = SharedMemoryConnector(capacity_bytes=capacity)
        elif system == "mooncake-store":
            from omni_mooncake.store import MooncakeStoreConnector

            self.connector = MooncakeStoreConnector(master=master, capacity_bytes=capacity, buffer_bytes=capacity)
        elif system == "mooncake-te":
            from omni_mooncake.transfer_engine import MooncakeTransferEngineConnector

            self.connector = MooncakeTransferEngineConnector(pool_bytes=capacity, buffer_bytes=capacity)
        elif system == "store raw":
            from omni_mooncake.mooncake_bridge import import_store

            self.store = _new_store(master, capacity)
            self.buffer = _registered(self.store.register_buffer, size)
            self.buffer[:] = self.tensor.numpy().view("uint8")
            self.config = import_store()[1]()
            self.config.with_hard_pin = True
            self.config.preferred_segment = self.store.get_hostname()
            self.prefix = uuid.uuid4().hex
            self.count = 0
        elif system == "te raw":
            from omni_mooncake.mooncake_bridge import import_transfer_engine

            self.engine = import_transfer_engine()()
            assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            self.buffer = _registered(self.engine.register_memory, size)
            self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.system = system

    def put(self) -> Any:
        if self.system == "store raw":
            self.count += 1
            key = f"{self.prefix}/{self.count}"
            assert self.store.put_from(key, self.buffer.ctypes.data, self.size, self.config) == 0
            return key
        if self.system == "te raw":
            return (self.session, self.buffer.ctypes.data)
        return self.connector.put({"tensor": self.tensor})

    def close(self) -> None:
        if hasattr(self, "connector"):
            self.connector.close()
        elif self.system == "store raw":
            self.store.close()


def _produce(system: str, size: int, master: str, threads: int, pipe: Connection) -> None:
    import torch

    torch.set_num_threads(threads)
    producer = Producer(system, size, master)
    pipe.send("ready")
    try:
        while pipe.recv():  # True: put one; False: stop
            started = time.perf_counter()
            handle = producer.put()
            put_done = time.perf_counter()
            pipe.send((started, put_done, handle))
    finally:
        producer.close()


class InlineProducer:
    """A producer in this very process behind the pipe's interface: `send(True)` puts one and
    `recv()` returns what the child would have sent (for the same-process table)."""

    def __init__(self, system: str, size: int, master: str) -> None:
        self.producer = Producer(system, size, master)
        self.result: Any = "ready"

    def send(self, go: bool) -> None:
        if not go:
            self.producer.close()
            return
        started = time.perf_counter()
        handle = self.producer.put()
        self.result = (started, time.perf_counter(), handle)

    def recv(self) -> Any:
        return self.result


class Consumer:
    """One system's consuming side, here: `get(handle)` and `release(handle)`."""

    def __init__(self, system: str, size: int, master: str) -> None:
        self.system = system
        self.size = size
        capacity = 4 * size + 4 * MIB
        if system == "shm":
            from omni_core.connectors.shm import SharedMemoryConnector

            self.connector: Any = SharedMemoryConnector(capacity_bytes=MIB)
        elif system == "mooncake-store":
            from omni_mooncake.store import MooncakeStoreConnector

            self.connector = MooncakeStoreConnector(master=master, capacity_bytes=capacity, buffer_bytes=capacity)
        elif system == "mooncake-te":
            from omni_mooncake.transfer_engine import MooncakeTransferEngineConnector

            self.connector = MooncakeTransferEngineConnector(pool_bytes=MIB, buffer_bytes=capacity)
        elif system == "store raw":
            self.store = _new_store(master, 16 * MIB)
            self.buffer = _registered(self.store.register_buffer, size)
        elif system == "te raw":
            from omni_mooncake.mooncake_bridge import import_transfer_engine

            self.engine = import_transfer_engine()()
            assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            self.buffer = _registered(self.engine.register_memory, size)

    def get(self, handle: Any) -> Any:
        if self.system == "store raw":
            assert self.store.get_into(handle, self.buffer.ctypes.data, self.size) == self.size
            return self.buffer
        if self.system == "te raw":
            session, address = handle
            assert self.engine.transfer_sync_read(session, self.buffer.ctypes.data, address, self.size) == 0
            return self.buffer
        payload = self.connector.get(handle)
        assert payload["tensor"].numel() * 4 == self.size
        return payload

    def release(self, handle: Any) -> None:
        if self.system == "store raw":
            assert self.store.remove(handle, True) == 0
        elif self.system != "te raw":
            self.connector.release(handle)

    def close(self) -> None:
        if hasattr(self, "connector"):
            self.connector.close()
        elif self.system == "store raw":
            self.store.close()


def bench_size(
    size: int, reps: int, systems: list[str], master: str, threads: int, same_process: bool = False
) -> dict[str, dict[str, list[float]]]:
    """Per system, the times (s) of put, get, end to end and release of `reps` transfers."""
    import torch

    context = multiprocessing.get_context("spawn")
    pipes: dict[str, Any] = {}
    children = []
    for system in systems:
        if system == "memcpy":
            continue
        if same_process:
            pipes[system] = InlineProducer(system, size, master)
            continue
        here, there = context.Pipe()
        child = context.Process(target=_produce, args=(system, size, master, threads, there), daemon=True)
        child.start()
        pipes[system] = here
        children.append(child)
    consumers = {system: Consumer(system, size, master) for system in pipes}
    for pipe in pipes.values():
        assert pipe.recv() == "ready"
    source = torch.rand(size // 4)
    target = torch.empty_like(source)
    times = {system: {"put": [], "get": [], "total": [], "release": []} for system in systems}
    try:
        block = SMALL_BLOCK if size < MIB else 1
        for index in range(0, reps + WARMUP * block, block):
            for system in systems:
                for _ in range(block):  # a few back to back: the steady state of one edge
                    if system == "memcpy":
                        started = time.perf_counter()
                        target.copy_(source)
                        done = released = time.perf_counter()
                        put_done = got = started  # a copy is all get
                    else:
                        pipes[system].send(True)
                        started, put_done, handle = pipes[system].recv()
                        got = time.perf_counter()
                        payload = consumers[system].get(handle)
                        done = time.perf_counter()
                        del payload
                        consumers[system].release(handle)
                        released = time.perf_counter()
                    if index >= WARMUP * block:
                        record = times[system]
                        record["put"].append(put_done - started)
                        record["get"].append(done - got)
                        record["total"].append(done - started)
                        record["release"].append(released - done)
    finally:
        for pipe in pipes.values():  # also after a failure: a child waits for this to stop
            try:
                pipe.send(False)
            except OSError:
                pass
        for consumer in consumers.values():
            consumer.close()
        for child in children:
            child.join(60)
    return times


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _size_name(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 64 * 1024])
    parser.add_argument("--reps-small", type=int, default=300, help="transfers per system for sizes under 1 MiB")
    parser.add_argument("--reps-large", type=int, default=12, help="transfers per system for sizes of 1 MiB and more")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    # One thread by default: on a shared CPU a 2-thread copy waits on a descheduled thread and the
    # medians turn into noise; every process uses the same count, so the ratios stay fair.
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every process (0: torch's default)")
    parser.add_argument(
        "--same-process", action=argparse.BooleanOptionalAction, default=True,
        help="also a table with the producer in this process: the connectors' own cost without the wake-ups of a pipe",
    )
    args = parser.parse_args()

    import contextlib

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    needs_master = any(system.startswith(("store", "mooncake-store")) for system in args.systems)
    with contextlib.ExitStack() as stack:
        master = ""
        if needs_master:
            from omni_mooncake.testing import start_master

            master = stack.enter_context(start_master())
        verdicts = []
        for same_process in (False, True) if args.same_process else (False,):
            where = "producer and consumer in this process" if same_process else "producer in a child process, consumer here"
            print(f"\nconnectors vs the raw calls they wrap; {where}; torch threads: {threads}\n")
            print("| size | system | put ms | get ms | end to end ms (p50) | p90 | release ms | GB/s | vs raw call | added (p50) | added (paired) |")
            print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for size_kib in args.sizes_kib:
                size = size_kib * KIB
                reps = args.reps_large if size >= MIB else args.reps_small
                times = bench_size(size, reps, args.systems, master, threads, same_process)
                verdicts += _rows(size, times, "same process" if same_process else "across processes")
        print()
        for verdict in verdicts:
            print(f"- {verdict}")


def paired_added(system: list[float], raw: list[float], block: int) -> float:
    """Median over rounds of (median of `system`'s block - median of `raw`'s block of that round)."""
    rounds = min(len(system), len(raw)) // block
    return statistics.median(
        statistics.median(system[r * block : (r + 1) * block]) - statistics.median(raw[r * block : (r + 1) * block])
        for r in range(rounds)
    )


def _rows(size: int, times: dict[str, dict[str, list[float]]], where: str) -> list[str]:
    """Print one size's rows; return the verdicts on the goals (judged on the plain p50s)."""
    p50 = {system: statistics.median(record["total"]) for system, record in times.items()}
    block = SMALL_BLOCK if size < MIB else 1
    verdicts = []
    for system, record in times.items():
        raw = WRAPS.get(system)
        ratio = added = paired = ""
        if raw in p50:
            ratio = f"{p50[raw] / p50[system]:.2f}x"
            added = f"{(p50[system] - p50[raw]) * 1e6:+.0f} us"
            paired = f"{paired_added(record['total'], times[raw]['total'], block) * 1e6:+.0f} us"
            if system.startswith("mooncake") and size >= MIB:
                met = "met" if p50[raw] / p50[system] >= 0.8 else "MISSED"
                verdicts.append(f"{system}, {_size_name(size)}, {where}: {ratio} of {raw} (goal >= 0.8x): {met}")
            elif system.startswith("mooncake"):
                met = "met" if p50[system] - p50[raw] < 100e-6 else "MISSED"
                verdicts.append(
                    f"{system}, {_size_name(size)}, {where}: adds {added} p50 to {raw} (goal < 100 us): {met}; paired: {paired}"
                )
        print(
            f"| {_size_name(size)} | {system} | {statistics.median(record['put']) * 1e3:.3f} "
            f"| {statistics.median(record['get']) * 1e3:.3f} | {p50[system] * 1e3:.3f} "
            f"| {percentile(record['total'], 0.9) * 1e3:.3f} | {statistics.median(record['release']) * 1e3:.3f} "
            f"| {size / p50[system] / 1e9:.2f} | {ratio} | {added} | {paired} |"
        )
    return verdicts


if __name__ == "__main__":
    main()
