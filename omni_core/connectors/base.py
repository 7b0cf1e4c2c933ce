"""The connector contract: move payloads between stage workers (threads, processes or nodes).

A connector is built from its options in every process that uses it (producer and consumer each
build their own instance from the same `ResolvedEdge`); only handles travel over the control
channel. Every connector passes the contract suite in `omni_core.testing.connector_contract`.
"""

from __future__ import annotations

import abc
from typing import Any

from omni_core.outputs import Payload


class Connector(abc.ABC):
    """Moves payloads: ``put(payload) -> handle``, ``get(handle) -> payload``, ``release(handle)``.

    - Handles are small and picklable; a handle is got at most once and released exactly once by
      the consumer, after which its storage may be reused.
    - Tensors (torch or numpy) may come back as zero-copy views valid until `release`.
    - Capacity is bounded: `put` blocks while full and raises `ConnectorFullError` after
      `timeout` seconds (``None``: the connector's default).
    - Safe for concurrent producers (threads and processes).
    """

    def __init__(self, **options: Any) -> None:
        self.options = options

    @abc.abstractmethod
    def put(self, payload: Payload, timeout: float | None = None) -> Any:
        """Store `payload` and return a handle for `get`."""

    @abc.abstractmethod
    def get(self, handle: Any) -> Payload:
        """Return the payload of `handle`."""

    @abc.abstractmethod
    def release(self, handle: Any) -> None:
        """Free the storage of `handle` (views returned by `get` become invalid)."""

    def close(self) -> None:
        """Free everything this instance owns."""
