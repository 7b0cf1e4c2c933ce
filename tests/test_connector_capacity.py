"""`SharedCapacity` (rule 5 of a connector across the processes of a host) and the closed-state
bookkeeping `Connector` gives every connector (`close`, `closed`, `check_open`)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from omni_core.connectors.base import Connector
from omni_core.connectors.capacity import SharedCapacity
from omni_core.errors import ConnectorClosedError, ConnectorError, ConnectorFullError


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "capacity"


def test_full_acquire_waits_for_its_timeout_then_raises(path: Path) -> None:
    capacity = SharedCapacity(path, max_bytes=100, what="test connector")
    capacity.acquire(60, timeout=0)
    capacity.acquire(40, timeout=0)
    started = time.monotonic()
    with pytest.raises(ConnectorFullError, match="test connector held 100 bytes in 2 payloads"):
        capacity.acquire(1, timeout=0.3)
    assert time.monotonic() - started >= 0.3
    capacity.release(40)
    capacity.acquire(30, timeout=0)
    assert capacity.usage() == (90, 2)
    capacity.close()


def test_one_payload_always_fits(path: Path) -> None:
    capacity = SharedCapacity(path, max_bytes=10)
    capacity.acquire(1000, timeout=0)  # larger than the budget, but nothing else is held
    with pytest.raises(ConnectorFullError):
        capacity.acquire(1, timeout=0)
    capacity.release(1000)
    assert capacity.usage() == (0, 0)


def test_max_items_bounds_the_payload_count(path: Path) -> None:
    capacity = SharedCapacity(path, max_items=2)
    capacity.acquire(1 << 30, timeout=0)
    capacity.acquire(1 << 30, timeout=0)
    with pytest.raises(ConnectorFullError):
        capacity.acquire(0, timeout=0.05)


def test_a_release_in_another_thread_wakes_a_waiting_acquire_at_once(path: Path) -> None:
    capacity = SharedCapacity(path, max_items=1)
    capacity.acquire(1, timeout=0)
    releaser = threading.Timer(0.2, capacity.release, args=(1,))
    releaser.start()
    started = time.monotonic()
    capacity.acquire(1, timeout=10)
    waited = time.monotonic() - started
    releaser.join()
    assert 0.15 <= waited < 0.5


def _hold_and_release(path: str, hold_s: float, ready: Any) -> None:
    capacity = SharedCapacity(path, max_items=1)
    capacity.acquire(7, timeout=10)
    ready.set()
    time.sleep(hold_s)
    capacity.release(7)
    capacity.close()


def test_instances_in_other_processes_share_the_budget_and_wake_each_other(path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_hold_and_release, args=(str(path), 0.5, ready))
    child.start()
    try:
        assert ready.wait(60)
        capacity = SharedCapacity(path, max_items=1)
        assert capacity.usage() == (7, 1)  # the child's payload, seen here
        with pytest.raises(ConnectorFullError):
            capacity.acquire(1, timeout=0.05)
        capacity.acquire(1, timeout=10)  # woken by the child's release (polled: within 5 ms)
        assert capacity.usage() == (1, 1)
    finally:
        child.join(30)
    assert child.exitcode == 0


def _take_turns(path: str, rounds: int, held: Any, most: Any) -> None:
    capacity = SharedCapacity(path, max_items=2)
    for _ in range(rounds):
        capacity.acquire(1, timeout=30)
        with held.get_lock():
            held.value += 1
            most.value = max(most.value, held.value)
        time.sleep(0.002)
        with held.get_lock():
            held.value -= 1
        capacity.release(1)


def test_concurrent_processes_never_exceed_the_budget(path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    held, most = context.Value("i", 0), context.Value("i", 0)
    processes = [context.Process(target=_take_turns, args=(str(path), 40, held, most)) for _ in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0] * 4
    assert 1 <= most.value <= 2
    assert SharedCapacity(path).usage() == (0, 0)


def test_close_wakes_a_waiting_acquire_and_later_releases_are_no_ops(path: Path) -> None:
    capacity = SharedCapacity(path, max_items=1)
    capacity.acquire(1, timeout=0)
    closer = threading.Timer(0.2, capacity.close)
    closer.start()
    with pytest.raises(ConnectorClosedError):
        capacity.acquire(1, timeout=10)
    closer.join()
    capacity.release(1)
    capacity.close()  # idempotent
    assert SharedCapacity(path).usage() == (1, 1)  # the budget outlives an instance


def test_limits_must_be_positive(path: Path) -> None:
    with pytest.raises(ConnectorError, match="max_bytes must be at least 1"):
        SharedCapacity(path, max_bytes=0)


class _Minimal(Connector):
    def put(self, payload: Any, timeout: float | None = None) -> Any:
        self.check_open()
        return 0

    def get(self, handle: Any) -> Any:
        self.check_open()
        return {}

    def release(self, handle: Any) -> None:
        pass


def test_the_base_class_keeps_the_closed_state() -> None:
    connector = _Minimal()
    assert not connector.closed
    connector.put({})
    connector.close()
    connector.close()
    assert connector.closed
    with pytest.raises(ConnectorClosedError, match="this _Minimal is closed"):
        connector.put({})
    with pytest.raises(ConnectorClosedError):
        connector.get(0)
