"""The ``ray`` placement: each replica is a Ray actor holding the stage worker, on any node of a
Ray cluster (``pip install 'omni-core[ray]'``).

Ray is imported only when a stage placed on it starts (`RaySession.connect`), never by resolve.
Ray places the actor, watches it and kills it; the messages do not go through Ray. The actor
listens on its node's address (a `multiprocessing.connection` listener with a per-replica secret
key) and the engine connects twice: one connection each way, carrying the same framed channel as a
process replica's pipes (`omni_core.runtime.channel`), written once per loop turn / worker step. (A
Ray call per batch cost the engine about 5x the CPU of a pipe, the stage processes 30% more.)
One actor call stays open for the replica's life (`wait_exit`): it returns when the worker ends and
fails when the actor dies (killed, its node lost), which is how the engine hears of a death at once,
with no heartbeat to wait for. The worker's log records travel on the channel and are logged here
under the stage's name; what its libraries print (vLLM's own handler) reaches the driver through
Ray's log forwarding, prefixed with the actor's name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import attrs

from omni_core.config.deploy import DeployConfig, RayStageDeploy, StageDeploy
from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.errors import ConfigError, MissingDependencyError
from omni_core.runtime import messages as m
from omni_core.runtime.channel import EngineChannel
from omni_core.runtime.placement import Replica, ReplicaContext

logger = logging.getLogger(__name__)

INSTALL = "pip install 'omni-core[ray]'"
SCHEDULING_PATIENCE = 30.0  # seconds before a replica whose actor is not placed yet is reported


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(f"the ray placement needs Ray: {INSTALL} ({exc})") from exc
    return ray


# -- the actor (runs in a Ray worker process) ------------------------------------------------------


@attrs.frozen
class LogLine:
    """A log record of the worker, re-logged by the engine under the stage's name."""

    level: int
    logger: str
    text: str


class _Forward(logging.Handler):
    def __init__(self, post: Any) -> None:
        super().__init__()
        self._post = post

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._post(LogLine(record.levelno, record.name, self.format(record)))
        except Exception:  # never let logging break the worker
            self.handleError(record)


