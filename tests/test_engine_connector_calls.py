"""The engine never calls a connector on its event loop, and keeps its guarantees while the calls
take long: deltas in order, a failed read fails only its request, nothing leaks when a request
ends while a call is under way. On pass-through stages with `SlowConnector` as the output
connector (slow in this process only: the engine's). The server-level check (``/health`` answers
while a request's put sleeps) is in test_server_connector_calls.py."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import attrs
import pytest

from omni_core.config.resolved import ResolvedPipeline
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.engine.orchestrator import CRASH_GRACE_S
from omni_core.errors import ConnectorError, RequestCancelledError, StageError
from omni_core.testing.fakes import SlowConnector, passthrough_pipeline

pytestmark = pytest.mark.timeout(120)


def slow_output(pipeline: ResolvedPipeline, **options: Any) -> ResolvedPipeline:
    """`pipeline` with a `SlowConnector` around its output connector, slow in this process."""
    inner = pipeline.output_connector
    return attrs.evolve(
        pipeline,
        output_connector="slow",
        output_connector_ref="omni_core.testing.fakes:SlowConnector",
        output_connector_options={"inner": inner, "slow_pid": os.getpid(), **options},
    )


def io_connector(engine: AsyncOmniEngine) -> SlowConnector:
    assert engine.orchestrator is not None
    connector = engine.orchestrator.io_connector
    assert isinstance(connector, SlowConnector)
    return connector


async def largest_loop_stall(work: Any) -> tuple[Any, float]:
    """Run `work` while a ticker measures the event loop's longest stall (seconds)."""
    stalls = [0.0]

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            stalls.append(now - last - 0.005)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        result = await work
    finally:
        ticker.cancel()
    return result, max(stalls)


async def collect(engine: AsyncOmniEngine, request: OmniRequest) -> list:
    return [delta async for delta in engine.generate(request)]


async def test_slow_puts_and_gets_leave_the_loop_free() -> None:
    pipeline = slow_output(passthrough_pipeline(stages=2, placement="process"), put_delay_s=0.5, get_delays_s=[0.5])
    async with AsyncOmniEngine(pipeline) as engine:
        request = OmniRequest(prompt="slow", params={"s1": {"repeat": 2}})
        started = time.monotonic()
        deltas, stall = await largest_loop_stall(collect(engine, request))
        assert time.monotonic() - started >= 1.0  # the put and a get did sleep
        assert [d.data["s1"] for d in deltas] == [0, 1]
        assert stall < 0.1, f"the event loop stalled {stall:.3f} s behind a connector call"


async def test_deltas_keep_their_order_when_later_reads_finish_first() -> None:
    # The first read sleeps longest: on the get threads, later chunks are read before it.
    pipeline = slow_output(passthrough_pipeline(stages=1, placement="process"), get_delays_s=[0.3, 0.0, 0.2, 0.0, 0.1])
    async with AsyncOmniEngine(pipeline) as engine:
        deltas = await collect(engine, OmniRequest(prompt="x", params={"s0": {"repeat": 5}}))
        assert [d.index for d in deltas] == [0, 1, 2, 3, 4]
        assert [d.data["s0"] for d in deltas] == [0, 1, 2, 3, 4]
        assert [d.final for d in deltas] == [False] * 4 + [True]
        assert engine.num_active_requests == 0


async def test_a_failing_read_fails_only_its_request_and_frees_its_storage() -> None:
    pipeline = slow_output(passthrough_pipeline(stages=2, placement="inline"), inner="inproc", fail_get_prompt="bad")
    async with AsyncOmniEngine(pipeline) as engine:
        bad = OmniRequest(prompt="bad", params={"s1": {"repeat": 3}})
        good = [OmniRequest(prompt=f"ok{i}", params={"s1": {"repeat": 3}}) for i in range(4)]
        results = await asyncio.gather(collect(engine, bad), *(collect(engine, r) for r in good), return_exceptions=True)
        assert isinstance(results[0], ConnectorError) and "on purpose" in str(results[0])
        assert all(isinstance(r, list) and [d.data["prompt"] for d in r] == [f"ok{i}"] * 3 for i, r in enumerate(results[1:]))
        await until(lambda: io_connector(engine).outstanding() == 0)
        health = await engine.health()
        assert all(h["active_requests"] == 0 for h in health), health
        assert engine.num_active_requests == 0


