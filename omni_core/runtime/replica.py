"""Stage replicas by placement: ``inline`` (a thread here) and ``process`` (a spawned worker).

A replica delivers every worker message to `on_message` on the engine's event loop (thread-safe
hand-off, no polling) and reports a crashed worker as `None`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
from typing import Any, Callable

import attrs

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.connectors.base import Connector
from omni_core.refs import load_ref
from omni_core.runtime import messages as m

logger = logging.getLogger(__name__)

OnMessage = Callable[[Any], None]


def stage_connector_keys(pipeline: ResolvedPipeline, stage: ResolvedStage) -> dict[str, tuple[str, dict]]:
    """Connector (ref, options) per key a worker of `stage` uses (see `StageWorker`)."""
    keys = {edge.key: (edge.connector_ref, edge.connector_options) for edge in stage.inputs}
    keys |= {edge.key: (edge.connector_ref, edge.connector_options) for edge in pipeline.downstream(stage.name)}
    io = (pipeline.output_connector_ref, pipeline.output_connector_options)
    keys["request"] = io
    keys["output"] = io
    return keys


def build_connectors(specs: dict[str, tuple[str, dict]]) -> dict[str, Connector]:
    """One connector instance per distinct (ref, options) in this process."""
    built: dict[str, Connector] = {}
    by_spec: dict[str, Connector] = {}
    for key, (ref, options) in specs.items():
        spec_key = f"{ref}|{sorted(options.items())!r}|{key if key not in ('request', 'output') else 'io'}"
        if spec_key not in by_spec:
            by_spec[spec_key] = load_ref(ref)(**options)
        built[key] = by_spec[spec_key]
    return built


class InlineReplica:
    """A replica running in a thread of the engine's process."""

    placement = "inline"

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        stage: ResolvedStage,
        index: int,
        connectors: dict[str, Connector],
        on_message: OnMessage,
        call_soon: Callable[..., Any],
    ) -> None:
        from omni_core.runtime.worker import StageWorker

        self.index = index
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.worker = StageWorker(pipeline, stage, index, connectors, lambda msg: call_soon(on_message, msg))
        self._on_message = on_message
        self._call_soon = call_soon
        self.thread = threading.Thread(target=self._run, name=f"omni-{stage.name}-{index}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run(self.inbox)
        except BaseException:
            logger.exception("inline worker %s died", self.thread.name)
            self._call_soon(self._on_message, None)

    def send(self, message: Any) -> None:
        self.inbox.put(message)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        if self.thread.is_alive():
            self.inbox.put(m.Shutdown())
            self.thread.join(timeout)


def _pump(conn: Any, inbox: queue.SimpleQueue) -> None:
    """Drain the engine's pipe continuously (so the engine never blocks on a full pipe)."""
    while True:
        try:
            inbox.put(conn.recv())
        except (EOFError, OSError):  # the engine is gone
            inbox.put(m.Shutdown())
            return


def _worker_main(pipeline_data: dict, stage_name: str, index: int, inbox_conn: Any, conn: Any, log_level: int) -> None:
    """Entry point of a stage worker process (spawned)."""
    # Ctrl-C reaches the whole process group; the engine stops its workers itself (a Shutdown
    # message, or EOF on the pipe if it dies), so a worker must not die mid-step on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{stage_name}:{index}] %(name)s: %(message)s")
    from omni_core.runtime.worker import StageWorker

    pipeline = ResolvedPipeline.from_dict(pipeline_data)
    stage = pipeline.stage(stage_name)
    if any(d.startswith("cuda:") for d in stage.devices):
        # This process sees only its stage's GPUs (CUDA_VISIBLE_DEVICES, set at spawn), from 0.
        local = iter(range(len(stage.devices)))
        stage = attrs.evolve(stage, devices=tuple(f"cuda:{next(local)}" if d.startswith("cuda:") else d for d in stage.devices))
    connectors = build_connectors(stage_connector_keys(pipeline, stage))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_pump, args=(inbox_conn, inbox), daemon=True).start()
    worker = StageWorker(pipeline, stage, index, connectors, conn.send)
    try:
        worker.run(inbox)
    finally:
        for connector in set(connectors.values()):
            connector.close()


class ProcessReplica:
    """A replica in its own spawned process; a reader thread forwards its messages."""

    placement = "process"

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        stage: ResolvedStage,
        index: int,
        on_message: OnMessage,
        call_soon: Callable[..., Any],
    ) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.index = index
        self._on_message = on_message
        self._call_soon = call_soon
        self._ctx = mp.get_context("spawn")
        self.process: Any = None
        self._to_worker: Any = None
        self._send_lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        self._stopping = False
        worker_inbox, self._to_worker = self._ctx.Pipe(duplex=False)
        reader, writer = self._ctx.Pipe(duplex=False)
        env_devices = ",".join(d.split(":", 1)[1] for d in self.stage.devices if d.startswith("cuda:"))
        self.process = self._ctx.Process(
            target=_worker_main,
            args=(self.pipeline.to_dict(), self.stage.name, self.index, worker_inbox, writer, logging.getLogger().level or logging.WARNING),
            name=f"omni-{self.stage.name}-{self.index}",
            daemon=True,
        )
        previous = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_devices  # inherited by the spawned child only
        try:
            self.process.start()
        finally:
            if env_devices:
                if previous is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = previous
        writer.close()  # so that the reader sees EOF when the child dies
        worker_inbox.close()
        threading.Thread(target=self._read, args=(reader, self.process), name=f"omni-read-{self.stage.name}-{self.index}", daemon=True).start()

    def _read(self, reader: Any, process: Any) -> None:
        while True:
            try:
                message = reader.recv()
            except (EOFError, OSError):
                break
            self._call_soon(self._on_message, message)
        process.join(5)
        if not self._stopping:
            logger.error("stage %s replica %d: worker process exited (code %s)", self.stage.name, self.index, process.exitcode)
            self._call_soon(self._on_message, None)

    def send(self, message: Any) -> None:
        with self._send_lock:
            try:
                self._to_worker.send(message)
            except (BrokenPipeError, OSError):
                pass  # the worker died; the reader thread reports it

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self.process is None:
            return
        if self.process.is_alive():
            self.send(m.Shutdown())
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._to_worker.close()
