"""`RegisteredArena`: local memory registered with Mooncake, handed out in runs of pages.

Mooncake's zero-copy calls (the store's ``put_from``/``get_into``, the transfer engine's reads)
move bytes between *registered* buffers; registering costs a call into Mooncake (and, on RDMA,
pinning the pages), so each connector registers one arena once and reuses it: the staging area a
put copies the payload into, and the buffer a get lands in (whose views the consumer holds until
release). A request larger than what is free gets a buffer of its own, registered for that one
use: an arena never blocks, so a consumer holding many payloads only costs memory.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import attrs
import numpy as np

from omni_core.errors import ConnectorError
from omni_mooncake.mooncake_bridge import error_name

_PAGE_ALIGNMENT = 4096
_FREE = 0
_USED = 1


def aligned_zeros(nbytes: int, alignment: int = _PAGE_ALIGNMENT) -> np.ndarray:
    """A zeroed uint8 array of `nbytes` starting at a multiple of `alignment`.

    Large zeroed allocations come from ``calloc``'s fresh mappings, so pages cost memory only
    once written: an arena sized for the largest payload is cheap until used.
    """
    raw = np.zeros(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes]


def first_fit(states: np.ndarray, pages: int) -> int | None:
    """The first index of `pages` consecutive free entries of a page table (uint8, 0 = free).

    First fit keeps reusing the lowest pages, still in cache when payloads are released
    promptly. One page (every small payload) is a single ``argmin`` pass, without the
    temporaries of the run search: it is on the path of every small put and get.
    """
    if pages == 1:
        page = int(states.argmin())
        return page if states[page] == _FREE else None
    free = states == _FREE
    counts = np.concatenate(([0], np.cumsum(free, dtype=np.int64)))
    starts = np.flatnonzero(counts[pages:] - counts[:-pages] == pages)
    return int(starts[0]) if starts.size else None


def _closed(*args: int) -> int:
    raise ConnectorError("this arena is closed (its connector closed); create a new connector")


class PageTable:
    """Which pages of a buffer are free: runs handed out first fit, one-page runs from a list.

    Small payloads take one page and are most of the traffic: a freed one-page run goes on a
    list, and the next one-page claim pops it (the page freed last, still in cache) instead of
    searching the table. The table stays the truth: a listed page that a longer run took
    meanwhile is skipped. A page is listed once at most (only a one-page claim takes it off the
    list, or a search when the list is empty). Not thread-safe: its owner holds a lock.
    """

    def __init__(self, n_pages: int) -> None:
        self.n_pages = n_pages
        self.states = np.zeros(n_pages, dtype=np.uint8)
        self._flags = memoryview(self.states)  # one page's state without a numpy scalar (a tenth of the cost)
        self._singles: list[int] = []

    def claim(self, pages: int) -> int | None:
        """The first page of a run of `pages` now marked used, or None when none is free."""
        if pages == 1:
            while self._singles:
                page = self._singles.pop()
                if self._flags[page] == _FREE:
                    self._flags[page] = _USED
                    return page
        start = first_fit(self.states, pages)
        if start is not None:
            self.states[start : start + pages] = _USED
        return start

    def free(self, page: int, pages: int) -> None:
        """Mark the run at `page` free."""
        if pages == 1:
            self._flags[page] = _FREE
            self._singles.append(page)
        else:
            self.states[page : page + pages] = _FREE


@attrs.frozen(eq=False)
class Region:
    """A registered run of bytes: `array` (uint8, 64-byte aligned) at address `ptr`.

    ``page == -1`` marks a buffer registered for this region alone (freed with it).
    """

    array: np.ndarray
    ptr: int
    page: int
    pages: int


class RegisteredArena:
    """`capacity_bytes` of registered memory in pages of `page_size`, allocated first fit.

    `register(ptr, size)` and `unregister(ptr)` are the Mooncake client's calls (they return 0 on
    success). The memory is allocated and registered on first use, so an instance that never
    moves a payload costs nothing. Thread-safe. One-page regions are built once per page and
    reused: a small get then allocates nothing.
    """

    def __init__(
        self,
        capacity_bytes: int,
        page_size: int,
        register: Callable[[int, int], int],
        unregister: Callable[[int], int],
    ) -> None:
        self.page_size = page_size
        self.n_pages = max(1, capacity_bytes // page_size)
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._memory: np.ndarray | None = None
        self._address = 0
        self._table = PageTable(self.n_pages)
        self._single_regions: dict[int, Region] = {}  # one-page regions, built once per page
        self._dedicated: set[int] = set()

    def acquire(self, nbytes: int) -> Region:
        """A region of at least `nbytes` (at least one page, so every region has an address)."""
        pages = max(1, math.ceil(nbytes / self.page_size))
        with self._lock:
            if pages <= self.n_pages:
                memory = self._memory if self._memory is not None else self._map()
                start = self._table.claim(pages)
                if start is not None and pages == 1:
                    region = self._single_regions.get(start)
                    if region is None:
                        region = self._single_regions[start] = self._region(memory, start, 1)
                    return region
                if start is not None:
                    return self._region(memory, start, pages)
        array = aligned_zeros(pages * self.page_size)
        self._checked(self._register(array.ctypes.data, array.nbytes), "register a buffer")
        with self._lock:
            self._dedicated.add(array.ctypes.data)
        return Region(array, array.ctypes.data, -1, pages)

    def release(self, region: Region) -> None:
        """Give `region` back (its views must no longer be read)."""
        if region.page >= 0:
            with self._lock:
                self._table.free(region.page, region.pages)
            return
        with self._lock:
            if region.ptr not in self._dedicated:
                return  # closed meanwhile: already unregistered
            self._dedicated.discard(region.ptr)
        self._unregister(region.ptr)

    def close(self) -> None:
        """Unregister everything (arrays still viewed by callers stay valid memory, unregistered),
        and let go of the Mooncake client: its bound methods would keep it alive, and its
        destructor (which joins Mooncake's threads, GIL held) would then run at some later garbage
        collection instead of in its owner's `close`."""
        with self._lock:
            memory, self._memory = self._memory, None
            dedicated, self._dedicated = self._dedicated, set()
            self._single_regions = {}
            unregister = self._unregister
            self._register = self._unregister = _closed
        if memory is not None:
            unregister(memory.ctypes.data)
        for ptr in dedicated:
            unregister(ptr)

    def _region(self, memory: np.ndarray, start: int, pages: int) -> Region:
        offset = start * self.page_size
        # The address from the base kept at mapping: `.ctypes` costs microseconds.
        return Region(memory[offset : offset + pages * self.page_size], self._address + offset, start, pages)

    def _map(self) -> np.ndarray:
        memory = aligned_zeros(self.n_pages * self.page_size)
        self._checked(self._register(memory.ctypes.data, memory.nbytes), "register its buffer")
        self._memory = memory
        self._address = memory.ctypes.data
        return memory

    @staticmethod
    def _checked(code: int, what: str) -> None:
        if code != 0:
            raise ConnectorError(f"Mooncake failed to {what}: {error_name(code)}")
