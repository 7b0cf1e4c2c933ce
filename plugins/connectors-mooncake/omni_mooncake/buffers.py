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
    moves a payload costs nothing. Thread-safe.
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
        self._states = np.zeros(self.n_pages, dtype=np.uint8)
        self._dedicated: set[int] = set()

    def acquire(self, nbytes: int) -> Region:
        """A region of at least `nbytes` (at least one page, so every region has an address)."""
        pages = max(1, math.ceil(nbytes / self.page_size))
        with self._lock:
            if pages <= self.n_pages:
                memory = self._memory if self._memory is not None else self._map()
                start = first_fit(self._states, pages)
                if start is not None:
                    self._states[start : start + pages] = _USED
                    offset = start * self.page_size
                    # The address from the base kept at mapping: `.ctypes` costs microseconds.
                    return Region(memory[offset : offset + pages * self.page_size], self._address + offset, start, pages)
        array = aligned_zeros(pages * self.page_size)
        self._checked(self._register(array.ctypes.data, array.nbytes), "register a buffer")
        with self._lock:
            self._dedicated.add(array.ctypes.data)
        return Region(array, array.ctypes.data, -1, pages)

    def release(self, region: Region) -> None:
        """Give `region` back (its views must no longer be read)."""
        if region.page >= 0:
            with self._lock:
                self._states[region.page : region.page + region.pages] = _FREE
            return
        with self._lock:
            if region.ptr not in self._dedicated:
                return  # closed meanwhile: already unregistered
            self._dedicated.discard(region.ptr)
        self._unregister(region.ptr)

    def close(self) -> None:
        """Unregister everything (arrays still viewed by callers stay valid memory, unregistered)."""
        with self._lock:
            memory, self._memory = self._memory, None
            dedicated, self._dedicated = self._dedicated, set()
        if memory is not None:
            self._unregister(memory.ctypes.data)
        for ptr in dedicated:
            self._unregister(ptr)

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
