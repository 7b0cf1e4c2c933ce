"""`InProcessConnector` ("inproc"): payloads pass by reference between threads of one process."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
import attrs

from omni_core.connectors.base import Connector
from omni_core.errors import ConnectorClosedError, ConnectorError, ConnectorFullError
from omni_core.outputs import Payload


@attrs.frozen
class InProcessHandle:
    """A payload's key in the store `store` of a producer connector in this process."""

    store: str
    key: int


class _Store:
    """A bounded dict of payloads; `put` waits on a condition while it is full."""

    def __init__(self, max_items: int) -> None:
        self.id = uuid.uuid4().hex
        self.max_items = max_items
        self.items: dict[int, Payload] = {}
        self.keys = itertools.count()
        self.changed = threading.Condition()
        self.closed = False


class InProcessConnector(Connector):
    """Moves payloads between threads of one process by reference (zero copy).

    Options: `max_items` (how many unreleased payloads the store holds before `put` blocks,
    default 1024) and `put_timeout_s` (how long `put` waits for room, default 60).
    Handles are only meaningful to this instance: both ends of an inline edge share it (the engine
    hands the same instance to its inline workers).
    """

    def __init__(self, max_items: int = 1024, put_timeout_s: float = 60.0) -> None:
        super().__init__(max_items=max_items, put_timeout_s=put_timeout_s)
        if max_items < 1:
            raise ConnectorError(f"max_items must be at least 1, got {max_items}")
        self._store = _Store(max_items)
        self._put_timeout_s = put_timeout_s
        self._closed = False

    def put(self, payload: Payload, timeout: float | None = None) -> InProcessHandle:
        self._check_open()
        store = self._store
        timeout = self._put_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with store.changed:
            while len(store.items) >= store.max_items and not store.closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectorFullError(
                        f"in-process connector held {store.max_items} unreleased payloads for {timeout} s: "
                        "consumers must release handles after get; or raise max_items or put_timeout_s"
                    )
                store.changed.wait(remaining)
            if store.closed:
                raise ConnectorClosedError("this in-process connector is closed; create a new one")
            key = next(store.keys)
            store.items[key] = payload
        return InProcessHandle(store.id, key)

    def get(self, handle: InProcessHandle) -> Payload:
        self._check_open()
        store = self._find(handle)
        with store.changed:
            try:
                return store.items[handle.key]
            except KeyError:
                raise self._unknown(handle) from None

    def release(self, handle: InProcessHandle) -> None:
        """Drop the store's reference to the payload; a no-op after `close`."""
        if self._closed:
            return
        store = self._find(handle)
        with store.changed:
            if store.items.pop(handle.key, None) is None:
                raise self._unknown(handle)
            store.changed.notify()

    def close(self) -> None:
        """Close this instance; a producer's close also drops its unreleased payloads."""
        self._closed = True
        super().close()
        store = self._store
        with store.changed:
            store.closed = True
            store.items.clear()
            store.changed.notify_all()

    def _find(self, handle: InProcessHandle) -> _Store:
        if handle.store != self._store.id:
            raise ConnectorError(
                "in-process handle belongs to another InProcessConnector instance: both ends of an "
                "in-process edge must share one instance"
            )
        if self._store.closed:
            raise ConnectorError("in-process handle belongs to a closed connector")
        return self._store

    @staticmethod
    def _unknown(handle: InProcessHandle) -> ConnectorError:
        return ConnectorError(f"in-process handle {handle.key} was released or never put; release each handle once")

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError("this in-process connector is closed; create a new one")

