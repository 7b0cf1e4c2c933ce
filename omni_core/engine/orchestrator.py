"""The orchestrator: per-request state and routing of chunks between stage groups.

Everything here runs on the engine's event loop and reacts to worker messages (which the replicas
deliver on the loop): no polling. Tensors are not touched on the way through: edge
chunks are forwarded as connector handles; only user-facing outputs are read here.

Connector calls are the exception: they may block (a bounded connector's `put` waits for room, a
network connector's `get` for the wire), so none runs on the loop, which must keep serving every
other request and `/health`. They run on the orchestrator's own threads (see `Orchestrator`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.config.tasks import TASK_PARAM, choose_task, entry_stages, task_name
from omni_core.connectors.base import Connector
from omni_core.engine.params import merge_params
from omni_core.engine.request import OmniRequest
from omni_core.errors import ConnectorError, InvalidRequestError, OmniError, RequestCancelledError, StageError
from omni_core.outputs import OutputDelta, Payload, StageInput
from omni_core.runtime import messages as m
from omni_core.runtime.stage_group import StageGroup

logger = logging.getLogger(__name__)

_END = object()
_CONNECTOR_THREADS = 4  # per pool; a call blocks one thread (a full bounded connector: until its timeout)
CRASH_GRACE_S = 3.0
"""How long a failed output read waits for its producer's crash to be reported. A replica that
dies takes the chunks it held with it (a Mooncake segment, a remote pool), and the read of one
may fail before the replica's end is seen (a Ray actor's: within about a second, then its last
messages are drained). The request then fails with the crash, its cause, not the lost chunk; a
read that fails for another reason fails its request this much later."""


@attrs.define
class RequestState:
    """What the orchestrator knows about one in-flight request."""

    request: OmniRequest
    active: tuple[str, ...]
    modalities: tuple[str, ...]
    routes: dict[str, tuple[tuple[str, ...], bool]]
    pending_finals: dict[str, int]
    entries: tuple[str, ...] = ()  # active stages fed by the request's input, not by another active stage
    task: str | None = None
    queue: asyncio.Queue[Any] = attrs.field(factory=asyncio.Queue)
    started: set[str] = attrs.field(factory=set)
    param_overlays: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    finished: bool = False
    arrival: float = attrs.field(factory=time.monotonic)
    first_output: dict[str, float] = attrs.field(factory=dict)
    finish_time: float | None = None
    error: BaseException | None = None
    failed: asyncio.Event = attrs.field(factory=asyncio.Event)  # set with `error`


@attrs.frozen
class PendingDelta:
    """A user-facing chunk whose data a get thread is reading off the output connector.

    It takes the chunk's place in the request's queue, so `Orchestrator.stream` yields deltas in
    the order the chunks came, however long each read takes.
    """

    read: asyncio.Future[Payload]
    stage: str
    modality: str
    index: int
    final: bool


def active_stages(pipeline: ResolvedPipeline, modalities: tuple[str, ...]) -> tuple[str, ...]:
    """Stages producing the wanted modalities and all their ancestors, in pipeline order."""
    wanted = {s.name for s in pipeline.stages if any(out in modalities for out in s.outputs)}
    frontier = list(wanted)
    while frontier:
        stage = pipeline.stage(frontier.pop())
        for edge in stage.inputs:
            if edge.source not in wanted:
                wanted.add(edge.source)
                frontier.append(edge.source)
    return tuple(s.name for s in pipeline.stages if s.name in wanted)


class Orchestrator:
    """Routes one pipeline's requests through its stage groups.

    Connector calls run on two small thread pools of its own, never on the event loop: one for
    `put`, one for `get` and `release`. Not asyncio's default executor, which a put blocked for
    its whole timeout on a full connector would starve (the input processor runs there); and two,
    so that puts waiting for room never hold up the gets and releases that make it. `close` stops
    them when the engine shuts down.
    """

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        groups: dict[str, StageGroup],
        io_connector: Connector,
        edge_connectors: dict[str, Connector],
    ) -> None:
        self.pipeline = pipeline
        self.groups = groups
        self.io_connector = io_connector
        self.edge_connectors = edge_connectors
        self.requests: dict[str, RequestState] = {}
        self._puts = ThreadPoolExecutor(_CONNECTOR_THREADS, thread_name_prefix="omni-connector-put")
        self._reads = ThreadPoolExecutor(_CONNECTOR_THREADS, thread_name_prefix="omni-connector-get")
        self._closed = False

    # -- requests --------------------------------------------------------------------------------

    def plan(self, request: OmniRequest) -> RequestState:
        """Validate the wanted modalities (and task) and work out which stages run and where
        outputs go. A pipeline with tasks runs the request's task (`omni_core.config.tasks`), one
        without runs the stages producing the wanted modalities and their ancestors."""
        task = None
        if self.pipeline.tasks:
            stages = {s.name: s for s in self.pipeline.stages}
            name = task_name(request.task, request.params)
            chosen, modalities = choose_task(self.pipeline.tasks, stages, name, request.modalities, self.pipeline.default_modalities)
            task = chosen.name
            active = tuple(s.name for s in self.pipeline.stages if s.name in chosen.stages)
            # The task was a routing choice, not a parameter of the stage that carried it.
            request.params = {k: {p: v for p, v in ps.items() if p != TASK_PARAM} for k, ps in request.params.items()}
        else:
            if request.task is not None:
                raise InvalidRequestError(
                    f"this model ({self.pipeline.family}) has no tasks to choose from; leave task out", param=TASK_PARAM
                )
            produced = self.pipeline.modalities
            modalities = tuple(request.modalities or self.pipeline.default_modalities)
            unknown = [mod for mod in modalities if mod not in produced]
            if unknown:
                raise InvalidRequestError(
                    f"this model does not produce {', '.join(unknown)}; it produces {', '.join(produced)}", param="modalities"
                )
            active = active_stages(self.pipeline, modalities)
        routes: dict[str, tuple[tuple[str, ...], bool]] = {}
        pending: dict[str, int] = {}
        for name in active:
            targets = tuple(e.target for e in self.pipeline.downstream(name) if e.target in active)
            stage = self.pipeline.stage(name)
            emit_output = any(out in modalities for out in stage.outputs) or not targets
            routes[name] = (targets, emit_output)
            pending[name] = len(targets) + int(emit_output)
        entries = entry_stages(self.pipeline.stages, active)
        return RequestState(request, active, tuple(modalities), routes, pending, entries=entries, task=task)

    async def submit(self, state: RequestState, stage_inputs: dict[str, StageInput]) -> None:
        """Start a planned request with the input processor's stage inputs.

        Entry stages (`RequestState.entries`) get their input (put on the output connector, off the
        loop, before their `Submit` goes out); for a stage fed by other stages of the request only
        the `params` of its `StageInput` are used (merged over the request's parameters for it,
        e.g. a chosen voice). A caller cancelled meanwhile leaves nothing behind: the request is aborted and forgotten, and a
        handle whose put was under way is released when the put ends.
        """
        request_id = state.request.request_id
        if self._closed:
            raise StageError("engine", "the engine is shutting down")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.requests[request_id] = state
        try:
            for name, stage_input in stage_inputs.items():
                if name not in state.active:
                    continue
                if name not in state.entries:
                    state.param_overlays[name] = dict(stage_input.params)
                    continue
                handle = await self._put(self.io_connector, {"data": stage_input.data, "params": stage_input.params})
                if state.finished:  # aborted or failed while the put ran: no stage will get it
                    self._release(self.io_connector, handle)
                    return
                self._send(state, name, "request", 0, stage_input.final, handle)
        except OmniError as exc:
            self.fail(request_id, exc)
        except BaseException:  # nobody will stream this request: free what it started
            self.abort(request_id)
            self.requests.pop(request_id, None)
            raise

    async def _put(self, connector: Connector, payload: Payload) -> Any:
        """``connector.put(payload)`` on a put thread; if the caller is cancelled meanwhile, the
        handle is released when the put ends (shielded: a thread cannot be interrupted)."""
        put = asyncio.get_running_loop().run_in_executor(self._puts, connector.put, payload)
        try:
            return await asyncio.shield(put)
        except asyncio.CancelledError:
            put.add_done_callback(functools.partial(self._release_put, connector))
            raise

    def _release_put(self, connector: Connector, put: asyncio.Future[Any]) -> None:
        if not put.cancelled() and put.exception() is None:
            self._release(connector, put.result())

    def _send(self, state: RequestState, stage_name: str, source: str, index: int, final: bool, handle: Any) -> None:
        request = state.request
        first = stage_name not in state.started
        params = None
        targets: tuple[str, ...] = ()
        emit_output = False
        if first:
            state.started.add(stage_name)
            stage = self.pipeline.stage(stage_name)
            params = merge_params(stage.params, request.params.get(stage_name)) | state.param_overlays.get(stage_name, {})
            targets, emit_output = state.routes[stage_name]
        submit = m.Submit(request.request_id, source, index, final, handle, params, targets, emit_output)
        self.groups[stage_name].send(request.request_id, submit)

    async def stream(self, request_id: str) -> Any:
        """Yield the request's `OutputDelta`s in order; raise its error if it fails."""
        state = self.requests[request_id]
        try:
            while True:
                item = await state.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, PendingDelta):
                    item = await self._delta(state, item)
                yield item
        finally:
            if not state.finished:  # the consumer stopped early (client gone): free the work
                self.abort(request_id)
            self.requests.pop(request_id, None)

    @staticmethod
    async def _delta(state: RequestState, pending: PendingDelta) -> OutputDelta:
        """The delta once its data is read; a failed read raises the request's error (that read's,
        or an earlier failure's: the first cause, not a connector closed by the shutdown it caused)."""
        try:
            # Shielded: a consumer cancelled here must not cancel a read whose thread has not
            # started, which would then never release its handle.
            data = await asyncio.shield(pending.read)
        except Exception as exc:  # noqa: BLE001 - the read's error, whatever it is, fails this request
            if state.error is None and isinstance(exc, ConnectorError):
                # A lost chunk: its producer may have crashed (`_on_read` fails the request later).
                try:
                    await asyncio.wait_for(state.failed.wait(), CRASH_GRACE_S + 1.0)
                except asyncio.TimeoutError:
                    pass
            raise (state.error if state.error is not None else exc)
        return OutputDelta(state.request.request_id, pending.stage, pending.modality, pending.index, data, pending.final)

    def abort(self, request_id: str, reason: str = "request cancelled") -> None:
        """Cancel a request in every stage it reached."""
        self.fail(request_id, RequestCancelledError(reason))

    def fail(self, request_id: str, error: BaseException) -> None:
        """Fail an unfinished request with `error`: abort it in its stages and queue the error."""
        state = self.requests.get(request_id)
        if state is not None:
            self._fail(state, error)

    def _fail(self, state: RequestState, error: BaseException) -> None:
        if state.finished:
            return
        request_id = state.request.request_id
        state.finished = True
        state.finish_time = time.monotonic()
        state.error = error
        state.failed.set()
        for name in state.active:
            self.groups[name].release(request_id, abort=True)
        state.queue.put_nowait(error)

    # -- worker messages -------------------------------------------------------------------------

    def on_message(self, stage_name: str, replica: int, message: Any) -> None:
        if isinstance(message, m.Emit):
            self._on_emit(stage_name, message)
        elif isinstance(message, m.RequestFailed):
            error: OmniError = (
                InvalidRequestError(message.message, param=message.param) if message.invalid else StageError(stage_name, message.message)
            )
            self.fail(message.request_id, error)
        elif isinstance(message, m.StageFailed):
            for request_id in message.request_ids:
                self.fail(request_id, StageError(stage_name, message.message))
        elif message is None:
            group = self.groups[stage_name]
            for request_id in group.requests_on(replica):
                self.fail(request_id, StageError(stage_name, group.crash_message(replica)))

    def _on_emit(self, stage_name: str, emit: m.Emit) -> None:
        state = self.requests.get(emit.request_id)
        if state is None or state.finished:
            self._drop(stage_name, emit)
            return
        try:
            if emit.target is None:
                self._deliver(state, stage_name, emit)
            else:
                self._send(state, emit.target, stage_name, emit.index, emit.final, emit.handle)
        except OmniError as exc:
            self.fail(emit.request_id, exc)
            return
        if emit.final:
            state.pending_finals[stage_name] -= 1
            if state.pending_finals[stage_name] == 0:
                self.groups[stage_name].release(emit.request_id, abort=False)
                if all(n == 0 for n in state.pending_finals.values()):
                    state.finished = True
                    state.finish_time = time.monotonic()
                    state.queue.put_nowait(_END)

    def _deliver(self, state: RequestState, stage_name: str, emit: m.Emit) -> None:
        """Queue a user-facing chunk: a get thread reads its data (`_read_output`) meanwhile."""
        stage: ResolvedStage = self.pipeline.stage(stage_name)
        modality = stage.output or "none"
        read = asyncio.get_running_loop().run_in_executor(self._reads, self._read_output, emit.handle)
        read.add_done_callback(functools.partial(self._on_read, state, modality))
        state.queue.put_nowait(PendingDelta(read, stage_name, modality, emit.index, emit.final))

    def _read_output(self, handle: Any) -> Payload:
        """On a get thread: the chunk's data, copied out of connector storage, which is then freed
        (always: a request that failed meanwhile leaks nothing)."""
        try:
            try:
                return _own(self.io_connector.get(handle))
            finally:
                self.io_connector.release(handle)
        except OmniError:
            raise
        except Exception as exc:  # a plugin's connector: fail the request with what went wrong
            raise ConnectorError(f"the output connector could not read a chunk: {type(exc).__name__}: {exc}") from exc

    def _on_read(self, state: RequestState, modality: str, read: asyncio.Future[Payload]) -> None:
        """On the loop, when a read ends: a failed read fails its request (only that one, not when
        its consumer gets there; a lost chunk after `CRASH_GRACE_S`, so a crash of its producer
        reported meanwhile is the error); the first read records when the modality's data came."""
        if read.cancelled():
            return
        error = read.exception()
        if isinstance(error, ConnectorError):
            asyncio.get_running_loop().call_later(CRASH_GRACE_S, self._fail, state, error)  # unless a crash came first
        elif error is not None:
            self._fail(state, error)
        else:
            state.first_output.setdefault(modality, time.monotonic())

    def _drop(self, stage_name: str, emit: m.Emit) -> None:
        """Free the storage of a chunk whose request is gone."""
        connector = self.io_connector if emit.target is None else self.edge_connectors[f"{stage_name}->{emit.target}"]
        self._release(connector, emit.handle)

    def _release(self, connector: Connector, handle: Any) -> None:
        """Free `handle` on a get thread, quietly: its request is gone, nobody awaits the outcome."""
        if self._closed:
            return  # the engine closes every connector next, which frees it
        self._reads.submit(_release_quietly, connector, handle)

    def close(self) -> None:
        """Take no more connector calls. Calls under way end on their own: the engine closes the
        connectors next, which wakes a put still waiting for room."""
        self._closed = True
        self._puts.shutdown(wait=False)
        self._reads.shutdown(wait=False)

    def fail_all(self, error: BaseException) -> None:
        for request_id in list(self.requests):
            self.fail(request_id, error)


def _release_quietly(connector: Connector, handle: Any) -> None:
    try:
        connector.release(handle)
    except Exception:  # a late chunk of a crashed worker may point at a gone pool
        logger.debug("could not release a dropped chunk's handle %r", handle, exc_info=True)


def _own(value: Any) -> Any:
    """Copy zero-copy views out of connector storage before it is released."""
    if isinstance(value, dict):
        return {k: _own(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_own(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_own(v) for v in value)
    if hasattr(value, "clone") and hasattr(value, "dtype"):  # torch.Tensor
        return value.clone()
    if hasattr(value, "copy") and hasattr(value, "dtype"):  # numpy.ndarray
        return value.copy()
    return value
