"""Stages that share one loaded model (``share_model_with``), and the process they then share.

A stage deployed with ``share_model_with: HOST`` (`omni_core.config.deploy.StageDeploy`) runs its
runtime on the model HOST's runtime loaded (`StageRuntime.shared_model`) instead of loading its own
copy, so both run in one process and the model is passed as a reference: HOST's worker `publish`es
it in `SharedModels` once its runtime has loaded (or the reason it could not), the sharing stage's
worker `wait`s for it before loading. Under the ``inline`` placement that process is the engine's
(one `SharedModels` per engine); under ``process`` it is HOST's worker process, which runs the
sharing stage's worker in a thread of its own (`Colocation`, one `SharedModels` per process).
Nothing is process-wide state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import attrs

from omni_core.errors import StageError


class SharedModels:
    """Models published by stage replicas, by ``(stage, replica)``; thread-safe."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._models: dict[tuple[str, int], tuple[Any, str | None]] = {}

    def publish(self, stage: str, replica: int, model: Any = None, error: str | None = None) -> None:
        """Replica `replica` of `stage` loaded `model` (or failed to: `error`); a reload replaces it."""
        with self._ready:
            self._models[(stage, replica)] = (model, error)
            self._ready.notify_all()

    def withdraw(self, stage: str, replica: int) -> None:
        """The replica closed its runtime: a stage loading after this waits for the next `publish`."""
        with self._ready:
            self._models.pop((stage, replica), None)

    def current(self, stage: str, replica: int) -> Any:
        """The model replica `replica` of `stage` has published now (None: none, or it is reloading)."""
        with self._ready:
            return self._models.get((stage, replica), (None, None))[0]

    def wait(self, stage: str, replica: int, timeout: float | None = None) -> Any:
        """The model replica `replica` of `stage` published, once it has; `StageError` if it could
        not load or nothing came within `timeout` seconds."""
        with self._ready:
            if not self._ready.wait_for(lambda: (stage, replica) in self._models, timeout):
                raise StageError(stage, f"replica {replica} published no model to share within {timeout} s")
            model, error = self._models[(stage, replica)]
        if error is not None:
            raise StageError(stage, f"replica {replica} has no model to share: {error}")
        return model


@attrs.define
class _Offer:
    """A host replica's live worker process and the engine's ends of its guests' channels."""

    process: Any
    ends: dict[str, tuple[Connection, Connection]]  # guest stage -> (engine_in, engine_out), until claimed
    exits: list[Callable[[], None]] = attrs.Factory(list)  # what attached guests do when it exits


Attach = Callable[[Any, "Connection | None", "Connection | None"], Callable[[], None]]
"""``attach(process, engine_in, engine_out)`` -> what to call when that process exits; ``process``
is None when the host replica will not run again."""


class Colocation:
    """Stages whose replicas run in another stage's worker process: ``share_model_with`` under the
    ``process`` placement (`omni_core.runtime.replica.ProcessReplica`).

    The host replica spawns one process for itself and its guests, with a channel per guest, and
    `offer`s the engine's ends of those channels; each guest replica `claim`s its own (now, or
    when the host's next process comes), then talks to its worker thread there as any process
    replica talks to its worker. They live and die together: the process's exit (`exited`) ends
    every guest attached to it, and a restarted host offers afresh. One per engine, used on its
    event loop only.
    """

    def __init__(self) -> None:
        self._offers: dict[tuple[str, int], _Offer] = {}
        self._waiting: dict[tuple[str, int], list[tuple[str, Attach]]] = {}

    def offer(self, host: str, replica: int, process: Any, ends: dict[str, tuple[Connection, Connection]]) -> None:
        offer = _Offer(process, dict(ends))
        self._offers[(host, replica)] = offer
        for guest, attach in self._waiting.pop((host, replica), []):
            self._hand(offer, guest, attach)

    def claim(self, host: str, replica: int, guest: str, attach: Attach) -> None:
        offer = self._offers.get((host, replica))
        if offer is not None and guest in offer.ends:
            self._hand(offer, guest, attach)
        else:  # the host has not started yet, or this guest already used its process: the next one
            self._waiting.setdefault((host, replica), []).append((guest, attach))

    @staticmethod
    def _hand(offer: _Offer, guest: str, attach: Attach) -> None:
        incoming, outgoing = offer.ends.pop(guest)
        offer.exits.append(attach(offer.process, incoming, outgoing))

    def exited(self, host: str, replica: int) -> None:
        """The host replica's process exited: its guests' workers are gone with it."""
        offer = self._offers.pop((host, replica), None)
        if offer is None:
            return
        for incoming, outgoing in offer.ends.values():  # guests that never claimed theirs
            incoming.close()
            outgoing.close()
        for on_exit in offer.exits:
            on_exit()

    def abandon(self, host: str, replica: int) -> None:
        """The host replica will not be restarted: guests waiting for its next process fail."""
        for _, attach in self._waiting.pop((host, replica), []):
            attach(None, None, None)
