"""Messages between the engine and stage workers (picklable; tensors travel through connectors)."""

from __future__ import annotations

from typing import Any

import attrs

# -- engine -> worker ------------------------------------------------------------------------------


@attrs.frozen
class Submit:
    """Input for a request: from the request (`source` = ``"request"``) or an upstream edge.

    The first `Submit` of a request carries `params` (merged per-stage parameters) and the routing
    of its outputs: `targets` (downstream stages active for this request) and `emit_output`.
    """

    request_id: str
    source: str
    index: int
    final: bool
    handle: Any
    params: dict[str, Any] | None = None
    targets: tuple[str, ...] = ()
    emit_output: bool = False


@attrs.frozen
class Abort:
    request_id: str


@attrs.frozen
class Ping:
    token: int


@attrs.frozen
class Shutdown:
    pass


# -- worker -> engine ------------------------------------------------------------------------------


@attrs.frozen
class Ready:
    pid: int


@attrs.frozen
class Progress:
    description: str
    fraction: float


@attrs.frozen
class Emit:
    """A chunk left the stage: towards stage `target` or, when `target` is None, to the user."""

    request_id: str
    target: str | None
    index: int
    final: bool
    handle: Any


@attrs.frozen
class RequestFailed:
    """One request failed in this stage; `invalid` marks bad input (a client error)."""

    request_id: str
    message: str
    invalid: bool = False


@attrs.frozen
class StageFailed:
    """The stage's step raised: every request in `request_ids` failed; the runtime is reloading."""

    message: str
    request_ids: tuple[str, ...]


@attrs.frozen
class Pong:
    token: int
    active_requests: int
    stats: dict[str, Any] = attrs.field(factory=dict)
