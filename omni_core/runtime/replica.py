"""The core's placements (`omni_core.runtime.placement.Replica`): ``inline`` (a thread here) and
``process`` (a spawned worker).

A replica delivers every worker message to `on_message` on the engine's event loop (an inline
worker hands them over thread-safely; a process worker's pipe is read by the loop itself, see
`channel`) and reports a crashed worker as `None`. No polling.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import attrs

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.connectors import create_connector
from omni_core.connectors.base import Connector
from omni_core.errors import ConfigError
from omni_core.runtime import messages as m
from omni_core.runtime.allocator import allocator_environment, environment, preloaded
from omni_core.runtime.channel import EngineChannel, WorkerChannel
from omni_core.runtime.placement import Replica, ReplicaContext

logger = logging.getLogger(__name__)



def stage_connector_keys(pipeline: ResolvedPipeline, stage: ResolvedStage) -> dict[str, tuple[str, dict]]:
    """Connector (ref, options) per key a worker of `stage` uses (see `StageWorker`)."""
    keys = {edge.key: (edge.connector_ref, edge.connector_options) for edge in stage.inputs}
    keys |= {edge.key: (edge.connector_ref, edge.connector_options) for edge in pipeline.downstream(stage.name)}
    io = (pipeline.output_connector_ref, pipeline.output_connector_options)
    keys["request"] = io
    keys["output"] = io
    return keys


def _connector_key(key: str) -> str:
    """The deploy key of a worker's connector (``"a->b"``, ``"request"``, ``"output"``), for errors."""
    return f"edges.{key}" if "->" in key else "output_connector"


def build_connectors(specs: dict[str, tuple[str, dict]]) -> dict[str, Connector]:
    """One connector instance per distinct (ref, options) in this process."""
    built: dict[str, Connector] = {}
    by_spec: dict[str, Connector] = {}
    for key, (ref, options) in specs.items():
        spec_key = f"{ref}|{sorted(options.items())!r}|{key if key not in ('request', 'output') else 'io'}"
        if spec_key not in by_spec:
            by_spec[spec_key] = create_connector(ref, options, where=_connector_key(key))
        built[key] = by_spec[spec_key]
    return built


class InlineReplica(Replica):
    """A replica running in a thread of the engine's process (placement ``inline``); it uses the
    engine's own connector instances."""

    placement = "inline"

    def __init__(self, context: ReplicaContext) -> None:
        from omni_core.runtime.worker import StageWorker

        super().__init__(context)
        stage, index, loop, on_message = context.stage, context.index, context.loop, context.on_message
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.worker = StageWorker(
            context.pipeline, stage, index, context.local_connectors, lambda msg: loop.call_soon_threadsafe(on_message, msg),
            shared_models=context.shared_models,
        )
        self._on_message = on_message
        self._loop = loop
        self.thread = threading.Thread(target=self._run, name=f"omni-{stage.name}-{index}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run(self.inbox)
        except BaseException:
            logger.exception("inline worker %s died", self.thread.name)
            self._loop.call_soon_threadsafe(self._on_message, None)

    def send(self, message: Any) -> None:
        self.inbox.put(message)

    def alive(self) -> bool:
        return self.thread.is_alive()

    async def stop(self, timeout: float = 30.0) -> None:
        if self.thread.is_alive():
            self.inbox.put(m.Shutdown())
            await asyncio.to_thread(self.thread.join, timeout)


def _worker_main(
    pipeline_data: dict, stage_name: str, index: int, incoming: Connection, outgoing: Connection, log_level: int,
    guests: tuple[tuple[str, Connection, Connection], ...] = (),
) -> None:
    """Entry point of a stage worker process (spawned). `guests`: stages that share this stage's
    model (``share_model_with``), each run by a worker thread here on its own channel."""
    # Ctrl-C reaches the whole process group, and so does SIGTERM from a service manager that stops
    # a process group (systemd's default KillMode, `timeout`, supervisord's killasgroup). The engine
    # stops its workers itself (a Shutdown message, or EOF on the pipe if it dies, then SIGKILL if
    # one hangs), so a worker must not die mid-step on either: the engine would see a crash, log
    # it and restart the replica (loading its weights again) while the server shuts down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipeline = ResolvedPipeline.from_dict(pipeline_data)
    stage = prepare_worker_process(pipeline.stage(stage_name))
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{stage_name}:{index}] %(name)s: %(message)s")
    from omni_core.runtime.shared_models import SharedModels
    from omni_core.runtime.worker import StageWorker

    stages = [stage, *(attrs.evolve(pipeline.stage(name), devices=stage.devices) for name, _, _ in guests)]
    connectors = build_connectors({key: spec for each in stages for key, spec in stage_connector_keys(pipeline, each).items()})
    models = SharedModels() if guests else None
    threads = []
    for guest, (_, guest_in, guest_out) in zip(stages[1:], guests):
        thread = threading.Thread(
            target=_guest_worker, args=(pipeline, guest, index, connectors, WorkerChannel(guest_in, guest_out), models),
            name=f"omni-{guest.name}-{index}", daemon=True,
        )
        thread.start()
        threads.append(thread)
    channel = WorkerChannel(incoming, outgoing)
    worker = StageWorker(pipeline, stage, index, connectors, channel.send, channel.batch, shared_models=models)
    try:
        worker.run(channel)
    finally:
        for thread in threads:  # the engine stops its guests with it: let them finish their Shutdown
            thread.join(GUEST_STOP_S)
        for connector in set(connectors.values()):
            connector.close()
        channel.close()


