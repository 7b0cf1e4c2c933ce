"""`MooncakeStoreConnector` ("mooncake-store"): payloads as objects of a Mooncake distributed store.

Every instance is a store client: it joins the master named by ``master`` and, at its first put,
mounts a segment of `segment_bytes` (the memory where objects live, served to other hosts by its
transfer engine). An instance that only gets never mounts one: Mooncake starts a client's
heartbeat and task threads with its first segment, and joining them (they sleep 1 s at a time)
is most of what its close costs.
`put` copies the payload's tensor bytes into a registered staging area and writes them with one
zero-copy ``put_from`` under a fresh key, preferring its own segment (so the bytes stay with their
producer until a consumer pulls them, and vanish with it); a payload that is one large contiguous
tensor skips the staging copy (its memory is registered for the call). The handle carries the
key and the small pickled skeleton. `get` pulls the object with one ``get_into`` into a registered buffer of
the consumer and returns views of it, valid until `release`, which removes the object.

Capacity. The store's own limit is the sum of mounted segments, shared by every client, so it
cannot give one edge backpressure. Each instance therefore bounds the bytes it put and nobody
removed yet (`capacity_bytes`, like the shared-memory pool per producer). A consumer's release
in another process frees that capacity in the master only, so a full producer asks the master
which of its keys are gone (``batch_is_exist``), with a bounded backoff; a release in the same
instance wakes it at once.

Embedded default: without ``master`` the instance starts a ``mooncake_master`` on free ports of
127.0.0.1 (`MooncakeMaster`), returns its address from `shared_options` so every other instance
on the edge joins it, and stops it in `close`.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
import uuid
from typing import Any

import attrs
import numpy as np

from omni_core.connectors.base import Connector
from omni_core.errors import ConfigError, ConnectorError, ConnectorFullError
from omni_core.outputs import Payload
from omni_mooncake.buffers import Region, RegisteredArena
from omni_mooncake.layout import (
    PayloadLayout,
    lay_out,
    plain_bytes,
    read_payload,
    write_payload,
)
from omni_mooncake.master import MooncakeMaster
from omni_mooncake.mooncake_bridge import (
    LEASE_EXPIRED,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    error_name,
    import_store,
)
from omni_mooncake.net import port_open, resolve_host, sleep_backoff, split_address

MIB = 1 << 20
_CLIENT_BUFFER_BYTES = 16 * MIB
"""The client's own transfer buffer (for Mooncake's copying calls, unused here); 16 MiB is its minimum."""
_MIN_SEGMENT_BYTES = 16 * MIB
_RELEASE_RETRY_S = 5.0
_LEASE_RETRIES = 2
_ARENA_PAGE_BYTES = 64 << 10
_DIRECT_PUT_BYTES = 1 * MIB
"""From this size a payload of one contiguous CPU tensor is put from its own memory, registered
for the call (tens of microseconds), instead of being copied into the staging area first."""


@attrs.frozen
class StoreHandle:
    """Object `key` of `nbytes` in the store; the skeleton is `meta`, or ``meta_len`` bytes at
    `meta_offset` of the object. A payload without tensor bytes has no object (``key == ""``)."""

    key: str
    nbytes: int
    meta: bytes | None
    meta_offset: int = 0
    meta_len: int = 0

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # Field values only: a handle rides in a pipe message on every hop (see ShmHandle).
        return StoreHandle, (self.key, self.nbytes, self.meta, self.meta_offset, self.meta_len)


def _direct_address(layout: PayloadLayout) -> int | None:
    """The address of the payload's bytes when they are one large contiguous CPU tensor (or
    numpy array) that is the whole object; None when they must be staged."""
    if layout.meta is None or len(layout.split.tensors) != 1 or layout.nbytes < _DIRECT_PUT_BYTES:
        return None
    tensor = layout.split.tensors[0]
    if isinstance(tensor, np.ndarray):
        return int(tensor.ctypes.data) if tensor.flags.c_contiguous else None
    if not plain_bytes(tensor):
        return None
    return int(tensor.data_ptr())


class MooncakeStoreConnector(Connector):
    """Moves payloads through a Mooncake distributed store (TCP or RDMA), across hosts.

    Options:

    - `master`: ``HOST:PORT`` of a running ``mooncake_master``; unset, this instance starts one on
      127.0.0.1 and shares its address with the edge's other instances (`shared_options`).
    - `host`: the address this client serves its segment on, reachable by the other clients
      (default 127.0.0.1; ``"auto"``: what this machine's hostname resolves to).
    - `capacity_bytes`: how many bytes this instance may have in the store, put but not yet
      released (default 1 GiB); a full `put` waits up to `put_timeout_s` (default 60).
    - `segment_bytes`: memory this client mounts into the store (default `capacity_bytes` plus
      1/8, at least 16 MiB; allocated lazily by the OS, so unused space costs little).
    - `buffer_bytes`: registered memory for staging puts and receiving gets (default 256 MiB,
      allocated on first use; larger payloads get a buffer of their own).
    - `get_timeout_s`: how long `get` waits for an object that is not (or no longer) in the store
      before it fails naming the key (default 2).
    - `connect_timeout_s`: how long joining the master may take (default 10).
    - `protocol` (``tcp`` or ``rdma``) and `rdma_devices` (e.g. ``"mlx5_0,mlx5_1"``).
    - `inline_meta_bytes`: pickled non-tensor data up to this size travels in the handle.
    """

    host_local = False

    def __init__(
        self,
        master: str | None = None,
        host: str = "127.0.0.1",
        capacity_bytes: int = 1 << 30,
        segment_bytes: int | None = None,
        buffer_bytes: int = 256 * MIB,
        put_timeout_s: float = 60.0,
        get_timeout_s: float = 2.0,
        connect_timeout_s: float = 10.0,
        protocol: str = "tcp",
        rdma_devices: str = "",
        inline_meta_bytes: int = 64 << 10,
    ) -> None:
        super().__init__(
            master=master,
            host=host,
            capacity_bytes=capacity_bytes,
            segment_bytes=segment_bytes,
            buffer_bytes=buffer_bytes,
            put_timeout_s=put_timeout_s,
            get_timeout_s=get_timeout_s,
            connect_timeout_s=connect_timeout_s,
            protocol=protocol,
            rdma_devices=rdma_devices,
            inline_meta_bytes=inline_meta_bytes,
        )
        if capacity_bytes <= 0:
            raise ConfigError(f"must be positive, got {capacity_bytes}", key="capacity_bytes")
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"must be 'tcp' or 'rdma', got {protocol!r}", key="protocol")
        store_cls, replicate_config_cls = import_store()
        self._capacity_bytes = capacity_bytes
        self._put_timeout_s = put_timeout_s
        self._get_timeout_s = get_timeout_s
        self._inline_meta_bytes = inline_meta_bytes
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._outstanding: dict[str, int] = {}  # keys this instance put and nobody released -> bytes
        self._used = 0  # bytes of `_outstanding` plus puts in flight
        self._got: dict[str, Region] = {}  # keys got here -> the buffer their views live in
        self._direct: dict[int, int] = {}  # tensor addresses registered for direct puts -> puts using them
        self._prefix = f"omni/{uuid.uuid4().hex[:16]}/"
        self._counter = itertools.count()
        self._segment_bytes = max(_MIN_SEGMENT_BYTES, segment_bytes or capacity_bytes + capacity_bytes // 8)
        self._protocol = protocol
        self._segment_mounted = False
        self._master: MooncakeMaster | None = None
        if master is None:
            self._master = MooncakeMaster()
            master = self._master.address
        try:
            self._master_address = master
            self._store = self._join(store_cls(), master, resolve_host(host), connect_timeout_s, protocol, rdma_devices)
        except BaseException:
            if self._master is not None:
                self._master.stop()
            raise
        self._arena = RegisteredArena(buffer_bytes, _ARENA_PAGE_BYTES, self._store.register_buffer, self._store.unregister_buffer)
        self._config = replicate_config_cls()
        # Hard-pinned objects are never evicted: an object is a payload a consumer has yet to
        # get, not a cache entry. The own segment first keeps the bytes with their producer.
        self._config.with_hard_pin = True
        self._config.preferred_segment = self._store.get_hostname()

    def _join(self, store: Any, master: str, host: str, timeout: float, protocol: str, devices: str) -> Any:
        master_host, master_port = split_address(master, "master")
        # Mooncake's setup retries an unreachable master for about 90 s: check it answers first.
        deadline = time.monotonic() + timeout
        delay = 0.01
        while not port_open(master_host, master_port):
            if time.monotonic() >= deadline:
                raise ConnectorError(
                    f"no Mooncake master answers at {master} (waited {timeout} s): start one "
                    f"(mooncake_master --rpc_address={master_host} --rpc_port={master_port}) or leave the option "
                    "master unset so that the engine's instance starts one"
                )
            delay = sleep_backoff(delay, deadline, 0.2)
        # No segment yet (size 0): the first put mounts it (`_mount_segment`).
        code = store.setup(host, "P2PHANDSHAKE", 0, _CLIENT_BUFFER_BYTES, protocol, devices, master)
        if code != 0:
            raise ConnectorError(
                f"joining the Mooncake master at {master} as {host} failed: {error_name(code)}; check that host is "
                "this machine's address as the other clients reach it"
            )
        return store

    def _mount_segment(self) -> None:
        """Mount this client's segment, once (the first put; a consumer never needs one)."""
        with self._lock:
            if self._segment_mounted:
                return
            result = self._store.allocate_and_mount_segment(self._segment_bytes, self._protocol, "")
            code = int(result.get("ret", -1)) if isinstance(result, dict) else -1
            if code != 0:
                raise ConnectorError(
                    f"Mooncake failed to mount a segment of {self._segment_bytes} bytes ({error_name(code)}): check "
                    "that segment_bytes fits in memory"
                )
            self._segment_mounted = True

    def shared_options(self) -> dict[str, Any]:
        """The options, naming the master this instance started (when it started one)."""
        return {**self.options, "master": self._master_address}

    @property
    def master_address(self) -> str:
        """``HOST:PORT`` of the master this instance joined (or started)."""
        return self._master_address

    # -- producer side -------------------------------------------------------------------------

    def put(self, payload: Payload, timeout: float | None = None) -> StoreHandle:
        self.check_open()
        layout = lay_out(payload, self._inline_meta_bytes)
        if layout.nbytes == 0:
            return StoreHandle("", 0, layout.meta)
        if layout.nbytes > self._capacity_bytes:
            raise ConnectorError(
                f"payload needs {layout.nbytes} bytes but this Mooncake store connector may hold {self._capacity_bytes}: "
                "raise the connector option capacity_bytes"
            )
        deadline = time.monotonic() + (self._put_timeout_s if timeout is None else timeout)
        self._reserve(layout.nbytes, deadline)
        key = f"{self._prefix}{next(self._counter)}"
        try:
            if not self._segment_mounted:
                self._mount_segment()
            address = _direct_address(layout)
            if address is not None:
                self._put_direct(key, address, layout.nbytes, deadline)
            else:
                region = self._arena.acquire(layout.nbytes)
                try:
                    write_payload(region.array, region.ptr, layout)
                    self._put_from(key, region.ptr, layout.nbytes, deadline)
                finally:
                    self._arena.release(region)
        except BaseException:
            with self._freed:
                self._used -= layout.nbytes
                self._freed.notify_all()
            raise
        with self._lock:
            self._outstanding[key] = layout.nbytes
        return StoreHandle(key, layout.nbytes, layout.meta, layout.meta_offset, layout.meta_len)

    def _reserve(self, nbytes: int, deadline: float) -> None:
        """Count `nbytes` against `capacity_bytes`, waiting for releases until `deadline`."""
        delay = 0.5e-3
        while True:
            with self._lock:
                self.check_open()
                if self._used + nbytes <= self._capacity_bytes:
                    self._used += nbytes
                    return
                keys = list(self._outstanding)
            gone = self._released_elsewhere(keys)
            with self._freed:
                for key in gone:
                    self._used -= self._outstanding.pop(key, 0)
                if self._used + nbytes <= self._capacity_bytes:
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectorFullError(
                        f"this Mooncake store connector holds {self._used} of its capacity_bytes ({self._capacity_bytes}) "
                        "in payloads nobody released: consumers must release handles after get; or raise "
                        "capacity_bytes or put_timeout_s"
                    )
                self._freed.wait(min(delay, remaining))  # a release here wakes it at once
            delay = min(delay * 2, 0.02)

    def _released_elsewhere(self, keys: list[str]) -> list[str]:
        """Those of `keys` the master no longer has: released by a consumer in another process."""
        if not keys:
            return []
        exists = self._store.batch_is_exist(keys)
        return [key for key, flag in zip(keys, exists) if flag == 0]

    def _put_direct(self, key: str, address: int, nbytes: int, deadline: float) -> None:
        """``put_from`` the tensor's own memory: the store copies it before the call returns, so
        the caller may change the tensor afterwards, as with a staged put. Registrations are
        counted per address, since two threads may put the same tensor at once."""
        with self._lock:
            count = self._direct.get(address, 0)
            self._direct[address] = count + 1
        try:
            if count == 0:
                code = self._store.register_buffer(address, nbytes)
                if code != 0:
                    raise ConnectorError(f"Mooncake failed to register a tensor of {nbytes} bytes: {error_name(code)}")
            self._put_from(key, address, nbytes, deadline)
        finally:
            with self._lock:
                self._direct[address] -= 1
                last = self._direct[address] == 0
                if last:
                    del self._direct[address]
            if last:
                self._store.unregister_buffer(address)

    def _put_from(self, key: str, address: int, nbytes: int, deadline: float) -> None:
        delay = 1e-3
        while (code := self._store.put_from(key, address, nbytes, self._config)) == NO_AVAILABLE_HANDLE:
            # Every segment is full (other producers' objects): the store's own backpressure.
            if time.monotonic() >= deadline:
                raise ConnectorFullError(
                    f"the Mooncake store at {self._master_address} has no room for {nbytes} bytes: consumers must "
                    "release handles after get; or mount more memory (raise segment_bytes)"
                )
            delay = sleep_backoff(delay, deadline, 0.05)
        if code != 0:
            raise ConnectorError(f"Mooncake put_from of {key} ({nbytes} bytes) failed: {error_name(code)}")

    # -- consumer side -------------------------------------------------------------------------

    def get(self, handle: StoreHandle) -> Payload:
        self.check_open()
        if not handle.key:
            return read_payload(None, handle.meta, 0, 0)
        region = self._arena.acquire(handle.nbytes)
        try:
            self._get_into(handle, region)
        except BaseException:
            self._arena.release(region)
            raise
        with self._lock:
            self._got[handle.key] = region
        return read_payload(region.array, handle.meta, handle.meta_offset, handle.meta_len)

    def _get_into(self, handle: StoreHandle, region: Region) -> None:
        """Read the object into `region`, waiting up to `get_timeout_s` for it to exist.

        A handle is made after its object is complete, so a missing object is normally gone for
        good; the wait covers a master that lags behind its clients (failover, a restart), with
        a backoff that asks the master a few dozen times rather than every few milliseconds.
        """
        deadline = time.monotonic() + self._get_timeout_s
        delay = 1e-3
        expired = 0
        while True:
            code = self._store.get_into(handle.key, region.ptr, handle.nbytes)
            if code == LEASE_EXPIRED and expired < _LEASE_RETRIES:
                # The read outlasted its lease; the object stays (hard-pinned, removed only by
                # its release), and a second read, into pages now faulted in, is faster.
                expired += 1
                continue
            if code != OBJECT_NOT_FOUND:
                break
            self.check_open()
            if time.monotonic() >= deadline:
                raise ConnectorError(
                    f"object {handle.key!r} is not in the Mooncake store at {self._master_address} (waited "
                    f"{self._get_timeout_s} s): it was released already, its producer's connector closed, or the master "
                    "restarted; get each handle once, before releasing it (or raise get_timeout_s)"
                )
            delay = sleep_backoff(delay, deadline, 0.05)
        if code != handle.nbytes:
            raise ConnectorError(f"Mooncake get_into of {handle.key!r} returned {error_name(code)}, expected {handle.nbytes} bytes")

    def release(self, handle: StoreHandle) -> None:
        """Remove the object of `handle`; a no-op after `close` (closing let go of everything)."""
        if self.closed or not handle.key:
            return
        with self._lock:
            region = self._got.pop(handle.key, None)
        if region is not None:
            self._arena.release(region)
        self._remove(handle.key)
        with self._freed:
            if handle.key in self._outstanding:
                self._used -= self._outstanding.pop(handle.key)
                self._freed.notify_all()

    def _remove(self, key: str) -> None:
        # With force: the single consumer has its copy, and the read lease its get_into took
        # would otherwise make the remove fail (OBJECT_HAS_LEASE) for the lease's whole TTL.
        # Other failures (an RPC to a busy master) are retried with a bounded backoff.
        deadline = time.monotonic() + _RELEASE_RETRY_S
        delay = 1e-3
        while (code := self._store.remove(key, True)) != 0:
            if code == OBJECT_NOT_FOUND:
                raise ConnectorError(
                    f"object {key!r} is not in the Mooncake store at {self._master_address}: it was released already or "
                    "its producer's connector closed; release each handle exactly once"
                )
            if time.monotonic() >= deadline:
                raise ConnectorError(f"Mooncake remove of {key!r} failed for {_RELEASE_RETRY_S} s: {error_name(code)}")
            delay = sleep_backoff(delay, deadline, 0.1)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the objects this instance put that nobody released, leave the store, and stop the
        master this instance started (if it did); idempotent.

        Leaving takes Mooncake up to 1-2 s with the GIL held (its binding does not release it, so a
        thread of its own would not spare the caller's process that time): it joins threads that
        sleep a fixed 1 s between rounds, the P2P handshake listener (0-1 s) and, once a segment
        is mounted, the client's heartbeat and task threads (0-2 s more); hence the segment is
        mounted by the first put only, and a consumer's instance closes in under 1 s.
        """
        with self._freed:
            if self.closed:
                return
            super().close()  # put and get refuse from now on (check_open)
            self._outstanding.clear()
            self._got.clear()
            self._freed.notify_all()
        try:
            # One call for every key of this instance: their handles now fail everywhere.
            self._store.remove_by_regex(f"^{re.escape(self._prefix)}", True)
            self._arena.close()
            self._store.close()
        finally:
            if self._master is not None:
                self._master.stop()