async def test_a_chunk_lost_with_its_crashed_producer_fails_the_request_with_the_crash() -> None:
    # The read of the chunk fails at once; the crash that took it is reported a step later.
    pipeline = slow_output(passthrough_pipeline(stages=1, placement="process"), fail_get_prompt="lost")
    async with AsyncOmniEngine(pipeline) as engine:
        started = time.monotonic()
        with pytest.raises(StageError, match="'s0' failed: replica 0 crashed"):
            await collect(engine, OmniRequest(prompt="lost", params={"s0": {"fail": "emit_then_crash"}}))
        assert time.monotonic() - started < CRASH_GRACE_S  # the crash's report ended the wait
        deadline = time.monotonic() + 60
        while not all(entry["ready"] for entry in await engine.health()):  # restarted
            assert time.monotonic() < deadline, await engine.health()
            await asyncio.sleep(0.05)
        # A read that fails for another reason still fails its request, `CRASH_GRACE_S` later.
        started = time.monotonic()
        with pytest.raises(ConnectorError, match="on purpose"):
            await collect(engine, OmniRequest(prompt="lost"))
        assert CRASH_GRACE_S <= time.monotonic() - started < CRASH_GRACE_S + 5


async def test_abort_while_the_input_put_is_under_way_leaks_nothing() -> None:
    pipeline = slow_output(passthrough_pipeline(stages=2, placement="inline"), inner="inproc", put_delay_s=0.5)
    async with AsyncOmniEngine(pipeline) as engine:
        request = OmniRequest(prompt="gone")
        submit = asyncio.create_task(engine.submit(request))
        await until(lambda: engine.num_active_requests == 1)  # inside its put
        engine.abort(request.request_id)
        stream = await submit
        with pytest.raises(RequestCancelledError):
            async for _ in stream:
                pass
        await until(lambda: io_connector(engine).outstanding() == 0)  # the late handle was released
        assert engine.num_active_requests == 0
        assert all(h["active_requests"] == 0 for h in await engine.health())
        assert (await collect(engine, OmniRequest(prompt="after")))[-1].data["prompt"] == "after"


async def test_a_caller_cancelled_during_the_put_leaves_nothing_behind() -> None:
    pipeline = slow_output(passthrough_pipeline(stages=2, placement="inline"), inner="inproc", put_delay_s=0.5)
    async with AsyncOmniEngine(pipeline) as engine:
        submit = asyncio.create_task(engine.submit(OmniRequest(prompt="gone")))
        await until(lambda: engine.num_active_requests == 1)
        submit.cancel()  # a client that disconnected before its stream began
        with pytest.raises(asyncio.CancelledError):
            await submit
        assert engine.num_active_requests == 0
        await until(lambda: io_connector(engine).outstanding() == 0)
        assert all(h["active_requests"] == 0 for h in await engine.health())


async def test_a_consumer_that_leaves_during_a_slow_read_leaks_nothing() -> None:
    pipeline = slow_output(passthrough_pipeline(stages=1, placement="inline"), inner="inproc", get_delays_s=[0.3])
    async with AsyncOmniEngine(pipeline) as engine:
        stream = await engine.submit(OmniRequest(prompt="x", params={"s0": {"repeat": 4}}))
        first = await stream.__anext__()
        assert first.index == 0
        await stream.aclose()  # reads of the later chunks are under way or queued
        await until(lambda: io_connector(engine).outstanding() == 0)
        assert engine.num_active_requests == 0


async def until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        await asyncio.sleep(0.01)