GUEST_STOP_S = 10.0
"""How long a worker process that ends waits for the stages running in it (``share_model_with``)."""
GUEST_EXIT_GRACE_S = 1.0
"""How long a failed guest worker lets the process's other workers write before it ends the process."""


def _guest_worker(pipeline: ResolvedPipeline, stage: ResolvedStage, index: int, connectors: dict[str, Connector],
                  channel: WorkerChannel, models: Any) -> None:
    """A stage that shares the process's model, on its own channel. Stages sharing a process live
    and die together: if this worker fails (a failed load included), the process exits, and the
    engine restarts both."""
    from omni_core.runtime.worker import StageWorker

    worker = StageWorker(pipeline, stage, index, connectors, channel.send, channel.batch, shared_models=models)
    try:
        worker.run(channel)
    except BaseException:
        logger.exception("stage %s replica %d (in stage %s's process) failed: ending the process", stage.name, index, stage.share_model_with)
        channel.close()
        time.sleep(GUEST_EXIT_GRACE_S)  # the host worker may be reporting its own failure (a failed load) meanwhile
        os._exit(1)
    channel.close()


def prepare_worker_process(stage: ResolvedStage) -> ResolvedStage:
    """Set up a process that runs replicas of `stage` (a spawned worker, a Ray actor) before its
    runtime loads: CPU threads, niceness, the allocator, the kernel cache; returns `stage` with its GPUs numbered as
    this process sees them (only its own, from 0)."""
    if stage.cpu_threads is not None:
        # Before torch (and its OpenMP runtime) is imported: its default is one thread per core.
        os.environ["OMP_NUM_THREADS"] = str(stage.cpu_threads)
        if "torch" in sys.modules:  # the parent's main module imported it on the way here
            sys.modules["torch"].set_num_threads(stage.cpu_threads)
    if stage.kernel_cache is not None:
        # Read by oneDNN when it first compiles a kernel; vLLM and torch use it on CPU.
        os.environ.setdefault(KERNEL_CACHE_ENV, str(stage.kernel_cache))
    if stage.nice:
        os.nice(stage.nice)
    if stage.keep_freed_memory and preloaded() is None:  # (glibc's settings: nothing to set on tcmalloc/jemalloc)
        keep_freed_memory()
    if any(d.startswith("cuda:") for d in stage.devices):
        # This process sees only its stage's GPUs (CUDA_VISIBLE_DEVICES, set at spawn), from 0.
        local = iter(range(len(stage.devices)))
        stage = attrs.evolve(stage, devices=tuple(f"cuda:{next(local)}" if d.startswith("cuda:") else d for d in stage.devices))
    return stage


