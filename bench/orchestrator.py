"""Orchestrator overhead per stage hop, with pass-through stages (not a test).

Runs one request at a time through linear pass-through pipelines of 1 and K stages and reports the
per-hop overhead ((latency_K - latency_1) / (K - 1)), p50 and p99, for inline (threads) and process
placement. The baseline measured in the same run is a bare thread round trip through a
`queue.SimpleQueue` and `loop.call_soon_threadsafe` (the least any inline hop must cost).

    python bench/orchestrator.py [--requests 300] [--stages 5]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import statistics
import threading
import time

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


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--stages", type=int, default=5)
    args = parser.parse_args()
    k, n = args.stages, args.requests
    baseline = statistics.median(await thread_round_trip(n))
    rows = []
    for placement in ("inline", "process"):
        one = await latencies(1, placement, n)
        many = await latencies(k, placement, n)
        hop50 = (statistics.median(many) - statistics.median(one)) / (k - 1)
        hop99 = (percentile(many, 0.99) - percentile(one, 0.99)) / (k - 1)
        rows.append((placement, statistics.median(one), statistics.median(many), hop50, hop99))
    print(f"\nOrchestrator overhead per stage hop ({n} sequential requests, pass-through stages, 1 vs {k} stages)\n")
    print("| placement | request p50, 1 stage (ms) | request p50, %d stages (ms) | per hop p50 (ms) | per hop p99 (ms) | hop / bare thread round trip |" % k)
    print("|---|---|---|---|---|---|")
    for placement, one, many, hop50, hop99 in rows:
        print(f"| {placement} | {one * 1e3:.3f} | {many * 1e3:.3f} | {hop50 * 1e3:.3f} | {hop99 * 1e3:.3f} | {hop50 / baseline:.1f}x |")
    print(f"\nbaseline: bare thread round trip (SimpleQueue + call_soon_threadsafe) p50 = {baseline * 1e3:.3f} ms; goal: per hop p50 < 0.3 ms")


if __name__ == "__main__":
    asyncio.run(main())
