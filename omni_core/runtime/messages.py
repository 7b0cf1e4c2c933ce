"""Messages between the engine and stage workers (picklable; tensors travel through connectors)."""

from __future__ import annotations

from typing import Any

import attrs


class _Message:
    """Pickles as its class and field values.

    A message crosses a pipe twice on every stage hop; attrs' own pickling of a frozen class (a
    dict of field names, set back one by one) makes that several times dearer and larger.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return type(self), tuple([getattr(self, field.name) for field in self.__attrs_attrs__])  # type: ignore[attr-defined]


# -- engine -> worker ------------------------------------------------------------------------------


@attrs.frozen
class Submit(_Message):
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
class Abort(_Message):
    request_id: str


@attrs.frozen
class Ping(_Message):
    token: int


@attrs.frozen
class Shutdown(_Message):
    pass


# -- worker -> engine ------------------------------------------------------------------------------


@attrs.frozen
class Ready(_Message):
    pid: int


@attrs.frozen
class Progress(_Message):
    description: str
    fraction: float


@attrs.frozen
class LoadFailed(_Message):
    """The stage's runtime failed to load (the worker exits after this): why, for the user."""

    message: str


@attrs.frozen
class Emit(_Message):
    """A chunk left the stage: towards stage `target` or, when `target` is None, to the user."""

    request_id: str
    target: str | None
    index: int
    final: bool
    handle: Any


@attrs.frozen
class RequestFailed(_Message):
    """One request failed in this stage; `invalid` marks bad input (a client error), and `param`
    names the offending request field where the stage knows it."""

    request_id: str
    message: str
    invalid: bool = False
    param: str | None = None


@attrs.frozen
class StageFailed(_Message):
    """The stage's step raised: every request in `request_ids` failed; the runtime is reloading."""

    message: str
    request_ids: tuple[str, ...]


@attrs.frozen
class Pong(_Message):
    token: int
    active_requests: int
    stats: dict[str, Any] = attrs.field(factory=dict)
