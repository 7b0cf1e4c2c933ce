"""The orchestrator: per-request state and routing of chunks between stage groups.

Everything here runs on the engine's event loop and reacts to worker messages (which the replicas
deliver on the loop): no polling. Tensors are not touched on the way through: edge
chunks are forwarded as connector handles; only user-facing outputs are read here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import attrs

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.connectors.base import Connector
from omni_core.engine.params import merge_params
from omni_core.engine.request import OmniRequest
from omni_core.errors import InvalidRequestError, OmniError, RequestCancelledError, StageError
from omni_core.outputs import OutputDelta, StageInput
from omni_core.runtime import messages as m
from omni_core.runtime.stage_group import StageGroup

logger = logging.getLogger(__name__)

_END = object()


@attrs.define
class RequestState:
    """What the orchestrator knows about one in-flight request."""

    request: OmniRequest
    active: tuple[str, ...]
    modalities: tuple[str, ...]
    routes: dict[str, tuple[tuple[str, ...], bool]]
    pending_finals: dict[str, int]
    queue: asyncio.Queue[Any] = attrs.field(factory=asyncio.Queue)
    started: set[str] = attrs.field(factory=set)
    param_overlays: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    finished: bool = False
    arrival: float = attrs.field(factory=time.monotonic)
    first_output: dict[str, float] = attrs.field(factory=dict)
    finish_time: float | None = None


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
    """Routes one pipeline's requests through its stage groups."""

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

    # -- requests --------------------------------------------------------------------------------

    def plan(self, request: OmniRequest) -> RequestState:
        """Validate the wanted modalities and work out which stages run and where outputs go."""
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
        return RequestState(request, active, modalities, routes, pending)

    def submit(self, state: RequestState, stage_inputs: dict[str, StageInput]) -> None:
        """Start a planned request with the input processor's stage inputs.

        Entry stages get their input; for a stage fed by other stages only the `params` of its
        `StageInput` are used (merged over the request's parameters for it, e.g. a chosen voice).
        """
        request_id = state.request.request_id
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.requests[request_id] = state
        try:
            for name, stage_input in stage_inputs.items():
                if name not in state.active:
                    continue
                if self.pipeline.stage(name).inputs:
                    state.param_overlays[name] = dict(stage_input.params)
                    continue
                handle = self.io_connector.put({"data": stage_input.data, "params": stage_input.params})
                self._send(state, name, "request", 0, stage_input.final, handle)
        except OmniError as exc:
            self.fail(request_id, exc)

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
                yield item
        finally:
            if not state.finished:  # the consumer stopped early (client gone): free the work
                self.abort(request_id)
            self.requests.pop(request_id, None)

    def abort(self, request_id: str, reason: str = "request cancelled") -> None:
        """Cancel a request in every stage it reached."""
        self.fail(request_id, RequestCancelledError(reason))

    def fail(self, request_id: str, error: BaseException) -> None:
        state = self.requests.get(request_id)
        if state is None or state.finished:
            return
        state.finished = True
        state.finish_time = time.monotonic()
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
                self.fail(request_id, StageError(stage_name, f"replica {replica} crashed; see the log"))

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
        try:
            data = _own(self.io_connector.get(emit.handle))
        finally:
            self.io_connector.release(emit.handle)
        stage: ResolvedStage = self.pipeline.stage(stage_name)
        modality = stage.output or "none"
        state.first_output.setdefault(modality, time.monotonic())
        state.queue.put_nowait(OutputDelta(state.request.request_id, stage_name, modality, emit.index, data, emit.final))

    def _drop(self, stage_name: str, emit: m.Emit) -> None:
        """Free the storage of a chunk whose request is gone."""
        connector = self.io_connector if emit.target is None else self.edge_connectors[f"{stage_name}->{emit.target}"]
        try:
            connector.release(emit.handle)
        except Exception:  # a late chunk of a crashed worker may point at a gone pool
            logger.debug("could not release a dropped chunk of %s", emit.request_id, exc_info=True)

    def fail_all(self, error: BaseException) -> None:
        for request_id in list(self.requests):
            self.fail(request_id, error)


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
