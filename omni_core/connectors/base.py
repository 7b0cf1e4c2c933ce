"""The connector contract: move payloads between stage workers (threads, processes or nodes).

A connector is built from its options in every process that uses it (producer and consumer each
build their own instance from the same `ResolvedEdge`); only handles travel over the control
channel. Every connector passes the contract suite in `omni_core.testing.connector_contract`.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from omni_core.errors import ConnectorClosedError
from omni_core.outputs import Payload


class Connector(abc.ABC):
    """Moves payloads: ``put(payload) -> handle``, ``get(handle) -> payload``, ``release(handle)``.

    The rules, each checked by `omni_core.testing.connector_contract.ConnectorContract`:

    1. Built as ``Class(**options)`` from the edge's options (JSON-like values) in every process
       that uses it: the producer's and the consumer's instances share nothing but those options.
    2. Round trip: `get` returns a payload equal to what was `put`: the same container types
       (dict, list, tuple), every torch tensor and numpy array with its dtype (bfloat16 included),
       shape and values (non-contiguous, column-major, 0-d and empty ones too), and the other
       leaves (str, bytes, int, float, bool, None) as they were; payloads without tensors too,
       and a single tensor of 64 MiB (`large_bytes`).
    3. Handles are small and picklable: a handle put by one instance is got and released by
       another instance built from the same options, in another process (the consumer's). Each
       handle is got at most once and released exactly once, by the consumer; several handles
       may be outstanding, and each gives back its own payload.
    4. Tensors may come back as zero-copy views, valid until `release`; after it the storage may
       be reused.
    5. Capacity is bounded (where the options say so): `put` on a full connector blocks, and
       raises `ConnectorFullError` once `timeout` seconds passed (``None``: the connector's
       default, which is finite: the built-ins wait 60 s), not before; a `release` from any
       thread or process frees capacity and wakes a blocked `put`. At least one payload always
       fits. A stage releases a request's inputs when the request ends there (the payloads'
       tensors may be views its runtime still reads), so capacity must hold the chunks of every
       request in flight on the edge; a put that times out fails its request with this error.
    6. Safe for concurrent producers: several threads, and several processes, putting at once;
       and for concurrent consumers: several threads getting and releasing at once. (The engine
       calls `put`, `get` and `release` on threads of its own, never on its event loop: a call
       may block, as a full bounded `put` does, without stalling the server.)
    7. `close` frees what this instance owns and is idempotent; afterwards its `put` and `get`
       raise `ConnectorClosedError`, and the handles it put but nobody got fail with a
       `ConnectorError` in any instance, in any process (never garbage).

    A connector that reaches across hosts sets `host_local` to False (see there).

    `omni_core.connectors.serialize` splits a payload into its tensor bytes and a small pickled
    skeleton (`split_payload` / `join_payload`) for connectors that move bytes themselves, and
    `omni_core.connectors.capacity.SharedCapacity` is rule 5 across the processes of a host for
    connectors that keep payloads themselves.
    """

    closed: bool = False
    """Set by `close` (the base class's); see `check_open`."""

    host_local: ClassVar[bool] = True
    """Whether this connector only links processes of one host (shared memory, in-process queues).
    A connector that moves payloads between hosts sets False; `resolve()` refuses a host-local one
    on an edge whose ends may run on different hosts (`Replica.host`)."""

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

    def shared_options(self) -> dict[str, Any]:
        """The options every other instance on this edge is built with.

        The engine builds its instance of each connector first, before any stage starts, and gives
        the stages' workers (in threads, processes or on other hosts) what this returns instead of
        the deploy's options. A connector that sets something up for the edge when its options
        leave it open (a server it starts, an address it picked) returns the options naming it, so
        the others join it instead of each starting their own; this instance owns it and stops it
        in `close`. Default: the options it was built with.
        """
        return dict(self.options)

    def close(self) -> None:
        """Free everything this instance owns; idempotent (rule 7).

        The default marks the instance `closed`, which `check_open` then refuses. An override frees
        what the instance owns and calls ``super().close()``.
        """
        self.closed = True

    def check_open(self) -> None:
        """Raise `ConnectorClosedError` once `close` ran: `put` and `get` start with it (rule 7)."""
        if self.closed:
            raise ConnectorClosedError(f"this {type(self).__name__} is closed; create a new one")
