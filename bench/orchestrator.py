"""Orchestrator overhead per stage hop, with pass-through stages (not a test).

Runs one request at a time through linear pass-through pipelines of 1 and K stages and reports the
per-hop overhead ((latency_K - latency_1) / (K - 1)), p50 and p99, for inline (threads) and process
placement. The baselines measured in the same run are the least a hop can cost: for inline, a bare
thread round trip through a `queue.SimpleQueue` and `loop.call_soon_threadsafe`; for process, a bare
pipe round trip between the event loop (a reader callback) and a spawned process echoing bytes.

    python bench/orchestrator.py [--requests 300] [--stages 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from multiprocessing.connection import Connection

from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.testing.fakes import passthrough_pipeline


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def latencies(stages: int, placement: str, n: int) -> list[float]:
    async with AsyncOmniEngine(passthrough_pipeline(stages=stages, placement=placement)) as engine:
        for _ in range(20):  # warm up
            async for _ in engine.generate(OmniRequest(prompt="w")):
                pass
        out = []
        for i in range(n):
            start = time.perf_counter()
            async for _ in engine.generate(OmniRequest(prompt="x")):
                pass
            out.append(time.perf_counter() - start)
        return out


async def thread_round_trip(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def worker() -> None:
        while (item := inbox.get()) is not None:
            loop.call_soon_threadsafe(item.set_result, None)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    out = []
    for _ in range(n + 20):
        future = loop.create_future()
        start = time.perf_counter()
        inbox.put(future)
        await future
        out.append(time.perf_counter() - start)
    inbox.put(None)
    return out[20:]


def _echo(incoming: Connection, outgoing: Connection) -> None:
    while data := os.read(incoming.fileno(), 1 << 16):
        os.write(outgoing.fileno(), data)


async def pipe_round_trip(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    ctx = mp.get_context("spawn")
    child_in, to_child = ctx.Pipe(duplex=False)
    from_child, child_out = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_echo, args=(child_in, child_out), daemon=True)
    process.start()
    child_in.close()
    child_out.close()
    os.set_blocking(from_child.fileno(), False)
    arrived: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        os.read(from_child.fileno(), 1 << 16)
        arrived.set_result(None)

    loop.add_reader(from_child.fileno(), on_readable)
    message = bytes(256)  # about the size of a pickled Submit or Emit
    out = []
    try:
        for _ in range(n + 20):
            arrived = loop.create_future()
            start = time.perf_counter()
            os.write(to_child.fileno(), message)
            await arrived
            out.append(time.perf_counter() - start)
    finally:
        loop.remove_reader(from_child.fileno())
        to_child.close()
        process.join()
        from_child.close()
    return out[20:]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--stages", type=int, default=5)
    args = parser.parse_args()
    k, n = args.stages, args.requests
    baselines = {
        "inline": statistics.median(await thread_round_trip(n)),
        "process": statistics.median(await pipe_round_trip(n)),
    }
    rows = []
    for placement in ("inline", "process"):
        one = await latencies(1, placement, n)
        many = await latencies(k, placement, n)
        hop50 = (statistics.median(many) - statistics.median(one)) / (k - 1)
        hop99 = (percentile(many, 0.99) - percentile(one, 0.99)) / (k - 1)
        rows.append((placement, statistics.median(one), statistics.median(many), hop50, hop99))
    print(f"\nOrchestrator overhead per stage hop ({n} sequential requests, pass-through stages, 1 vs {k} stages)\n")
    print("| placement | request p50, 1 stage (ms) | request p50, %d stages (ms) | per hop p50 (ms) | per hop p99 (ms) | hop / bare round trip |" % k)
    print("|---|---|---|---|---|---|")
    for placement, one, many, hop50, hop99 in rows:
        print(f"| {placement} | {one * 1e3:.3f} | {many * 1e3:.3f} | {hop50 * 1e3:.3f} | {hop99 * 1e3:.3f} | {hop50 / baselines[placement]:.1f}x |")
    print(f"\nbaselines (p50): bare thread round trip (SimpleQueue + call_soon_threadsafe) = {baselines['inline'] * 1e3:.3f} ms, "
          f"bare pipe round trip (event loop <-> spawned process) = {baselines['process'] * 1e3:.3f} ms; goal: per hop p50 < 0.3 ms")


if __name__ == "__main__":
    asyncio.run(main())
