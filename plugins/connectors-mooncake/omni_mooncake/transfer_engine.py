"""`MooncakeTransferEngineConnector` ("mooncake-te"): consumers pull payloads from their producer's
registered memory with Mooncake's transfer engine (peer to peer, TCP or RDMA), across hosts.

Each instance runs a transfer engine (``P2PHANDSHAKE``: no metadata server, peers handshake
directly on its RPC port). A producer registers one pool of `pool_bytes`, cut into pages; `put`
claims a run of pages and copies the payload into it after a 64-byte header:

    [tag: uint64][released: uint64][reserved to 64 B][tensor bytes][skeleton, when not inline]

The handle names the producer's engine (``host:port``), the run's address, its tag and sizes.
`get` reads header and bytes with one ``transfer_sync_read`` into the consumer's own registered
buffer and checks the tag (a run reused since would carry another), then returns views of that
buffer. `release` writes the tag into the run's ``released`` word with one
``transfer_sync_write``: no message to the producer's process, which frees a run when it finds its
``released`` word equal to its tag. A stale or repeated release writes a tag that no longer
matches and frees nothing.

The producer looks for released runs when it needs pages, so a full `put` polls its own memory
with a bounded backoff (a release from a thread of this instance wakes it at once). Runs nobody
released within `ttl_s` are reclaimed (their consumer died): a later `get` of such a handle fails
on the tag, and views already got stay valid, since they live in the consumer's memory.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
import threading
import time
from typing import Any

import attrs
import numpy as np

from omni_core.connectors.base import Connector
from omni_core.connectors.serialize import TENSOR_ALIGNMENT
from omni_core.errors import ConfigError, ConnectorError, ConnectorFullError
from omni_core.outputs import Payload
from omni_mooncake.buffers import PageTable, Region, RegisteredArena, aligned_zeros
from omni_mooncake.layout import lay_out, read_payload, write_payload
from omni_mooncake.mooncake_bridge import error_name, import_transfer_engine
from omni_mooncake.net import resolve_host

log = logging.getLogger(__name__)

MIB = 1 << 20
HEADER_BYTES = 64
_TAG = 0  # uint64 word indexes in a run's header
_RELEASED = 1


@attrs.frozen
class TransferHandle:
    """A run at `address` in the pool of the engine `session` (``host:port``), stamped `tag`,
    holding `nbytes` after its header; the skeleton is `meta`, or ``meta_len`` bytes at
    `meta_offset` of those. A payload without tensor bytes has no run (``session == ""``)."""

    session: str
    address: int
    tag: int
    nbytes: int
    meta: bytes | None
    meta_offset: int = 0
    meta_len: int = 0

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return TransferHandle, (self.session, self.address, self.tag, self.nbytes, self.meta, self.meta_offset, self.meta_len)


@attrs.define
class _Run:
    pages: int
    tag: int
    since: float


class _ProducerPool:
    """The producer's registered pool: pages, the runs handed out, and reclaiming them.

    Only the producer turns pages from free to used and back; consumers only write a run's
    ``released`` word, so the page table needs no lock across processes.
    """

    def __init__(self, memory: np.ndarray, page_size: int, ttl_s: float) -> None:
        self.memory = memory
        # Header words through a memoryview: a read or write is a tenth of a numpy scalar's cost,
        # and every put and reclaim touches them.
        self.words = memoryview(memory).cast("Q")
        self.address = memory.ctypes.data
        self.page_size = page_size
        self.n_pages = memory.nbytes // page_size
        self.ttl_s = ttl_s
        self.table = PageTable(self.n_pages)
        self.runs: dict[int, _Run] = {}  # first page -> run
        self._tags = itertools.count(1)

    def try_claim(self, pages: int, now: float) -> tuple[int, int] | None:
        """Claim a run of `pages` (after reclaiming released and expired runs): ``(page, tag)``."""
        if self.runs:
            self.reclaim(now)
        page = self.table.claim(pages)
        if page is None:
            return None
        tag = next(self._tags)
        word = page * self.page_size // 8
        self.words[word + _RELEASED] = 0
        self.words[word + _TAG] = tag
        self.runs[page] = _Run(pages, tag, now)
        return page, tag

    def reclaim(self, now: float) -> None:
        expired = 0
        for page, run in list(self.runs.items()):
            word = page * self.page_size // 8
            if self.words[word + _RELEASED] != run.tag:
                if now - run.since < self.ttl_s:
                    continue
                expired += 1
            # The tag goes first: a get racing with this reads a header that no longer matches.
            self.words[word + _TAG] = 0
            self.table.free(page, run.pages)
            del self.runs[page]
        if expired:
            log.warning("mooncake-te: reclaimed %d payload(s) nobody released within ttl_s=%s s (their consumers died?)", expired, self.ttl_s)

    def release_local(self, address: int, tag: int) -> None:
        """What a consumer's remote write does, for a handle of this very instance."""
        word = (address - self.address) // 8
        if 0 <= word < len(self.words) - _RELEASED:
            self.words[word + _RELEASED] = tag

    def block(self, page: int, pages: int) -> np.ndarray:
        return self.memory[page * self.page_size : (page + pages) * self.page_size]


