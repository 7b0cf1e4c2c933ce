"""`StageGroup`: the replicas of one stage, with load balancing, readiness, health and restart."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import Any, Callable

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.connectors.base import Connector
from omni_core.errors import ConfigError, StageError
from omni_core.refs import load_ref
from omni_core.runtime import messages as m
from omni_core.runtime.placement import Replica, ReplicaContext
from omni_core.runtime.shared_models import Colocation, SharedModels

logger = logging.getLogger(__name__)

# (stage name, replica index, message or None when the replica died)
Dispatch = Callable[[str, int, Any], None]

# Crash-loop policy, as Kubernetes has it: a replica that crashes again and again is given up on,
# but crashes spread over days are not a loop. More than `max_restarts` crashes within
# `restart_window_s` stop the restarts; older crashes are forgotten.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
# How often the watchdog (`ResolvedStage.watchdog_s`) pings each ready replica, at most.
WATCH_INTERVAL_S = 5.0


class StageGroup:
    """All replicas of one stage. Requests stick to the replica they were assigned first."""

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        stage: ResolvedStage,
        dispatch: Dispatch,
        loop: asyncio.AbstractEventLoop,
        inline_connectors: dict[str, Connector],
        max_restarts: int = MAX_RESTARTS,
        session: Any = None,
        restart_window_s: float = RESTART_WINDOW_S,
        shared_models: SharedModels | None = None,
        colocation: Colocation | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.name = stage.name
        self._dispatch = dispatch
        self._loop = loop
        self._inline_connectors = inline_connectors
        self._session = session  # the placement's, for this engine (`Replica.open_session`)
        self._shared_models = shared_models  # the engine's (``share_model_with``)
        self._colocation = colocation
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restarts = [0] * stage.replicas  # in all, for health
        self._crashes: list[collections.deque[float]] = [collections.deque() for _ in range(stage.replicas)]
        self.dead = [False] * stage.replicas
        self.failures: dict[int, str] = {}  # replica -> why it is not being restarted
        self.load_errors: dict[int, str] = {}  # replica -> why its last load failed (`LoadFailed`)
        self.replicas: list[Replica] = [self._make_replica(i) for i in range(stage.replicas)]
        self.ready: list[asyncio.Future[None]] = [loop.create_future() for _ in self.replicas]
        self.load: list[int] = [0] * stage.replicas
        self.assignment: dict[str, int] = {}
        self._round_robin = itertools.cycle(range(stage.replicas))
        self._pings: dict[int, tuple[int, asyncio.Future[m.Pong]]] = {}  # token -> (replica, its answer)
        self._ping_tokens = itertools.count()
        self._killed: dict[int, str] = {}  # replica -> why the watchdog ended it (until it is replaced)
        self._watchdog: asyncio.Task[None] | None = None

    def _make_replica(self, index: int) -> Replica:
        if self.stage.placement_ref is None:
            raise ConfigError(
                f"placement {self.stage.placement!r} of stage {self.name!r} is not resolved: resolve the pipeline with resolve()",
                key=f"stages.{self.name}.placement",
            )
        on_message = lambda message, i=index: self._on_message(i, message)  # noqa: E731
        context = ReplicaContext(
            self.pipeline, self.stage, index, on_message, self._loop, self._inline_connectors, self._session, self._shared_models,
            self._colocation,
        )
        replica = load_ref(self.stage.placement_ref)(context)
        if not isinstance(replica, Replica):
            raise ConfigError(
                f"placement {self.stage.placement!r} ({self.stage.placement_ref}) built a {type(replica).__name__}, "
                "not an omni_core.runtime.placement.Replica",
                key=f"stages.{self.name}.placement",
            )
        return replica

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()
        if self.stage.watchdog_s is not None:
            self._watchdog = self._loop.create_task(self._watch(self.stage.watchdog_s), name=f"omni-watchdog-{self.name}")

    async def wait_ready(self) -> None:
        # (shielded: a cancelled wait, such as Ctrl-C while loading, leaves the replicas' state alone)
        await asyncio.gather(*(asyncio.shield(future) for future in self.ready))

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        # A replica still loading reads no Shutdown until it has loaded (minutes, for large weights),
        # and holds no work: it is ended at once (Ctrl-C while `omni serve` loads stops it now).
        await asyncio.gather(*(replica.stop() if self._is_ready(i) else replica.stop(timeout=0.0) for i, replica in enumerate(self.replicas)))
        for future in self.ready:
            if not future.done():
                future.set_exception(StageError(self.name, "stopped before it was ready"))
                future.exception()  # mark retrieved

    def _on_message(self, index: int, message: Any) -> None:
        if isinstance(message, m.Ready):
            self.load_errors.pop(index, None)  # (a restarted replica's earlier failure is over)
            self._killed.pop(index, None)
            if not self.ready[index].done():
                self.ready[index].set_result(None)
            logger.info("stage %s replica %d ready (pid %d)", self.name, index, message.pid)
        elif isinstance(message, m.Progress):
            logger.info("stage %s replica %d: %s (%.0f%%)", self.name, index, message.description, 100 * message.fraction)
        elif isinstance(message, m.LoadFailed):
            self.load_errors[index] = message.message
        elif isinstance(message, m.Pong):
            _, future = self._pings.pop(message.token, (index, None))
            if future is not None and not future.done():
                future.set_result(message)
        if message is None:
            self._on_crash(index)
        self._dispatch(self.name, index, message)

    def _on_crash(self, index: int) -> None:
        for replica, future in self._pings.values():
            if replica == index and not future.done():
                future.set_exception(StageError(self.name, "worker died"))
        if not self.ready[index].done():
            self._not_restarted(index)
            reason = self.load_errors.get(index)
            detail = f"failed to load: {reason}" if reason else "died while loading; see its log above"
            self.failures[index] = f"{detail}; not being restarted"
            self.ready[index].set_exception(StageError(self.name, f"replica {index} {detail}"))
            return
        now = time.monotonic()
        crashes = self._crashes[index]
        crashes.append(now)
        while crashes and now - crashes[0] > self.restart_window_s:
            crashes.popleft()
        if len(crashes) > self.max_restarts:
            self._not_restarted(index)
            self.failures[index] = (
                f"crashed {len(crashes)} times within {_duration(self.restart_window_s)}: not being restarted "
                "(restart the server once the cause, logged with each crash, is fixed)"
            )
            logger.error("stage %s replica %d %s", self.name, index, self.failures[index])
            if all(self.dead):
                logger.error("stage %s has no replica left: every request that needs it fails until the server is restarted", self.name)
            return
        self.restarts[index] += 1
        logger.warning(
            "stage %s replica %d crashed: restarting it (crash %d of at most %d within %s)",
            self.name, index, len(crashes), self.max_restarts, _duration(self.restart_window_s),
        )
        self.ready[index] = self._loop.create_future()
        self.load[index] = 0
        self.replicas[index] = self._make_replica(index)
        self.replicas[index].start()

    def _not_restarted(self, index: int) -> None:
        self.dead[index] = True
        if self._colocation is not None:  # stages running in this replica's process wait no more
            self._colocation.abandon(self.name, index)

    def _is_ready(self, index: int) -> bool:
        """Replica `index` has loaded (and its current incarnation did not fail to)."""
        return self.ready[index].done() and not self.ready[index].exception()

    # -- requests --------------------------------------------------------------------------------

    def assign(self, request_id: str) -> int:
        """The replica of `request_id`, chosen now by the load-balancing policy if new."""
        index = self.assignment.get(request_id)
        if index is None:
            alive = [i for i in range(len(self.replicas)) if not self.dead[i]]
            if not alive:
                raise StageError(self.name, "every replica has failed and none is being restarted")
            ready = [i for i in alive if self._is_ready(i)]
            candidates = ready or alive
            if self.stage.load_balancer == "round_robin":
                index = next(i for i in self._round_robin if i in candidates)
            else:
                index = min(candidates, key=lambda i: self.load[i])
            self.assignment[request_id] = index
            self.load[index] += 1
        return index

    def send(self, request_id: str, message: Any) -> None:
        self.replicas[self.assign(request_id)].send(message)

    def release(self, request_id: str, abort: bool) -> None:
        """The request is over for this stage; tell the replica to drop it if `abort`."""
        index = self.assignment.pop(request_id, None)
        if index is None:
            return
        self.load[index] -= 1
        if abort:
            self.replicas[index].send(m.Abort(request_id))

    def requests_on(self, index: int) -> list[str]:
        return [rid for rid, i in self.assignment.items() if i == index]

    async def health(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Ping every replica; report liveness and its active request count."""
        report = []
        for index, replica in enumerate(self.replicas):
            entry: dict[str, Any] = {"stage": self.name, "replica": index, "placement": replica.placement, "restarts": self.restarts[index]}
            if self.dead[index]:
                entry |= {"healthy": False, "ready": False, "state": "failed", "error": f"stage {self.name!r} replica {index} {self.failures.get(index, 'failed')}"}
                report.append(entry)
                continue
            if not (self._is_ready(index) and replica.alive()):
                entry |= {"healthy": False, "ready": False, "state": "restarting" if self.restarts[index] else "loading"}
                report.append(entry)
                continue
            try:
                pong = await self._ping(index, timeout)
                entry |= {"healthy": True, "ready": True, "state": "ready", "active_requests": pong.active_requests, **pong.stats}
            except (asyncio.TimeoutError, StageError):
                entry |= {"healthy": False, "ready": True, "state": "unresponsive", "error": f"stage {self.name!r} replica {index} did not answer a ping within {timeout:g} s"}
            report.append(entry)
        return report

    def crash_message(self, index: int) -> str:
        """What a request that was on replica `index` when it ended is told."""
        killed = self._killed.get(index)
        return f"replica {index} {killed}, and was killed (restarted unless it crash-loops)" if killed else f"replica {index} crashed; see the log"

    async def _ping(self, index: int, timeout: float) -> m.Pong:
        """Replica `index`'s answer to a ping (`asyncio.TimeoutError` after `timeout` s; `StageError`
        if it dies first)."""
        token = next(self._ping_tokens)
        future: asyncio.Future[m.Pong] = self._loop.create_future()
        self._pings[token] = (index, future)
        self.replicas[index].send(m.Ping(token))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pings.pop(token, None)

    async def _watch(self, timeout: float) -> None:
        """The watchdog: ping every ready replica; kill one that answers none within `timeout` s (its
        requests then fail, and it restarts, as on a crash)."""
        reported: set[int] = set()  # ids of the replicas reported hung that could not be killed
        while True:
            await asyncio.sleep(min(WATCH_INTERVAL_S, timeout / 2))
            await asyncio.gather(*(self._probe(index, timeout, reported) for index in range(len(self.replicas))))

    async def _probe(self, index: int, timeout: float, reported: set[int]) -> None:
        replica = self.replicas[index]
        if self.dead[index] or not self._is_ready(index) or not replica.alive() or index in self._killed:
            return
        try:
            await self._ping(index, timeout)
            return
        except StageError:
            return  # it died meanwhile: reported as a crash
        except asyncio.TimeoutError:
            pass
        if replica is not self.replicas[index] or not replica.alive():
            return
        reason = f"answered no ping for {timeout:g} s (hung: see `watchdog_s`)"
        if replica.kill(reason):
            self._killed[index] = reason
            logger.error("stage %s replica %d %s: killing it", self.name, index, reason)
        elif id(replica) not in reported:
            reported.add(id(replica))
            logger.error("stage %s replica %d %s; its %s placement cannot be killed", self.name, index, reason, replica.placement)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"