# What a worker's death by a signal usually means, and what to do about it.
_SIGNAL_HINTS = {
    "SIGKILL": "killed from outside: most often the kernel's out-of-memory killer (see `dmesg`); give the stage "
    "less to hold (fewer max_num_seqs, a smaller kv_cache_memory_bytes, fewer replicas) or the machine more memory",
    "SIGSEGV": "a crash in native code (a library's kernel or a driver); the lines above it in the log say where",
    "SIGILL": "an instruction this CPU does not run: a kernel built for another CPU (or a dtype its path does "
    "not support here); try dtype float32 for this stage",
    "SIGBUS": "shared memory ran out or was removed (/dev/shm too small?)",
    "SIGABRT": "a library aborted (an assertion in native code); the lines above it in the log say why",
}


def exit_reason(code: int | None) -> str:
    """``exited (code 1)``, or ``killed by SIGILL (...what it usually means...)`` for a signal."""
    if code is None or code >= 0:
        return f"exited (code {code})"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    hint = _SIGNAL_HINTS.get(name)
    return f"killed by {name}" + (f": {hint}" if hint else "")


# glibc mallopt parameters (malloc.h) and the sizes Omni's workers use.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KERNEL_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
_MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap and are reused once freed
_TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept before any is handed back


def keep_freed_memory() -> bool:
    """Make this process's glibc allocator keep freed memory for reuse (`StageDeploy.keep_freed_memory`).

    By default glibc serves blocks from 128 KiB up with fresh ``mmap`` pages, or trims them off the
    heap once freed, so every new tensor of a few MiB page-faults its memory in again. Returns
    whether both settings took (``False`` off glibc, where nothing changes).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.debug("no glibc mallopt here: freed memory is handled by the default allocator")
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


class ProcessReplica(Replica):
    """A replica in its own spawned process (placement ``process``), talking to the engine's event
    loop over a channel.

    The process's exit (its sentinel becoming readable) is what reports a crash: whatever the
    worker wrote before it died is delivered first.

    A stage that shares another's loaded model (``share_model_with``) runs in that stage's
    process: the host replica spawns it with a channel per such guest stage and offers the engine's
    ends (`Colocation`); a guest replica spawns nothing, claims its channel, and learns of the
    process's exit from the host. Killing a guest kills the process: they restart together.
    """

    placement = "process"

    def __init__(self, context: ReplicaContext) -> None:
        super().__init__(context)
        self.pipeline = context.pipeline
        self.stage = context.stage
        self._on_message = context.on_message
        self._loop = context.loop
        self._ctx = mp.get_context("spawn")
        self.process: Any = None
        self._channel: EngineChannel | None = None
        self._exited: asyncio.Future[None] = context.loop.create_future()
        self._stopping = False
        self._killed: str | None = None  # why `kill` ended the worker
        self._colocation = context.colocation
        self._host = self.stage.share_model_with  # the stage whose process this one runs in
        self._guests = tuple(s.name for s in self.pipeline.stages if s.share_model_with == self.stage.name)
        self._unsent: list[Any] = []  # a guest's messages before it has its channel
        if (self._host or self._guests) and self._colocation is None:
            raise ConfigError(f"stage {self.stage.name!r}: share_model_with needs the engine's Colocation", key=f"stages.{self.stage.name}")

    def start(self) -> None:
        if self._host is not None:
            self._colocation.claim(self._host, self.index, self.stage.name, self._attach)
            return
        worker_in, engine_out = self._ctx.Pipe(duplex=False)
        engine_in, worker_out = self._ctx.Pipe(duplex=False)
        guest_pipes = {guest: (self._ctx.Pipe(duplex=False), self._ctx.Pipe(duplex=False)) for guest in self._guests}
        # (guest, worker_in, worker_out) for the child; (engine_in, engine_out) stay here.
        guests = tuple((guest, to_worker[0], to_engine[1]) for guest, (to_worker, to_engine) in guest_pipes.items())
        env_devices = ",".join(d.split(":", 1)[1] for d in self.stage.devices if d.startswith("cuda:"))
        process = self._ctx.Process(
            target=_worker_main,
            args=(
                self.pipeline.to_dict(), self.stage.name, self.index, worker_in, worker_out,
                logging.getLogger().level or logging.WARNING, guests,
            ),
            name=f"omni-{self.stage.name}-{self.index}",
            daemon=True,
        )
        # Inherited by the spawned child only: its GPUs, its allocator.
        env = allocator_environment(self.stage.allocator, self.stage.name)
        if env_devices:
            env["CUDA_VISIBLE_DEVICES"] = env_devices
        try:
            with environment(env):
                process.start()
        finally:
            for end in (worker_in, worker_out, *(c for _, a, b in guests for c in (a, b))):
                end.close()  # the child has its own copies now
        self.process = process
        self._channel = EngineChannel(self._loop, engine_in, engine_out, self._on_message)
        self._loop.add_reader(process.sentinel, self._on_exit)
        if self._guests:
            self._colocation.offer(
                self.stage.name, self.index, process,
                {guest: (to_engine[0], to_worker[1]) for guest, (to_worker, to_engine) in guest_pipes.items()},
            )

    def _attach(self, process: Any, incoming: Connection | None, outgoing: Connection | None) -> Any:
        """A guest gets its channel in the host's process (None: the host will not run again)."""
        if process is None or self._stopping:
            if incoming is not None and outgoing is not None:
                incoming.close()
                outgoing.close()
            if process is None and not self._stopping:
                logger.error("stage %s replica %d: stage %s, whose process it runs in, is not restarted", self.stage.name, self.index, self._host)
                self._exited.set_result(None)
                self._on_message(None)
            return lambda: None
        assert incoming is not None and outgoing is not None
        self.process = process
        self._channel = EngineChannel(self._loop, incoming, outgoing, self._on_message)
        for message in self._unsent:
            self._channel.send(message)
        self._unsent.clear()
        return self._on_exit

    def _on_exit(self) -> None:
        if self._host is None:
            self._loop.remove_reader(self.process.sentinel)
        assert self._channel is not None
        self._channel.drain()
        self._channel.close()
        if self._host is None:
            self.process.join()  # already exited: this only reaps it
        if not self._exited.done():
            self._exited.set_result(None)
        if self._guests:
            self._colocation.exited(self.stage.name, self.index)
        if not self._stopping:
            why = f"killed: it {self._killed}" if self._killed else exit_reason(self.process.exitcode)
            if self._host is not None:
                why = f"{why} (the worker process of stage {self._host}, which it runs in)"
            logger.error("stage %s replica %d: worker process %s", self.stage.name, self.index, why)
            self._on_message(None)

    def kill(self, reason: str) -> bool:
        if self.process is None or self._exited.done():
            return False
        self._killed = reason
        self.process.kill()  # (a guest's: the host's process, with every stage in it)
        return True

    def send(self, message: Any) -> None:
        """Queue `message` for the worker (dropped if it has died: its exit is reported)."""
        if self._channel is None:
            self._unsent.append(message)  # a guest waiting for its host's process
            return
        self._channel.send(message)

    def alive(self) -> bool:
        return self.process is not None and not self._exited.done()

    async def stop(self, timeout: float = 30.0) -> None:
        """Ask the worker to shut down; kill it if it does not in time (it ignores SIGTERM:
        `_worker_main`). A guest only asks (its host's replica ends the process)."""
        self._stopping = True
        if self.process is None:
            return
        if not self._exited.done():
            self.send(m.Shutdown())
        if self._host is not None:
            deadline = self._loop.time() + timeout
            while self._channel is not None and self._channel.reading and not self._exited.done() and self._loop.time() < deadline:
                await asyncio.sleep(0.02)  # its worker thread closes its channel when it ends
            return
        for ending, wait in ((None, timeout), (self.process.kill, None)):
            if self._exited.done():
                break
            if ending is not None:
                ending()
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), wait)
            except asyncio.TimeoutError:
                pass
