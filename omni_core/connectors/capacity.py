"""`SharedCapacity`: a bounded budget of bytes and payloads, shared by the processes of one host.

Rule 5 of `Connector` is the part of a bounded connector that is easy to get wrong: `put` waits
while the budget is spent and raises `ConnectorFullError` once its timeout passed (not before); a
`release` in any thread *or process* frees room and wakes a waiting `put`; one payload always fits.
A connector that keeps payloads itself (files, a store) builds one `SharedCapacity` per instance
from its options, `acquire`s before storing a payload and `release`s when a payload's storage is
freed, in whichever process that happens.

Every instance opened on the same `path` shares one budget: its usage lives in that small file,
changed under an exclusive `flock` (other processes) and a lock (other threads). A release through
the same instance wakes a waiting `acquire` at once; releases through other instances, in other
processes, cannot signal a thread here, so a waiting `acquire` also looks again after a backoff
growing from 50 us to 5 ms. Usage that a
crashed process never released stays counted until the file is removed: start from a fresh path
(or delete the file) when nothing is in flight.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from pathlib import Path

from omni_core.errors import ConnectorClosedError, ConnectorError, ConnectorFullError

_USAGE = struct.Struct("<qq")  # bytes, payloads


class SharedCapacity:
    """A budget of `max_bytes` bytes and `max_items` payloads (``None``: unlimited) kept in the
    file `path`, shared with every `SharedCapacity` of any process on this host opened on it.

    `what` names the connector in errors (``"file connector at /data/omni"``).
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int | None = None, max_items: int | None = None, what: str = "connector") -> None:
        for name, limit in (("max_bytes", max_bytes), ("max_items", max_items)):
            if limit is not None and limit < 1:
                raise ConnectorError(f"{what}: {name} must be at least 1 (or unset for no limit), got {limit}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.what = what
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._changed = threading.Condition()

    def acquire(self, nbytes: int, timeout: float) -> None:
        """Take room for a payload of `nbytes` bytes, waiting up to `timeout` seconds for it.

        Raises `ConnectorFullError` when there was no room for `timeout` seconds; a payload larger
        than the whole budget still fits once nothing else is held (one payload always fits).
        """
        deadline = time.monotonic() + timeout
        delay = 50e-6
        with self._changed:
            while True:
                with self._locked() as fd:
                    used_bytes, used_items = self._read(fd)
                    if used_items == 0 or self._fits(used_bytes + nbytes, used_items + 1):
                        os.pwrite(fd, _USAGE.pack(used_bytes + nbytes, used_items + 1), 0)
                        return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectorFullError(
                        f"{self.what} held {used_bytes} bytes in {used_items} payloads (max_bytes {self.max_bytes}, "
                        f"max_items {self.max_items}) for {timeout} s: consumers must release handles after get; "
                        "or raise the capacity or the put timeout"
                    )
                self._changed.wait(min(delay, remaining))
                delay = min(delay * 2, 5e-3)

    def release(self, nbytes: int) -> None:
        """Give back the room of one payload of `nbytes` bytes (from any process); a no-op after `close`."""
        with self._changed:
            if self._fd is None:
                return
            with self._locked() as fd:
                used_bytes, used_items = self._read(fd)
                os.pwrite(fd, _USAGE.pack(max(used_bytes - nbytes, 0), max(used_items - 1, 0)), 0)
            self._changed.notify_all()

    def usage(self) -> tuple[int, int]:
        """Bytes and payloads held now, across processes."""
        with self._changed, self._locked() as fd:
            return self._read(fd)

    def close(self) -> None:
        """Close the file (idempotent); the budget lives on for the other instances. An `acquire`
        waiting in another thread raises `ConnectorClosedError`."""
        with self._changed:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._changed.notify_all()  # a waiting `acquire` raises `ConnectorClosedError` now

    def _fits(self, used_bytes: int, used_items: int) -> bool:
        return (self.max_bytes is None or used_bytes <= self.max_bytes) and (self.max_items is None or used_items <= self.max_items)

    def _locked(self) -> _FileLock:
        if self._fd is None:
            raise ConnectorClosedError(f"{self.what}: its capacity was closed; create a new connector")
        return _FileLock(self._fd)

    @staticmethod
    def _read(fd: int) -> tuple[int, int]:
        raw = os.pread(fd, _USAGE.size, 0)
        return _USAGE.unpack(raw) if len(raw) == _USAGE.size else (0, 0)  # a new file: nothing held


class _FileLock:
    """``with _FileLock(fd) as fd:`` holds an exclusive `flock` on `fd` (other processes wait)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> int:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
