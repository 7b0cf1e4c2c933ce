"""The stage worker loop: feeds a `StageRuntime`, steps it while it has work, routes its chunks.

The same loop runs in a thread (``inline`` placement) and in a spawned process (``process``). It
blocks on its inbox when the runtime is idle (no polling) and drains the inbox between steps, so new
requests join the running batch at the next step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import traceback
from typing import Any, Callable, Protocol

import attrs

from omni_core.config.resolved import ResolvedEdge, ResolvedPipeline, ResolvedStage
from omni_core.connectors.base import Connector
from omni_core.errors import InvalidRequestError, StageError
from omni_core.outputs import Chunk, StageInput
from omni_core.parts import EdgeAdapter, OutputAdapter, PartContext, PassThroughAdapter, build_part
from omni_core.refs import load_ref
from omni_core.runtime import messages as m
from omni_core.runtime.allocator import running_allocator
from omni_core.runtime.replica import KERNEL_CACHE_ENV
from omni_core.runtime.shared_models import SharedModels
from omni_core.stages.base import StageRuntime

logger = logging.getLogger(__name__)

REQUEST_SOURCE = "request"


class Inbox(Protocol):
    """Where a worker's messages come from: a `queue.SimpleQueue` (inline) or a `WorkerChannel`.

    `get(block=False)` raises `queue.Empty` when no message is there; `EOFError` or `OSError`
    means the engine is gone.
    """

    def get(self, block: bool = True) -> Any: ...


@attrs.define
class _RequestState:
    targets: tuple[str, ...]
    emit_output: bool
    # The merged request params come with the first Submit only; an edge adapter may hold its
    # input back (return None) until a later chunk, so they are kept until the stage starts.
    params: dict[str, Any] = attrs.field(factory=dict)
    started: bool = False
    handles: list[tuple[Connector, Any]] = attrs.field(factory=list)
    edge_states: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    out_index: int = 0


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


class StageWorker:
    """Runs one replica of one stage.

    `connectors` maps a source/target key to the connector instance this worker uses: incoming edges
    by ``"src->this"``, outgoing edges by ``"this->dst"``, ``"request"`` for request input and
    ``"output"`` for user-facing output. `batch` opens a block whose `send`s may be written together
    (`WorkerChannel.batch`): the worker routes a step's chunks, and handles the messages it drained,
    inside one.
    """

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        stage: ResolvedStage,
        replica: int,
        connectors: dict[str, Connector],
        send: Callable[[Any], None],
        batch: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        shared_models: SharedModels | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.replica = replica
        self.connectors = connectors
        self.send = send
        self.batch = batch
        self.adapters = {edge.source: self._edge_adapter(edge) for edge in stage.inputs}
        self.output_adapter = (
            build_part(
                stage.output_adapter,
                PartContext(pipeline, stage, replica=replica),
                OutputAdapter,
                f"stage {stage.name!r} output adapter",
            )
            if stage.output_adapter
            else None
        )
        self.requests: dict[str, _RequestState] = {}
        self.allocator = running_allocator()  # (in an inline worker: the engine's process's)
        self.runtime: StageRuntime | None = None
        # Whether another stage runs on this one's loaded model (``share_model_with``), and where
        # the two hand it over (the engine's for inline stages, the worker process's otherwise).
        self.shares_out = any(other.share_model_with == stage.name for other in pipeline.stages)
        if (self.shares_out or stage.share_model_with) and shared_models is None:
            raise StageError(stage.name, "share_model_with needs a SharedModels where both stages run")
        self.shared_models: SharedModels = shared_models  # type: ignore[assignment]  (unused when nothing is shared)

    def _edge_adapter(self, edge: ResolvedEdge) -> EdgeAdapter:
        context = PartContext(self.pipeline, self.stage, edge, self.replica)
        if edge.adapter is None:
            return PassThroughAdapter(context)
        return build_part(edge.adapter, context, EdgeAdapter, f"edge {edge.key!r} adapter")

    # -- lifecycle -------------------------------------------------------------------------------

    def load(self) -> None:
        models = self.shared_models
        if self.shares_out:  # a stage loading from now on waits for this load's outcome
            models.withdraw(self.stage.name, self.replica)
        try:
            runtime_cls = load_ref(self.stage.runtime_ref)
            runtime = runtime_cls(self.pipeline, self.stage, self.replica)
            if self.stage.share_model_with is not None:
                self.send(m.Progress(f"waiting for stage {self.stage.share_model_with!r} to load the model it shares", 0.0))
                runtime.shared = models.wait(self.stage.share_model_with, self.replica)
            runtime.load(lambda description, fraction: self.send(m.Progress(description, fraction)))
            if self.shares_out:
                shared = runtime.shared_model()
                if shared is None:
                    raise StageError(self.stage.name, f"its {self.stage.kind!r} runtime has no model to share")
                models.publish(self.stage.name, self.replica, shared)
        except BaseException as exc:
            if self.shares_out:  # whoever waits for this model must not wait forever
                models.publish(self.stage.name, self.replica, error=f"{type(exc).__name__}: {exc}")
            raise
        self.runtime = runtime
        self.send(m.Ready(os.getpid()))

    def run(self, inbox: Inbox) -> None:
        """Serve until `Shutdown` (or the inbox closes). A failed load is reported (`LoadFailed`),
        then raised: the worker ends."""
        try:
            self.load()
        except Exception as exc:
            self.send(m.LoadFailed(f"{type(exc).__name__}: {exc}"))
            raise
        try:
            while True:
                assert self.runtime is not None
                busy = self.runtime.has_unfinished()
                messages = self._drain(inbox, block=not busy)  # outside the batch: this may block
                if not self.requests and self._host_reloaded():
                    # Between requests: let the old model go rather than keep it beside the new one.
                    logger.info("stage %s replica %d: stage %s reloaded the model they share; loading on the new one",
                                self.stage.name, self.replica, self.stage.share_model_with)
                    self._reload_runtime()
                with self.batch():
                    for message in messages:
                        if isinstance(message, m.Shutdown):
                            return
                        self._handle(message)
                if self.runtime.has_unfinished():
                    self._step()
        finally:
            self.close()

    def _host_reloaded(self) -> bool:
        """Whether the stage whose model this one shares (``share_model_with``) has loaded a new one
        since (it reloaded its runtime after a failed step): this runtime still holds the old one."""
        host = self.stage.share_model_with
        if host is None or self.runtime is None:
            return False
        current = self.shared_models.current(host, self.replica)
        return current is not None and current is not self.runtime.shared

    def _reload_runtime(self) -> None:
        """Close the runtime and load a new one (on a shared model: the one its host has now)."""
        assert self.runtime is not None
        try:
            self.runtime.close()
        finally:
            self.runtime = None
        self.load()

    def close(self) -> None:
        for request_id in list(self.requests):
            self._forget(request_id)
        if self.shares_out:
            self.shared_models.withdraw(self.stage.name, self.replica)
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    @staticmethod
    def _drain(inbox: Inbox, block: bool) -> list[Any]:
        messages = []
        try:
            messages.append(inbox.get(block=block))
            while True:
                messages.append(inbox.get(block=False))
        except queue.Empty:
            pass
        except (EOFError, OSError):  # the engine went away: stop
            messages.append(m.Shutdown())
        return messages

    # -- messages --------------------------------------------------------------------------------

    def _handle(self, message: Any) -> None:
        if isinstance(message, m.Submit):
            self._submit(message)
        elif isinstance(message, m.Abort):
            if message.request_id in self.requests:
                assert self.runtime is not None
                self.runtime.abort_request(message.request_id)
                self._forget(message.request_id)
        elif isinstance(message, m.Ping):
            active = len(self.requests)
            # cpu_threads: the OpenMP thread count the process was started with (None: the default).
            stats = {
                "pid": os.getpid(), "cpu_threads": _env_int("OMP_NUM_THREADS"), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                "kernel_cache": _env_int(KERNEL_CACHE_ENV), "allocator": self.allocator,
            }
            if self.runtime is not None:
                stats |= self.runtime.health_stats()
            self.send(m.Pong(message.token, active, stats))

    def _submit(self, message: m.Submit) -> None:
        connector = self.connectors[REQUEST_SOURCE if message.source == REQUEST_SOURCE else f"{message.source}->{self.stage.name}"]
        state = self.requests.get(message.request_id)
        if state is None:
            if message.params is None:
                # Input for a request that already ended here (aborted or failed): drop it.
                connector.release(message.handle)
                return
            state = _RequestState(message.targets, message.emit_output, dict(message.params))
            self.requests[message.request_id] = state
        state.handles.append((connector, message.handle))
        try:
            stage_input = self._to_stage_input(state, message, connector)
            if stage_input is None:
                return
            assert self.runtime is not None
            if not state.started:
                stage_input.params = state.params | stage_input.params
                state.started = True
                self.runtime.add_request(message.request_id, stage_input)
            else:
                self.runtime.extend_request(message.request_id, stage_input)
        except InvalidRequestError as exc:
            self._fail_request(message.request_id, str(exc), invalid=True, param=exc.param)
        except Exception as exc:  # an adapter or runtime bug must not take the worker down
            logger.exception("stage %s: input of request %s failed", self.stage.name, message.request_id)
            self._fail_request(message.request_id, f"{type(exc).__name__}: {exc}")

    def _to_stage_input(self, state: _RequestState, message: m.Submit, connector: Connector) -> StageInput | None:
        data = connector.get(message.handle)
        if message.source == REQUEST_SOURCE:
            return StageInput(data=data.get("data", {}), final=message.final, params=data.get("params", {}))
        chunk = Chunk(message.request_id, message.source, message.index, data, message.final)
        edge_state = state.edge_states.setdefault(message.source, {})
        return self.adapters[message.source].on_chunk(edge_state, chunk)

    def _fail_request(self, request_id: str, message: str, invalid: bool = False, param: str | None = None) -> None:
        if request_id in self.requests:
            assert self.runtime is not None
            self.runtime.abort_request(request_id)
            self._forget(request_id)
        self.send(m.RequestFailed(request_id, message, invalid, param))

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for connector, handle in state.handles:
                connector.release(handle)

    # -- stepping --------------------------------------------------------------------------------

    def _step(self) -> None:
        assert self.runtime is not None
        try:
            chunks = self.runtime.step()
        except Exception as exc:
            self._stage_failed(exc)
            return
        with self.batch():
            for chunk in chunks:
                self._route(chunk)

    def _route(self, chunk: Chunk) -> None:
        state = self.requests.get(chunk.request_id)
        if state is None:
            return  # aborted while the step ran
        if chunk.error is not None:
            self._fail_request(chunk.request_id, chunk.error, invalid=chunk.invalid, param=chunk.param)
            return
        try:
            for target in state.targets:
                connector = self.connectors[f"{self.stage.name}->{target}"]
                handle = connector.put(chunk.data)
                self.send(m.Emit(chunk.request_id, target, chunk.index, chunk.final, handle))
            if state.emit_output:
                data = self.output_adapter.to_output(chunk) if self.output_adapter else chunk.data
                if data or chunk.final:
                    handle = self.connectors["output"].put(data)
                    self.send(m.Emit(chunk.request_id, None, state.out_index, chunk.final, handle))
                    state.out_index += 1
        except Exception as exc:
            logger.exception("stage %s: routing a chunk of %s failed", self.stage.name, chunk.request_id)
            self._fail_request(chunk.request_id, f"{type(exc).__name__}: {exc}")
            return
        if chunk.final:
            self._forget(chunk.request_id)

    def _stage_failed(self, exc: BaseException) -> None:
        """The runtime's state is unknown after a failed step: fail its requests and reload it."""
        logger.error("stage %s replica %d failed: %s", self.stage.name, self.replica, traceback.format_exc())
        failed = tuple(self.requests)
        for request_id in failed:
            self._forget(request_id)
        self.send(m.StageFailed(f"{type(exc).__name__}: {exc}", failed))
        if getattr(exc, "restart_worker", False):
            raise exc  # the worker ends; the stage group restarts it
        self._reload_runtime()
