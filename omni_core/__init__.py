"""Omni: serve omni-modality models by chaining AR, generation and diffusion stages.

Importing this package is cheap (no torch, no vLLM); the engine classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_core.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "Omni", "AsyncOmni", "AsyncOmniEngine", "__version__"]

if TYPE_CHECKING:
    from omni_core.engine.async_engine import AsyncOmniEngine
    from omni_core.engine.offline import AsyncOmni, Omni


def __getattr__(name: str) -> Any:
    if name in ("Omni", "AsyncOmni"):
        from omni_core.engine import offline

        return getattr(offline, name)
    if name == "AsyncOmniEngine":
        from omni_core.engine.async_engine import AsyncOmniEngine

        return AsyncOmniEngine
    raise AttributeError(name)
