"""Connectors move stage payloads between threads, processes and nodes (see `base.Connector`).

Built-ins: ``inproc`` (`inproc.InProcessConnector`) and ``shm`` (`shm.SharedMemoryConnector`);
plugins add more through the ``register_connectors`` hook. Modules are imported on use only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_core.connectors.base import Connector
from omni_core.errors import ConfigError, ConnectorError
from omni_core.refs import accepted_keywords, load_ref


def create_connector(ref_or_cls: str | type[Connector], options: Mapping[str, Any] | None = None, where: str = "connector") -> Connector:
    """Build a connector from a ``"module:Class"`` reference (or the class) and its options.

    Producer and consumer processes call this with the same arguments (a `ResolvedEdge`'s
    ``connector_ref`` and ``connector_options``). `where` names the edge in errors: unknown options
    and a constructor that fails become a `ConfigError` saying which edge and connector.
    """
    cls = load_ref(ref_or_cls) if isinstance(ref_or_cls, str) else ref_or_cls
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise ConfigError(f"{ref_or_cls!r} is not a Connector subclass", key=where)
    options = dict(options or {})
    known = accepted_keywords(cls)
    unknown = sorted(set(options) - set(known)) if known is not None else []
    if unknown:
        raise ConfigError(f"{cls.__name__} takes no option(s) {unknown}; accepted: {', '.join(known or []) or 'none'}", key=where)
    try:
        return cls(**options)
    except ConnectorError:
        raise
    except Exception as exc:  # a plugin's constructor: say which edge, not only what failed
        raise ConfigError(f"{cls.__name__}({options}) failed: {type(exc).__name__}: {exc}", key=where) from exc


__all__ = ["Connector", "create_connector"]
