"""`SharedMemoryConnector` ("shm"): tensors cross processes through one memcpy into a shared pool.

Each producer process lazily creates its own pool: one sparse file in ``/dev/shm`` (or the temp
directory), mapped with mmap. The file starts with a header and a page table shared by every
process that maps it:

    [header 64 B][tag per page: uint64][state per page: uint8][pad to a page][data pages ...]

`put` (producer only, under a thread lock) finds a run of free pages, marks it used, stamps the
run's first page with a fresh tag and copies the tensor bytes into it; the rest of the payload is
pickled into the handle (or into the run when large). `get` in any process maps the pool once
(cached by path) and returns zero-copy views. `release` in any process checks the tag and marks the
pages free, which is all the producer needs to reuse them. Only the producer turns pages from free
to used and only the holder of a handle turns them back, so the table needs no cross-process lock.

Why not `multiprocessing.shared_memory`: its resource tracker unlinks segments when a *consumer*
process exits, which breaks the producer's pool.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
import struct
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any

import attrs
import numpy as np

from omni_core.connectors.base import Connector
from omni_core.connectors.serialize import TENSOR_ALIGNMENT, align_up, copy_tensor_into, join_payload, split_payload
from omni_core.errors import ConnectorClosedError, ConnectorError, ConnectorFullError
from omni_core.outputs import Payload

logger = logging.getLogger(__name__)

_MAGIC = b"OMNISHM1"
_HEADER = struct.Struct("<8sQQQ")  # magic, page_size, n_pages, data_offset
_HEADER_BYTES = 64
_FREE = 0
_USED = 1
_EMPTY_BLOCK = np.empty(0, dtype=np.uint8)


@attrs.frozen
class ShmHandle:
    """Where a payload lies: a run of `pages` pages from `page` in the pool file `pool`.

    `tag` guards against use after release (the pool stamps each run with a fresh tag). The pickled
    rest of the payload is `meta` when small, else ``meta_len`` bytes at `meta_offset` of the run.
    A payload without tensor bytes has ``pages == 0`` and no pool.
    """

    pool: str
    page: int
    pages: int
    tag: int
    meta: bytes | None
    meta_offset: int = 0
    meta_len: int = 0

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # Field values only: a handle rides in a pipe message on every hop, and attrs' pickling of
        # a frozen class (field names, then a setattr each) costs several times more.
        return ShmHandle, (self.pool, self.page, self.pages, self.tag, self.meta, self.meta_offset, self.meta_len)


_POOL_PREFIX = "omni-shm-"
_POOL_NAME = re.compile(r"omni-shm-(\d+)-(\d+)-[0-9a-f]{12}")  # pid, pid namespace, random


def _pid_namespace() -> int:
    """This process's pid namespace (its inode): a pid means something only inside it (two
    containers may share /dev/shm, each with its own pids)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def remove_dead_pools(directory: str) -> list[str]:
    """Unlink the pool files in `directory` whose creating process is gone, and return their paths.

    A producer killed by a signal (a crashed stage worker, a SIGKILLed server) never unlinks its
    pool, and the pages it wrote hold memory until the file goes. Only pools of this user, made in
    this pid namespace, by a process that no longer exists are removed; consumers that mapped one
    keep their mapping. Each process sweeps once, when it creates its own pool.
    """
    removed: list[str] = []
    try:
        names = [name for name in os.listdir(directory) if name.startswith(_POOL_PREFIX)]
    except OSError:
        return removed
    namespace, uid = _pid_namespace(), os.getuid()
    for name in names:
        match = _POOL_NAME.fullmatch(name)
        if match is None or int(match.group(2)) != namespace:
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _unlink_quietly(path)
            removed.append(path)
        except OSError:  # the process exists (another user's), or the file went meanwhile
            continue
    return removed


