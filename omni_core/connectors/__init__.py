"""Connectors move stage payloads between threads, processes and nodes (see `base.Connector`).

Built-ins: ``inproc`` (`inproc.InProcessConnector`) and ``shm`` (`shm.SharedMemoryConnector`);
plugins add more through the ``register_connectors`` hook. Modules are imported on use only.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from omni_core.connectors.base import Connector
from omni_core.errors import ConfigError
from omni_core.refs import load_ref


def create_connector(ref_or_cls: str | type[Connector], options: Mapping[str, Any] | None = None) -> Connector:
    """Build a connector from a ``"module:Class"`` reference (or the class) and its options.

    Producer and consumer processes call this with the same arguments (e.g. a `ResolvedEdge`'s
    ``connector_ref`` and ``connector_options``); unknown options become a `ConfigError`.
    """
    cls = load_ref(ref_or_cls) if isinstance(ref_or_cls, str) else ref_or_cls
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise ConfigError(f"{ref_or_cls!r} is not a Connector subclass", key="connector")
    options = dict(options or {})
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as exc:
        accepted = [name for name in inspect.signature(cls).parameters if name not in ("self", "options")]
        raise ConfigError(
            f"invalid options for {cls.__name__}: {exc}; accepted options: {', '.join(accepted) or 'none'}",
            key="connector_options",
        ) from None
    return cls(**options)


__all__ = ["Connector", "create_connector"]
