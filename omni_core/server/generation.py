"""Running one request for a route: timing for metrics, cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AsyncIterator

import attrs

from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.engine.result import OmniResult
from omni_core.errors import RequestCancelledError
from omni_core.outputs import OutputDelta
from omni_core.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from litestar.types import Receive


@attrs.define
class Tracked:
    """A request's stream with the timings the metrics need."""

    request: OmniRequest
    stream: AsyncIterator[OutputDelta]
    metrics: ServerMetrics
    result: OmniResult
    start: float = attrs.field(factory=time.monotonic)
    ttft: float | None = None
    ttfp: float | None = None
    done: bool = False

    @classmethod
    async def start_request(cls, engine: AsyncOmniEngine, request: OmniRequest, metrics: ServerMetrics) -> "Tracked":
        start = time.monotonic()
        stream = await engine.submit(request)
        return cls(request, stream, metrics, OmniResult(request.request_id), start)

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        """Yield deltas, accumulating the result; closing early cancels the request everywhere."""
        failed = False
        try:
            async for delta in self.stream:
                now = time.monotonic() - self.start
                if delta.modality == "text" and self.ttft is None and delta.data.get("token_ids"):
                    self.ttft = now
                if delta.modality == "audio" and self.ttfp is None and delta.data.get("audio") is not None:
                    self.ttfp = now
                self.result.add(delta)
                yield delta
            self.done = True
            self.metrics.observe(self.ttft, self.ttfp, time.monotonic() - self.start, len(self.result.token_ids), self.result.audio_duration)
        except (GeneratorExit, asyncio.CancelledError, RequestCancelledError):
            raise
        except BaseException:
            failed = True
            raise
        finally:
            if not self.done:
                await self.stream.aclose()  # aborts the request in every stage
                if not failed:
                    self.metrics.cancelled.inc()

    async def open_stream(self) -> AsyncIterator[OutputDelta]:
        """`deltas()`, once the first delta is in: a request that a stage rejects (prompt too long,
        unsupported input) raises here, so a streaming route still answers with an HTTP error
        instead of a 200 stream that carries it."""
        deltas = self.deltas()
        try:
            first = await deltas.__anext__()
        except StopAsyncIteration:
            return _replay(None, deltas)
        except BaseException:
            await deltas.aclose()
            raise
        return _replay(first, deltas)

    async def run(self) -> OmniResult:
        async for _ in self.deltas():
            pass
        return self.result

    async def run_while_connected(self, receive: Receive) -> OmniResult:
        """`run()` for a route that answers once at the end: if the client goes away first, the
        request is cancelled in every stage (as a closed stream is) instead of running to its end
        for nobody. Once the body is read, the ASGI ``receive`` returns only at the disconnect."""
        return (await run_while_connected([self], receive))[0]


async def run_while_connected(batch: list[Tracked], receive: Receive) -> list[OmniResult]:
    """`Tracked.run` of each request of one HTTP request (a completions batch), together: the client
    going away, or one of them failing, cancels the others in every stage."""
    work = [asyncio.ensure_future(tracked.run()) for tracked in batch]
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        pending = set(work)
        while pending and not gone.done():
            done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(gone)
            if any(not task.cancelled() and task.exception() is not None for task in done if task is not gone):
                break
    finally:
        unfinished = [task for task in work if not task.done()]
        for task in unfinished:
            task.cancel()  # the client left, a sibling failed (or this handler was cancelled): abort
        await asyncio.gather(*unfinished, return_exceptions=True)
        gone.cancel()
    for task in work:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    if any(task.cancelled() for task in work):
        raise RequestCancelledError(f"request {batch[0].request.request_id}: the client disconnected")
    return [task.result() for task in work]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _replay(first: OutputDelta | None, rest: AsyncIterator[OutputDelta]) -> AsyncIterator[OutputDelta]:
    try:
        if first is not None:
            yield first
        async for delta in rest:
            yield delta
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