class StageActor:
    """One replica's worker inside a Ray actor (made remote by `RaySession`): it takes the
    engine's two connections (`address`), then runs the stage worker on them."""

    def __init__(self, pipeline_data: dict[str, Any], stage_name: str, index: int, log_level: int, authkey: bytes) -> None:
        import ray

        from omni_core.runtime.replica import prepare_worker_process

        self._label = f"{stage_name}:{index}"
        self._done = threading.Event()
        pipeline = ResolvedPipeline.from_dict(pipeline_data)
        stage = prepare_worker_process(pipeline.stage(stage_name))
        logging.getLogger().setLevel(log_level)
        # On the address Ray reaches this node at (so does the engine's node).
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        self._thread = threading.Thread(target=self._run, args=(pipeline, stage, index), name=f"omni-{self._label}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:  # Ray prefixes the actor's printed lines with this
        return f"omni-{self._label}"

    def address(self) -> tuple[str, int]:
        return self._listener.address

    def wait_exit(self) -> None:
        """Return when the worker has ended: the engine's watch on this actor (it fails if the actor dies)."""
        self._done.wait()

    def _run(self, pipeline: ResolvedPipeline, stage: ResolvedStage, index: int) -> None:
        from omni_core.runtime.channel import WorkerChannel
        from omni_core.runtime.replica import build_connectors, stage_connector_keys
        from omni_core.runtime.worker import StageWorker

        import ray

        connectors: dict[str, Any] = {}
        log = logging.getLogger(__name__)
        channel: WorkerChannel | None = None
        try:
            with self._listener:
                incoming = self._listener.accept()  # the engine connects engine -> worker first
                outgoing = self._listener.accept()
            channel = WorkerChannel(incoming, outgoing)
            forward = _Forward(channel.send)
            forward.setFormatter(logging.Formatter("%(message)s"))
            logging.getLogger().handlers = [forward]  # this process is ours: its records go to the engine, once
            log.info("on node %s (pid %d)", ray.get_runtime_context().get_node_id()[:12], os.getpid())
            missing = missing_checkpoint(pipeline)
            if missing is not None:
                channel.send(m.LoadFailed(missing))
                return
            connectors = build_connectors(stage_connector_keys(pipeline, stage))
            StageWorker(pipeline, stage, index, connectors, channel.send, channel.batch).run(channel)
        except EOFError:
            log.info("the engine closed its channel")
        except BaseException:
            log.exception("the stage worker ended with an error")
        finally:
            for connector in set(connectors.values()):
                try:
                    connector.close()
                except Exception:
                    log.exception("closing a connector")
            logging.getLogger().handlers = []
            if channel is not None:
                channel.close()
            self._done.set()

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def _connect(address: tuple[str, int], authkey: bytes) -> tuple[Connection, Connection]:
    """The engine's two connections to an actor's listener: engine -> worker first, then back."""
    try:
        to_worker = Client(address, authkey=authkey)
    except OSError as exc:
        raise ConnectionError(
            f"cannot reach the stage worker's channel at {address[0]}:{address[1]} ({exc}): the engine's node must reach "
            "every Ray node on its worker ports"
        ) from exc
    return to_worker, Client(address, authkey=authkey)


def missing_checkpoint(pipeline: ResolvedPipeline) -> str | None:
    """Why this node cannot load the pipeline's checkpoint (its path is not here), or None."""
    if Path(pipeline.model_path).exists():
        return None
    import socket

    return (
        f"the checkpoint {pipeline.model_path} does not exist on the node this replica runs on ({socket.gethostname()}): "
        "every node that runs a stage loads it from the same path, so put it there too (or on a shared filesystem)"
    )


# -- the engine side -------------------------------------------------------------------------------


class RaySession:
    """The engine's connection to Ray, made at the first replica's start (off the event loop) and
    closed at shutdown: a local Ray that it started is stopped then."""

    def __init__(self, address: str | None, cpus: float) -> None:
        self.address = address
        self.cpus = cpus
        self.actor_class: Any = None
        self._owned = False
        self._lock = threading.Lock()

    def connect(self) -> Any:
        """Join (or start) Ray once; return the remote actor class. Blocking: call in a thread."""
        with self._lock:
            if self.actor_class is not None:
                return self.actor_class
            ray = _import_ray()
            if not ray.is_initialized():
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                address = self.address or os.environ.get("RAY_ADDRESS")
                if address:
                    logger.info("joining the Ray cluster at %s", address)
                    try:
                        ray.init(address=address, log_to_driver=True)
                    except Exception as exc:
                        raise ConnectionError(
                            f"cannot join the Ray cluster at {address}: {exc} (start one with `ray start --head`, "
                            "or leave ray.address and RAY_ADDRESS unset for a local Ray)"
                        ) from exc
                else:
                    # A local Ray for this engine: enough CPUs that every stage actor fits.
                    cpus = max(os.cpu_count() or 1, int(self.cpus + 0.999))
                    # Its workers at the daemons' priority, not Ray's default niceness 15 (which
                    # would also cap away the stages' own relative `nice`).
                    os.environ.setdefault("RAY_worker_niceness", "0")
                    logger.info("starting a local Ray (%d CPUs) for the ray placement", cpus)
                    # On loopback: nothing of it is reachable from elsewhere, and Ray does not
                    # look for the machine's outward address (it would, through a public IP).
                    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True, _node_ip_address="127.0.0.1")
                self._owned = True
            self.actor_class = ray.remote(StageActor)
            return self.actor_class

    def close(self) -> None:
        with self._lock:
            if self._owned:
                import ray

                ray.shutdown()
                self._owned = False
            self.actor_class = None


