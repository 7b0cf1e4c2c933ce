"""What stages of one engine process hand each other: a loaded model two stages share.

A stage deployed with ``share_model_with: HOST`` (`omni_core.config.deploy.StageDeploy`) runs its
runtime on the model HOST's runtime loaded (`StageRuntime.shared_model`) instead of loading its own
copy. Both are ``inline`` (threads of the engine's process), so the model is passed as a reference:
HOST's worker `publish`es it once its runtime has loaded (or the reason it could not), the sharing
stage's worker `wait`s for it before loading. One `SharedModels` per engine, handed to its inline
replicas (`ReplicaContext.shared_models`): nothing process-wide.
"""

from __future__ import annotations

import threading
from typing import Any

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