class MooncakeTransferEngineConnector(Connector):
    """Moves payloads peer to peer with Mooncake's transfer engine (TCP or RDMA), across hosts.

    Options:

    - `host`: the address this instance's engine listens on, reachable by its peers (default
      127.0.0.1; ``"auto"``: what this machine's hostname resolves to).
    - `pool_bytes`: registered memory a producer puts payloads in (default 1 GiB, allocated on
      first put, pages cost memory once written); a full `put` waits up to `put_timeout_s`
      (default 60) for releases.
    - `page_bytes`: the pool's allocation unit (default 64 KiB).
    - `buffer_bytes`: registered memory a consumer reads payloads into (default 256 MiB, on first
      get; larger payloads get a buffer of their own).
    - `ttl_s`: a payload nobody released within this many seconds is reclaimed (default 600).
    - `protocol` (``tcp`` or ``rdma``) and `device` (RDMA device names, e.g. ``"mlx5_0"``).
    - `inline_meta_bytes`: pickled non-tensor data up to this size travels in the handle.

    No master: the engines handshake directly (``P2PHANDSHAKE``).
    """

    host_local = False

    def __init__(
        self,
        host: str = "127.0.0.1",
        pool_bytes: int = 1 << 30,
        page_bytes: int = 64 << 10,
        buffer_bytes: int = 256 * MIB,
        put_timeout_s: float = 60.0,
        ttl_s: float = 600.0,
        protocol: str = "tcp",
        device: str = "",
        inline_meta_bytes: int = 64 << 10,
    ) -> None:
        super().__init__(
            host=host,
            pool_bytes=pool_bytes,
            page_bytes=page_bytes,
            buffer_bytes=buffer_bytes,
            put_timeout_s=put_timeout_s,
            ttl_s=ttl_s,
            protocol=protocol,
            device=device,
            inline_meta_bytes=inline_meta_bytes,
        )
        if page_bytes <= 0 or page_bytes % TENSOR_ALIGNMENT:
            raise ConfigError(f"must be a positive multiple of {TENSOR_ALIGNMENT}, got {page_bytes}", key="page_bytes")
        if pool_bytes < page_bytes:
            raise ConfigError(f"must hold at least one page ({page_bytes}), got {pool_bytes}", key="pool_bytes")
        if ttl_s <= 0:
            raise ConfigError(f"must be positive, got {ttl_s}", key="ttl_s")
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"must be 'tcp' or 'rdma', got {protocol!r}", key="protocol")
        engine_cls = import_transfer_engine()
        self._pool_bytes = pool_bytes
        self._page_bytes = page_bytes
        self._put_timeout_s = put_timeout_s
        self._ttl_s = ttl_s
        self._inline_meta_bytes = inline_meta_bytes
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._pool: _ProducerPool | None = None
        self._got: dict[tuple[str, int, int], Region] = {}  # (session, address, tag) -> the buffer its views live in
        address = resolve_host(host)
        self._engine = engine_cls()
        code = self._engine.initialize(address, "P2PHANDSHAKE", protocol, device)
        if code != 0:
            raise ConnectorError(
                f"Mooncake's transfer engine failed to start on {address} ({protocol}): {error_name(code)}; host must be "
                "an address of this machine"
            )
        self.session = f"{address}:{self._engine.get_rpc_port()}"
        """``host:port``: how peers reach this instance's engine (handles carry it)."""
        self._arena = RegisteredArena(buffer_bytes, page_bytes, self._engine.register_memory, self._engine.unregister_memory)

    # -- producer side -------------------------------------------------------------------------

    def put(self, payload: Payload, timeout: float | None = None) -> TransferHandle:
        self.check_open()
        layout = lay_out(payload, self._inline_meta_bytes)
        if layout.nbytes == 0:
            return TransferHandle("", 0, 0, 0, layout.meta)
        pool = self._own_pool()
        pages = math.ceil((HEADER_BYTES + layout.nbytes) / pool.page_size)
        if pages > pool.n_pages:
            raise ConnectorError(
                f"payload needs {layout.nbytes} bytes but the transfer engine pool holds {pool.n_pages * pool.page_size}: "
                "raise the connector option pool_bytes"
            )
        page, tag = self._claim(pool, pages, self._put_timeout_s if timeout is None else timeout)
        address = pool.address + page * pool.page_size
        try:
            write_payload(pool.block(page, pages)[HEADER_BYTES:], address + HEADER_BYTES, layout)
        except BaseException:
            with self._lock:
                pool.release_local(address, tag)
            raise
        return TransferHandle(self.session, address, tag, layout.nbytes, layout.meta, layout.meta_offset, layout.meta_len)

    def _own_pool(self) -> _ProducerPool:
        with self._lock:
            self.check_open()
            if self._pool is None:
                memory = aligned_zeros(self._pool_bytes // self._page_bytes * self._page_bytes)
                code = self._engine.register_memory(memory.ctypes.data, memory.nbytes)
                if code != 0:
                    raise ConnectorError(f"Mooncake's transfer engine failed to register a {memory.nbytes}-byte pool: {error_name(code)}")
                self._pool = _ProducerPool(memory, self._page_bytes, self._ttl_s)
            return self._pool

    def _claim(self, pool: _ProducerPool, pages: int, timeout: float) -> tuple[int, int]:
        with self._freed:
            self.check_open()
            now = time.monotonic()
            claimed = pool.try_claim(pages, now)
            if claimed is not None:  # the common case: one lock, one search
                return claimed
            deadline = now + timeout
            delay = 0.1e-3
            while True:
                self.check_open()
                now = time.monotonic()
                claimed = pool.try_claim(pages, now)
                if claimed is not None:
                    return claimed
                remaining = deadline - now
                if remaining <= 0:
                    raise ConnectorFullError(
                        f"the transfer engine pool ({pool.n_pages * pool.page_size} bytes) had no {pages} free pages for "
                        f"{timeout} s: consumers must release handles after get; or raise pool_bytes or put_timeout_s"
                    )
                # Consumers in other processes free pages by writing into the pool: nothing
                # signals that here, so this polls, backing off to 10 ms; a release by a thread
                # of this instance notifies at once.
                self._freed.wait(min(delay, remaining))
                delay = min(delay * 2, 0.01)

    # -- consumer side -------------------------------------------------------------------------

    def get(self, handle: TransferHandle) -> Payload:
        self.check_open()
        if not handle.session:
            return read_payload(None, handle.meta, 0, 0)
        region = self._arena.acquire(HEADER_BYTES + handle.nbytes)
        try:
            self._read(handle, region)
        except BaseException:
            self._arena.release(region)
            raise
        with self._lock:
            self._got[(handle.session, handle.address, handle.tag)] = region
        return read_payload(region.array[HEADER_BYTES : HEADER_BYTES + handle.nbytes], handle.meta, handle.meta_offset, handle.meta_len)

    def _read(self, handle: TransferHandle, region: Region) -> None:
        code = self._engine.transfer_sync_read(handle.session, region.ptr, handle.address, HEADER_BYTES + handle.nbytes)
        if code != 0:
            raise ConnectorError(
                f"reading a payload from the transfer engine at {handle.session} failed ({error_name(code)}): its "
                "producer's connector closed or its process exited"
            )
        tag = int.from_bytes(region.array[:8], sys.byteorder)  # the header's first word (native, as the producer wrote it)
        if tag != handle.tag:
            raise ConnectorError(
                f"the payload at {handle.session} (tag {handle.tag}) was released already, or reclaimed after ttl_s "
                "unreleased; get each handle once, before releasing it"
            )

    def release(self, handle: TransferHandle) -> None:
        """Mark the producer's run free (one remote write); a no-op after `close`."""
        if self.closed or not handle.session:
            return
        with self._lock:
            region = self._got.pop((handle.session, handle.address, handle.tag), None)
        if handle.session == self.session:
            with self._freed:
                if self._pool is not None:
                    self._pool.release_local(handle.address, handle.tag)
                self._freed.notify_all()
        else:
            self._write_released(handle, region)
        if region is not None:
            self._arena.release(region)

    def _write_released(self, handle: TransferHandle, region: Region | None) -> None:
        # A got handle's buffer starts with the header read from the producer, whose first
        # word is the tag: the source of the write, with no extra buffer.
        source = region if region is not None else self._arena.acquire(8)
        try:
            if region is None:
                source.array[:8] = np.frombuffer(handle.tag.to_bytes(8, sys.byteorder), dtype=np.uint8)
            code = self._engine.transfer_sync_write(handle.session, source.ptr, handle.address + 8 * _RELEASED, 8)
        finally:
            if region is None:
                self._arena.release(source)
        if code != 0:
            raise ConnectorError(
                f"releasing a payload at the transfer engine {handle.session} failed ({error_name(code)}): its producer's "
                "connector closed or its process exited (which freed it)"
            )

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister the pool (outstanding handles then fail everywhere) and buffers, and stop
        the engine; idempotent."""
        with self._freed:
            if self.closed:
                return
            super().close()  # put and get refuse from now on (check_open)
            pool, self._pool = self._pool, None
            self._got.clear()
            self._freed.notify_all()
        if pool is not None:
            self._engine.unregister_memory(pool.address)
        self._arena.close()
        # The engine has no close: dropping the last reference (the arena let go of its bound
        # methods) stops it here, 0-1 s with the GIL held while its handshake listener's 1 s
        # `accept` times out, rather than at some later garbage collection.
        self._engine = None