class RayReplica(Replica):
    """A replica in a Ray actor (placement ``ray``); `stages.NAME.ray` says where and what it
    reserves. Restarted by its `StageGroup` like a process replica when the actor dies."""

    placement = "ray"

    def __init__(self, context: ReplicaContext) -> None:
        super().__init__(context)
        if not isinstance(context.session, RaySession):
            raise ConfigError("a ray replica needs the engine's Ray session (RayReplica.open_session)", key=f"stages.{context.stage.name}.placement")
        self.session: RaySession = context.session
        self.stage = context.stage
        self.options = RayStageDeploy(**context.stage.placement_options)
        self._label = f"{self.stage.name}:{self.index}"
        self._authkey = secrets.token_bytes(32)  # the actor's listener takes only this engine
        self._backlog: list[Any] = []  # sent before the channel is up
        self._channel: EngineChannel | None = None
        self._actor: Any = None
        self._task: asyncio.Task[None] | None = None
        self._ended = False
        self._stopping = False
        self._killed: str | None = None  # why `kill` ended the actor

    # -- placement-wide --------------------------------------------------------------------------

    @classmethod
    def host(cls, deploy: StageDeploy) -> str | None:
        # Equal pins (custom resources, labels) name one host or group; none: any node.
        if not deploy.ray.pinned:
            return None
        pins = {"resources": deploy.ray.custom_resources, "labels": deploy.ray.label_selector}
        return "ray:" + json.dumps(pins, sort_keys=True)

    @classmethod
    def stage_options(cls, deploy: StageDeploy) -> dict[str, Any]:
        if not ray_available():
            raise ConfigError(f"placement 'ray' needs Ray, which is not installed: {INSTALL}", key="placement")
        return attrs.asdict(deploy.ray)

    @classmethod
    def deploy_options(cls, deploy: DeployConfig) -> dict[str, Any]:
        return {"address": deploy.ray.address}

    @classmethod
    def open_session(cls, pipeline: ResolvedPipeline) -> RaySession:
        ours = [s for s in pipeline.stages if s.placement_ref == f"{cls.__module__}:{cls.__qualname__}"]
        cpus = sum(s.placement_options.get("num_cpus", 1.0) * s.replicas for s in ours)
        return RaySession(pipeline.placements.get("ray", {}).get("address"), cpus)

    @classmethod
    async def close_session(cls, session: Any) -> None:
        await asyncio.to_thread(session.close)

    # -- one replica -----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = self.context.loop.create_task(self._serve(), name=f"omni-ray-{self._label}")

    async def _serve(self) -> None:
        died: str | None = None
        try:
            actor_class = await asyncio.to_thread(self.session.connect)
            placement: dict[str, Any] = {"num_cpus": self.options.num_cpus, "num_gpus": self.options.num_gpus}
            if self.options.resources:
                placement["resources"] = dict(self.options.resources)
            if self.options.label_selector:
                placement["label_selector"] = dict(self.options.label_selector)
            self._actor = actor_class.options(
                max_restarts=0,  # its StageGroup restarts it, as it does a process
                max_concurrency=2,  # `wait_exit` stays open beside the other calls
                **placement,
            ).remote(self.context.pipeline.to_dict(), self.stage.name, self.index, logging.getLogger().level or logging.WARNING, self._authkey)
            exited = asyncio.wrap_future(self._actor.wait_exit.remote().future())
            address = asyncio.wrap_future(self._actor.address.remote().future())
            done, _ = await asyncio.wait({address, exited}, timeout=SCHEDULING_PATIENCE, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                logger.warning(
                    "stage %s: its Ray actor is not placed after %.0f s: no node offers %s (see `ray status`)",
                    self._label,
                    SCHEDULING_PATIENCE,
                    self._wants(),
                )
            to_worker, from_worker = await asyncio.to_thread(_connect, tuple(await address), self._authkey)
            self._channel = EngineChannel(self.context.loop, from_worker, to_worker, self._deliver)
            backlog, self._backlog = self._backlog, []
            for message in backlog:
                self._channel.send(message)
            await exited
        except asyncio.CancelledError:
            raise
        except MissingDependencyError as exc:
            died = str(exc)
        except Exception as exc:
            ray_errors = getattr(_import_ray(), "exceptions", None)
            if ray_errors is not None and isinstance(exc, ray_errors.RayError):
                died = f"its Ray actor died: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            else:
                died = f"{type(exc).__name__}: {exc}"
        finally:
            self._ended = True
            if self._channel is not None:
                # What the worker wrote before it ended (its last messages, its error) may still
                # be on the wire when Ray reports the end: read up to its end of file, briefly.
                for _ in range(200):
                    if not self._channel.reading:
                        break
                    await asyncio.sleep(0.01)
                self._channel.drain()
                self._channel.close()
        if not self._stopping:
            logger.error("stage %s: %s", self._label, f"killed: it {self._killed}" if self._killed else died or "worker ended")
            if self._actor is None and died:  # it never started: that is why it failed to load
                self.context.on_message(m.LoadFailed(died))
            self._kill()
            self.context.on_message(None)

    def _wants(self) -> str:
        wants = {"CPU": self.options.num_cpus, "GPU": self.options.num_gpus, **self.options.resources}
        text = ", ".join(f"{k}: {v:g}" for k, v in wants.items() if v)
        if self.options.label_selector:
            text += f", labels {self.options.label_selector}"
        return text or "nothing"

    def _deliver(self, item: Any) -> None:
        if isinstance(item, LogLine):
            logging.getLogger(item.logger).log(item.level, "[%s] %s", self._label, item.text)
        else:
            self.context.on_message(item)

    def send(self, message: Any) -> None:
        if self._ended:
            return
        if self._channel is None:
            self._backlog.append(message)
        else:
            self._channel.send(message)  # written with the rest of this loop turn's messages

    def alive(self) -> bool:
        return self._task is not None and not self._ended

    def _kill(self) -> None:
        if self._actor is not None:
            try:
                _import_ray().kill(self._actor, no_restart=True)
            except Exception:  # already gone
                logger.debug("ray.kill of %s", self._label, exc_info=True)
            self._actor = None

    def kill(self, reason: str) -> bool:
        if self._actor is None or self._ended:
            return False
        self._killed = reason
        try:
            _import_ray().kill(self._actor, no_restart=True)  # `_serve` sees it end, and reports it
        except Exception:  # already gone: its end is reported anyway
            logger.debug("ray.kill of %s", self._label, exc_info=True)
        return True

    async def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self._task is None:
            return
        if not self._ended:
            self.send(m.Shutdown())
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (asyncio.TimeoutError, Exception):
                pass
        if not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._kill()
