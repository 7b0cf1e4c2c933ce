"""Placements: where a stage's replicas run, one protocol whatever runs them.

A placement is a `Replica` subclass registered by name (``register_placements``: the core's
``inline`` and ``process``, a plugin's others). `StageGroup` builds one per replica from the
stage's resolved ``placement_ref`` and knows no concrete class: it starts it, sends it messages,
hears from it through ``on_message`` (``None`` when the replica died) and stops it.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Any, Callable, ClassVar

import attrs

from omni_core.config.deploy import ENGINE_HOST, DeployConfig, StageDeploy
from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.connectors.base import Connector

OnMessage = Callable[[Any], None]
"""Called on the engine's event loop with each message a replica's worker sends; ``None`` once the
replica died (after every message it sent before)."""


@attrs.frozen
class ReplicaContext:
    """What every placement's replica is built with.

    - `pipeline`, `stage`, `index`: the replica to run (its worker runs
      `omni_core.runtime.worker.StageWorker` for them);
    - `on_message`, `loop`: how the worker's messages reach the engine (call ``on_message`` on
      `loop`, e.g. with ``loop.call_soon_threadsafe``);
    - `local_connectors`: the engine's own connector instances by key, for a replica in the
      engine's process (in-process connectors only work there); others build their own;
    - `session`: what the placement's `Replica.open_session` returned for this engine;
    - `shared_models`, `colocation`: the engine's `omni_core.runtime.shared_models.SharedModels`
      (inline stages that share a loaded model hand it over there) and `Colocation` (a ``process``
      replica of a stage that shares another's model runs in that stage's worker process).
    """

    pipeline: ResolvedPipeline
    stage: ResolvedStage
    index: int
    on_message: OnMessage
    loop: asyncio.AbstractEventLoop
    local_connectors: dict[str, Connector] = attrs.field(factory=dict)
    session: Any = None
    shared_models: Any = None
    colocation: Any = None


class Replica(abc.ABC):
    """One replica of a stage, wherever it runs. Built with a `ReplicaContext`; the constructor
    does no work (`start` does)."""

    placement: ClassVar[str]
    """The registered name, as `health` reports it."""

    def __init__(self, context: ReplicaContext) -> None:
        self.context = context
        self.index = context.index

    @classmethod
    def host(cls, deploy: StageDeploy) -> str | None:
        """The host a stage deployed so will run on, as far as the placement knows before it
        starts: ``"engine"``, the engine's own host (the default: ``inline``, ``process``); another
        key for a group of hosts (stages with equal keys share a host); None when its replicas may
        land on any host. `resolve()` refuses a host-local connector between stages on different
        (or unknown) hosts. Never decide it from hostnames or addresses: two simulated nodes share
        them."""
        return ENGINE_HOST

    @classmethod
    def stage_options(cls, deploy: StageDeploy) -> dict[str, Any]:
        """What this placement needs from a stage's deploy entry, as plain data: it becomes
        `ResolvedStage.placement_options` (e.g. the ``ray`` placement's resources). Default: nothing."""
        return {}

    @classmethod
    def deploy_options(cls, deploy: DeployConfig) -> dict[str, Any]:
        """What this placement needs from the whole deploy when a stage uses it, as plain data:
        it becomes ``ResolvedPipeline.placements[name]`` (e.g. the Ray cluster's address)."""
        return {}

    @classmethod
    def open_session(cls, pipeline: ResolvedPipeline) -> Any:
        """Called once per engine start for each placement its stages use, before any replica of
        it starts; what it returns reaches every replica as `ReplicaContext.session` (e.g. a
        connection to a cluster). Must not block: connect lazily, off the event loop."""
        return None

    @classmethod
    async def close_session(cls, session: Any) -> None:
        """Called once at engine shutdown, after every replica of this placement stopped."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start the worker (return at once; it reports `Ready` or `LoadFailed` through ``on_message``)."""

    @abc.abstractmethod
    def send(self, message: Any) -> None:
        """Queue a message for the worker, without blocking (dropped if the replica died)."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the worker is running."""

    def kill(self, reason: str) -> bool:
        """End a worker that stopped answering (`StageGroup`'s watchdog) at once, so that its exit is
        reported as a crash is (`None` through ``on_message``), logged with `reason`. Returns
        ``False`` where the placement cannot (an inline worker is a thread)."""
        return False

    @abc.abstractmethod
    async def stop(self, timeout: float = 30.0) -> None:
        """Ask the worker to shut down; end it by force when it does not within `timeout` seconds."""
