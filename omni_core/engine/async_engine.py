"""`AsyncOmniEngine`: the composition root — stage groups, connectors and the orchestrator."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import attrs

from omni_core.config.resolved import ResolvedPipeline
from omni_core.connectors import create_connector
from omni_core.connectors.base import Connector
from omni_core.engine.inputs import TextPromptProcessor
from omni_core.engine.orchestrator import Orchestrator
from omni_core.engine.params import check_stage_names, check_stage_params, stage_media_params, stage_param_names
from omni_core.engine.request import OmniRequest
from omni_core.errors import OmniError, StageError
from omni_core.outputs import OutputDelta
from omni_core.parts import InputProcessor, PartContext, build_part
from omni_core.refs import load_ref
from omni_core.runtime.shared_models import Colocation, SharedModels
from omni_core.runtime.stage_group import StageGroup

logger = logging.getLogger(__name__)


class AsyncOmniEngine:
    """Runs a `ResolvedPipeline`: start, generate (streamed), abort, health, shutdown.

    Use as ``async with AsyncOmniEngine(pipeline) as engine: ...`` or call `start`/`shutdown`.
    """

    def __init__(self, pipeline: ResolvedPipeline) -> None:
        self.pipeline = pipeline
        self._resolved = pipeline  # as resolved; `pipeline` gets the connectors' shared options at start
        self.groups: dict[str, StageGroup] = {}
        self.orchestrator: Orchestrator | None = None
        self._connectors: list[Connector] = []
        self._sessions: dict[str, Any] = {}  # placement ref -> its `Replica.open_session`
        self._input_processor: InputProcessor | None = None
        # Per stage, where its model declares them, the per-request parameters it takes; known once started.
        self.param_names: dict[str, frozenset[str]] = {}
        # Per stage, its parameters that carry a medium as a URL (a server inlines those the
        # operator allowed as data: URLs); known once started.
        self.media_params: dict[str, frozenset[str]] = {}
        self._started = False
        self._stopping: asyncio.Future[None] | None = None  # the shutdown under way (`shutdown`)

    @classmethod
    def from_model(
        cls,
        model: str,
        deploy: str | Path | None = None,
        overrides: Sequence[str] = (),
        plugins: Any = None,
    ) -> "AsyncOmniEngine":
        """Resolve `model` (a local dir, a hub id in the HF cache or ``omni-tiny/<family>``)."""
        from omni_core.config import resolve

        return cls(resolve(model, deploy=deploy, overrides=overrides, plugins=plugins))

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, timeout: float | None = None) -> None:
        """Start every stage replica and wait until all are ready."""
        if self._started:
            return
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        io_connector = create_connector(self._resolved.output_connector_ref, self._resolved.output_connector_options, "output_connector")
        edge_connectors: dict[str, Connector] = {}
        for stage in self._resolved.stages:
            for edge in stage.inputs:
                edge_connectors[edge.key] = create_connector(edge.connector_ref, edge.connector_options, f"edges.{edge.key}")
        self._connectors = [io_connector, *edge_connectors.values()]
        self.pipeline = _with_shared_options(self._resolved, io_connector, edge_connectors)
        inline_connectors = {"request": io_connector, "output": io_connector, **edge_connectors}
        self.orchestrator = Orchestrator(self.pipeline, self.groups, io_connector, edge_connectors)
        shared_models = SharedModels()  # what inline stages that share a loaded model hand over
        colocation = Colocation()  # process replicas of such stages: in their host's process
        for stage in self.pipeline.stages:
            if stage.placement_ref is not None and stage.placement_ref not in self._sessions:
                self._sessions[stage.placement_ref] = load_ref(stage.placement_ref).open_session(self.pipeline)
            session = self._sessions.get(stage.placement_ref or "")
            self.groups[stage.name] = StageGroup(
                self.pipeline, stage, self._dispatch, loop, inline_connectors, session=session, shared_models=shared_models,
                colocation=colocation,
            )
        self._input_processor = self._build_input_processor()
        self._started = True
        try:
            for group in self.groups.values():
                group.start()
            waits = [group.wait_ready() for group in self.groups.values()]
            # Its tokenizer etc. load while the stages start: not on the first request.
            waits.append(asyncio.to_thread(self._input_processor.load))
            waits.append(self._load_param_names())
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        except BaseException:
            await self.shutdown()
            raise
        logger.info("pipeline %s (%s) ready in %.1f s", self.pipeline.family, self.pipeline.model, time.monotonic() - started)

    async def _load_param_names(self) -> None:
        pipeline = self.pipeline
        self.param_names, self.media_params = await asyncio.to_thread(lambda: (stage_param_names(pipeline), stage_media_params(pipeline)))

    def _build_input_processor(self) -> InputProcessor:
        context = PartContext(self.pipeline)
        if self.pipeline.input_processor is None:
            return TextPromptProcessor(context)
        return build_part(self.pipeline.input_processor, context, InputProcessor, "input processor")

    async def shutdown(self) -> None:
        """Fail in-flight requests, stop every replica and free connectors. A second call while one
        is under way (Ctrl-C while `start` loads: the cancelled start and its caller both stop the
        engine) waits for the same shutdown."""
        if self._started:
            self._started = False
            self._stopping = asyncio.ensure_future(self._stop())
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        try:
            if self.orchestrator is not None:
                self.orchestrator.fail_all(StageError("engine", "the engine is shutting down"))
            await asyncio.gather(*(group.stop() for group in self.groups.values()))
            if self.orchestrator is not None:
                self.orchestrator.close()  # its connector threads, before the connectors they call
            sessions, self._sessions = self._sessions, {}
            for ref, session in sessions.items():
                await load_ref(ref).close_session(session)
            for connector in self._connectors:
                connector.close()
            self._connectors = []
        finally:
            self._stopping = None

    async def __aenter__(self) -> "AsyncOmniEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    def _dispatch(self, stage: str, replica: int, message: Any) -> None:
        if self.orchestrator is not None:
            self.orchestrator.on_message(stage, replica, message)

    # -- requests --------------------------------------------------------------------------------

    async def submit(self, request: OmniRequest) -> AsyncIterator[OutputDelta]:
        """Validate and start `request`; return the iterator of its output deltas.

        Bad input raises `InvalidRequestError` here, before anything runs (so a server can answer
        4xx before it starts a stream). Closing the iterator early aborts the request.
        """
        if not self._started or self.orchestrator is None or self._input_processor is None:
            raise OmniError("the engine is not started: call `await engine.start()` first")
        check_stage_names(request.params, [s.name for s in self.pipeline.stages])
        state = self.orchestrator.plan(request)
        check_stage_params(request.params, self.param_names, {s.name: s.kind for s in self.pipeline.stages})
        request.task = state.task  # the input processor builds that task's entry inputs
        stage_inputs = await asyncio.to_thread(self._input_processor.process, request)
        await self.orchestrator.submit(state, stage_inputs)
        return self.orchestrator.stream(request.request_id)

    async def generate(self, request: OmniRequest) -> AsyncIterator[OutputDelta]:
        """Run `request`; yield its output deltas as stages produce them, in order per stage.

        Raises `InvalidRequestError` for bad input, `StageError` if a stage fails it, and
        `RequestCancelledError` if it is aborted. Closing the iterator early aborts the request.
        """
        stream = await self.submit(request)
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Cancel a request in every stage (no-op if it is unknown or finished)."""
        if self.orchestrator is not None:
            self.orchestrator.abort(request_id)

    async def health(self) -> list[dict[str, Any]]:
        """One entry per replica: healthy, ready, active requests, restarts."""
        reports = await asyncio.gather(*(group.health() for group in self.groups.values()))
        return [entry for report in reports for entry in report]

    @property
    def num_active_requests(self) -> int:
        return 0 if self.orchestrator is None else len(self.orchestrator.requests)


def _with_shared_options(pipeline: ResolvedPipeline, io: Connector, edges: dict[str, Connector]) -> ResolvedPipeline:
    """`pipeline` with each connector's options replaced by what the engine's instance shares
    (`Connector.shared_options`): what every stage worker builds its own instance from."""
    stages = tuple(
        attrs.evolve(stage, inputs=tuple(attrs.evolve(e, connector_options=edges[e.key].shared_options()) for e in stage.inputs))
        for stage in pipeline.stages
    )
    return attrs.evolve(pipeline, stages=stages, output_connector_options=io.shared_options())