def _unlink_quietly(path: str, owner_pid: int | None = None) -> None:
    # A forked child inherits the owner's finalizer; only the creating process may unlink.
    if owner_pid is not None and os.getpid() != owner_pid:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Pool:
    """One mapped pool file: its page table and data area as numpy views of the mapping."""

    def __init__(self, path: str, mapping: mmap.mmap, owner: bool) -> None:
        magic, page_size, n_pages, data_offset = _HEADER.unpack_from(mapping, 0)
        if magic != _MAGIC:
            raise ConnectorError(f"{path} is not an Omni shared-memory pool (bad magic {magic!r})")
        self.path = path
        self.page_size = int(page_size)
        self.n_pages = int(n_pages)
        self._mapping = mapping
        whole = np.frombuffer(mapping, dtype=np.uint8)
        self.tags = whole[_HEADER_BYTES : _HEADER_BYTES + 8 * self.n_pages].view(np.uint64)
        self.states = whole[_HEADER_BYTES + 8 * self.n_pages : _HEADER_BYTES + 9 * self.n_pages]
        self.data = whole[data_offset:]
        self._next_tag = 1
        # The owner removes the file when the pool is collected or the interpreter exits normally;
        # mappings that other processes hold stay valid after the unlink.
        self._finalizer = weakref.finalize(self, _unlink_quietly, path, os.getpid()) if owner else None

    @classmethod
    def create(cls, directory: str, capacity_bytes: int, page_size: int) -> _Pool:
        n_pages = max(1, capacity_bytes // page_size)
        data_offset = align_up(_HEADER_BYTES + 9 * n_pages, page_size)
        size = data_offset + n_pages * page_size
        removed = remove_dead_pools(directory)
        if removed:
            logger.info("removed %d shared-memory pool(s) of processes that died: %s", len(removed), ", ".join(removed))
        path = os.path.join(directory, f"{_POOL_PREFIX}{os.getpid()}-{_pid_namespace()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # ftruncate makes a sparse file: pages cost memory only once written.
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        _HEADER.pack_into(mapping, 0, _MAGIC, page_size, n_pages, data_offset)
        return cls(path, mapping, owner=True)

    @classmethod
    def attach(cls, path: str) -> _Pool:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ConnectorError(
                f"shared-memory pool {path} is gone: its producer closed its connector or exited. "
                "Keep the producer's connector open until consumers have got and released its handles"
            ) from None
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(path, mapping, owner=False)

    @property
    def capacity_bytes(self) -> int:
        return self.n_pages * self.page_size

    def block(self, page: int, pages: int) -> np.ndarray:
        return self.data[page * self.page_size : (page + pages) * self.page_size]

    def try_allocate(self, pages: int) -> tuple[int, int] | None:
        """Claim the first run of `pages` free pages; the caller holds the producer's lock.

        First fit keeps reusing the lowest pages, which are still in cache when consumers release
        promptly (next fit would walk the whole pool and miss the cache on every put).
        """
        free = self.states == _FREE
        if pages == 1:
            starts = np.flatnonzero(free)
        else:
            runs = np.concatenate(([0], np.cumsum(free, dtype=np.int64)))
            starts = np.flatnonzero(runs[pages:] - runs[:-pages] == pages)
        if not starts.size:
            return None
        start = int(starts[0])
        tag = self._next_tag
        self._next_tag += 1
        self.tags[start] = tag
        self.states[start : start + pages] = _USED
        return start, tag

    def check(self, handle: ShmHandle) -> None:
        if not (0 <= handle.page < self.n_pages) or int(self.tags[handle.page]) != handle.tag:
            raise ConnectorError(
                f"shared-memory handle (page {handle.page}, tag {handle.tag}) was already released; "
                "get a handle before releasing it and release it exactly once"
            )

    def free(self, page: int, pages: int) -> None:
        # Clear the tag before the states: once a page reads free the producer may reuse it.
        self.tags[page] = 0
        self.states[page : page + pages] = _FREE

    def close(self, unlink: bool) -> None:
        if unlink and self._finalizer is not None:
            self._finalizer()
        # Drop our views first; the mapping itself stays alive while a caller still holds a view
        # returned by `get` (numpy keeps it exported) and is unmapped when the last one goes.
        self.tags = self.states = self.data = _EMPTY_BLOCK
        try:
            self._mapping.close()
        except BufferError:
            pass


def _default_directory(capacity_bytes: int) -> str:
    """/dev/shm when it has room for the whole pool, else the temp directory.

    Writing past the end of a full tmpfs kills the process with SIGBUS, so a small /dev/shm (64 MiB
    in default Docker containers) is skipped rather than trusted.
    """
    candidates = ["/dev/shm", tempfile.gettempdir()]
    for directory in candidates:
        if os.path.isdir(directory) and os.access(directory, os.W_OK):
            stats = os.statvfs(directory)
            if stats.f_bavail * stats.f_frsize >= capacity_bytes:
                return directory
    raise ConnectorError(
        f"no room for a {capacity_bytes}-byte shared-memory pool in {' or '.join(candidates)}: "
        "lower the connector option capacity_bytes or set directory= to a filesystem with room"
    )


class SharedMemoryConnector(Connector):
    """Moves payloads between processes of one host through a shared-memory page pool.

    Options: `capacity_bytes` (pool size per producer process, default 1 GiB, sparse),
    `page_size` (allocation unit, default 64 KiB), `put_timeout_s` (how long a put waits for free
    pages, default 60), `inline_meta_bytes` (pickled non-tensor data up to this size travels in the
    handle, larger goes into the pool), `directory` (where the pool file lives; default /dev/shm).

    `get` returns zero-copy views (torch tensors for torch inputs, numpy arrays for numpy inputs)
    that stay valid until the handle is released. Tensors on other devices come back on the CPU.
    A producer's pool file goes when it closes or exits; one left by a producer killed by a signal
    goes when the next process makes its pool in that directory (`remove_dead_pools`).
    """

    def __init__(
        self,
        capacity_bytes: int = 1 << 30,
        page_size: int = 64 << 10,
        put_timeout_s: float = 60.0,
        inline_meta_bytes: int = 64 << 10,
        directory: str | None = None,
    ) -> None:
        super().__init__(
            capacity_bytes=capacity_bytes,
            page_size=page_size,
            put_timeout_s=put_timeout_s,
            inline_meta_bytes=inline_meta_bytes,
            directory=directory,
        )
        if page_size <= 0 or page_size % TENSOR_ALIGNMENT:
            raise ConnectorError(f"page_size must be a positive multiple of {TENSOR_ALIGNMENT}, got {page_size}")
        if capacity_bytes < page_size:
            raise ConnectorError(f"capacity_bytes ({capacity_bytes}) must hold at least one page ({page_size})")
        self._capacity_bytes = capacity_bytes
        self._page_size = page_size
        self._put_timeout_s = put_timeout_s
        self._inline_meta_bytes = inline_meta_bytes
        self._directory = directory
        self._lock = threading.Lock()
        self._own: _Pool | None = None
        self._own_pid = 0
        self._attached: dict[str, _Pool] = {}
        self._closed = False

    # -- producer side -------------------------------------------------------------------------

    def put(self, payload: Payload, timeout: float | None = None) -> ShmHandle:
        self._check_open()
        split = split_payload(payload)
        inline = len(split.skeleton) <= self._inline_meta_bytes
        meta_offset = align_up(split.data_bytes, TENSOR_ALIGNMENT)
        total = split.data_bytes if inline else meta_offset + len(split.skeleton)
        if total == 0:
            return ShmHandle(pool="", page=0, pages=0, tag=0, meta=split.skeleton)
        pool = self._own_pool()
        pages = math.ceil(total / pool.page_size)
        if pages > pool.n_pages:
            raise ConnectorError(
                f"payload needs {total} bytes but the shared-memory pool holds {pool.capacity_bytes}: "
                "raise the connector option capacity_bytes"
            )
        page, tag = self._allocate(pool, pages, self._put_timeout_s if timeout is None else timeout)
        try:
            block = pool.block(page, pages)
            for slot, tensor in zip(split.slots, split.tensors):
                copy_tensor_into(block, slot, tensor)
            if not inline:
                block[meta_offset:total] = np.frombuffer(split.skeleton, dtype=np.uint8)
        except BaseException:
            pool.free(page, pages)
            raise
        if inline:
            return ShmHandle(pool.path, page, pages, tag, split.skeleton)
        return ShmHandle(pool.path, page, pages, tag, None, meta_offset, len(split.skeleton))

    def _own_pool(self) -> _Pool:
        with self._lock:
            self._check_open()
            # A forked child must not allocate from its parent's pool: the page table assumes one
            # allocating process.
            if self._own is None or self._own_pid != os.getpid():
                directory = self._directory or _default_directory(self._capacity_bytes)
                self._own = _Pool.create(directory, self._capacity_bytes, self._page_size)
                self._own_pid = os.getpid()
                self._attached[self._own.path] = self._own
            return self._own

    def _allocate(self, pool: _Pool, pages: int, timeout: float) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        delay = 50e-6
        while True:
            with self._lock:
                self._check_open()
                claimed = pool.try_allocate(pages)
            if claimed is not None:
                return claimed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConnectorFullError(
                    f"shared-memory pool {pool.path} had no {pages} free pages for {timeout} s: "
                    "consumers must release handles after get; or raise capacity_bytes "
                    f"(now {pool.capacity_bytes}) or put_timeout_s"
                )
            # Releases may come from other processes, which cannot signal a thread condition here,
            # so the full-pool path polls with a growing backoff.
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 5e-3)

    # -- consumer side -------------------------------------------------------------------------

    def get(self, handle: ShmHandle) -> Payload:
        self._check_open()
        if handle.pages == 0:
            return join_payload(handle.meta or b"", _EMPTY_BLOCK)
        pool = self._pool(handle.pool)
        pool.check(handle)
        block = pool.block(handle.page, handle.pages)
        if handle.meta is not None:
            return join_payload(handle.meta, block)
        return join_payload(memoryview(block[handle.meta_offset : handle.meta_offset + handle.meta_len]), block)

    def release(self, handle: ShmHandle) -> None:
        """Free the pages of `handle`; a no-op after `close` (closing let go of everything)."""
        if self._closed or handle.pages == 0:
            return
        pool = self._pool(handle.pool)
        pool.check(handle)
        pool.free(handle.page, handle.pages)

    def _pool(self, path: str) -> _Pool:
        with self._lock:
            self._check_open()
            pool = self._attached.get(path)
            if pool is None:
                pool = self._attached[path] = _Pool.attach(path)
            return pool

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unlink this process's own pool and unmap the pools it attached; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            super().close()
            pools, self._attached = self._attached, {}
            own, self._own = self._own, None
        for pool in pools.values():
            pool.close(unlink=pool is own and self._own_pid == os.getpid())

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError("this shared-memory connector is closed; create a new one")

    @property
    def pool_path(self) -> str | None:
        """The file of this process's own pool (``None`` before the first put)."""
        return self._own.path if self._own is not None else None


def pages_in_use(path: str) -> int:
    """How many pages of the pool file at `path` are held by unreleased handles right now (for
    operators and leak tests: a quiet server's pools hold none)."""
    with open(path, "rb") as file:
        header = file.read(_HEADER.size)
        magic, _page_size, n_pages, _data_offset = _HEADER.unpack(header)
        if magic != _MAGIC:
            raise ConnectorError(f"{path} is not an Omni shared-memory pool (bad magic {magic!r})")
        file.seek(_HEADER_BYTES + 8 * n_pages)
        states = np.frombuffer(file.read(n_pages), dtype=np.uint8)
    return int(np.count_nonzero(states != _FREE))
