"""The connector contract for the built-in connectors, plus what is specific to each."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_core.connectors import create_connector
from omni_core.connectors.inproc import InProcessConnector
from omni_core.connectors.shm import SharedMemoryConnector
from omni_core.errors import ConfigError, ConnectorClosedError, ConnectorError
from omni_core.testing.connector_contract import MIB, ConnectorContract, assert_payload_equal, mixed_payload


class TestInProcessContract(ConnectorContract):
    connector_ref = "omni_core.connectors.inproc:InProcessConnector"
    bounded_options = {"max_items": 4}
    shared_instance = True
    cross_process = False  # both ends live in one process


class TestSharedMemoryContract(ConnectorContract):
    connector_ref = "omni_core.connectors.shm:SharedMemoryConnector"
    options = {"capacity_bytes": 80 * MIB}
    bounded_options = {"capacity_bytes": 4 * MIB}


# -- inproc ---------------------------------------------------------------------------------------


def test_inproc_passes_objects_by_reference() -> None:
    connector = InProcessConnector()
    tensor = torch.ones(3)
    handle = connector.put({"x": tensor})
    assert connector.get(handle)["x"] is tensor
    connector.release(handle)
    with pytest.raises(ConnectorError, match="released"):
        connector.get(handle)
    connector.close()


def test_inproc_close_wakes_a_blocked_put() -> None:
    connector = InProcessConnector(max_items=1)
    connector.put({"a": 1})
    closer = threading.Timer(0.2, connector.close)
    closer.start()
    with pytest.raises(ConnectorClosedError):
        connector.put({"b": 2}, timeout=10)
    closer.join()


# -- shm --------------------------------------------------------------------------------------------


@pytest.fixture
def shm() -> Iterator[SharedMemoryConnector]:
    connector = SharedMemoryConnector(capacity_bytes=16 * MIB)
    yield connector
    connector.close()


def test_shm_get_is_zero_copy_and_aligned(shm: SharedMemoryConnector) -> None:
    handle = shm.put({"a": torch.arange(10, dtype=torch.int8), "b": torch.ones(3, dtype=torch.bfloat16),
                      "c": np.ones(5, dtype=np.float64)})
    first, second = shm.get(handle), shm.get(handle)
    for key in ("a", "b"):
        assert first[key].data_ptr() == second[key].data_ptr()
        assert first[key].data_ptr() % 64 == 0
    assert np.shares_memory(first["c"], second["c"])
    assert first["c"].ctypes.data % 64 == 0
    second["a"][0] = 42  # both are views of the same pool bytes
    assert int(first["a"][0]) == 42
    shm.release(handle)


def test_shm_copies_tensors_into_the_pool_contiguously(shm: SharedMemoryConnector) -> None:
    source = torch.arange(1000, dtype=torch.float32)
    transposed = torch.arange(12).reshape(3, 4).t()
    handle = shm.put({"x": source, "t": transposed})
    source.zero_()  # the pool holds its own copy, taken at put time
    got = shm.get(handle)
    assert torch.equal(got["x"], torch.arange(1000, dtype=torch.float32))
    assert got["t"].is_contiguous() and torch.equal(got["t"], transposed)
    shm.release(handle)


def test_shm_payload_larger_than_pool_fails_at_once(shm: SharedMemoryConnector) -> None:
    started = time.monotonic()
    with pytest.raises(ConnectorError, match="capacity_bytes"):
        shm.put({"x": torch.empty(17 * MIB, dtype=torch.uint8)}, timeout=30)
    assert time.monotonic() - started < 1


def test_shm_large_metadata_goes_into_the_pool() -> None:
    connector = SharedMemoryConnector(capacity_bytes=4 * MIB, inline_meta_bytes=1024)
    payload = {"text": "x" * 200_000, "ids": list(range(1000)), "t": torch.ones(2)}
    handle = connector.put(payload)
    assert handle.meta is None and len(pickle.dumps(handle)) < 1024
    assert_payload_equal(connector.get(handle), payload)
    connector.release(handle)
    connector.close()


def test_shm_release_twice_and_get_after_release_raise(shm: SharedMemoryConnector) -> None:
    handle = shm.put({"x": torch.ones(4)})
    shm.release(handle)
    with pytest.raises(ConnectorError, match="already released"):
        shm.release(handle)
    with pytest.raises(ConnectorError, match="already released"):
        shm.get(handle)
    reused = shm.put({"x": torch.zeros(4)})  # may reuse the same pages with a new tag
    with pytest.raises(ConnectorError, match="already released"):
        shm.get(handle)
    shm.release(reused)


def test_shm_close_unlinks_the_pool_and_keeps_outstanding_views_valid() -> None:
    connector = SharedMemoryConnector(capacity_bytes=4 * MIB)
    handle = connector.put({"x": torch.arange(8)})
    view = connector.get(handle)["x"]
    path = connector.pool_path
    assert path is not None and os.path.exists(path)
    connector.close()
    assert not os.path.exists(path)
    assert torch.equal(view, torch.arange(8))  # the mapping lives as long as the view


def test_shm_pool_is_sparse_and_honours_directory(tmp_path: Path) -> None:
    connector = SharedMemoryConnector(capacity_bytes=256 * MIB, directory=str(tmp_path))
    handle = connector.put({"x": torch.ones(MIB // 4)})
    path = Path(connector.pool_path or "")
    assert path.parent == tmp_path
    assert path.stat().st_blocks * 512 < 16 * MIB  # only written pages take space
    connector.release(handle)
    connector.close()


def _put_and_exit(path_queue: multiprocessing.Queue) -> None:
    connector = SharedMemoryConnector(capacity_bytes=4 * MIB)
    connector.put({"x": torch.ones(16)})
    path_queue.put(connector.pool_path)
    # no close(): a normal interpreter exit must still remove the pool file


def test_shm_pool_file_is_removed_when_the_producer_exits() -> None:
    context = multiprocessing.get_context("spawn")
    paths = context.Queue()
    process = context.Process(target=_put_and_exit, args=(paths,))
    process.start()
    path = paths.get(timeout=60)
    process.join(60)
    assert process.exitcode == 0
    assert path and not os.path.exists(path)


def _put_and_hang(directory: str, path_queue: multiprocessing.Queue) -> None:
    connector = SharedMemoryConnector(capacity_bytes=4 * MIB, directory=directory)
    connector.put({"x": torch.ones(MIB // 4)})
    path_queue.put(connector.pool_path)
    time.sleep(600)  # until SIGKILLed


def test_shm_pools_of_killed_producers_are_removed_by_the_next_pool(tmp_path: Path) -> None:
    """A producer killed by a signal leaves its pool file (its written pages hold memory); the next
    process to create a pool in that directory removes it, and nothing of a live process, another
    pid namespace or another kind of file."""
    context = multiprocessing.get_context("spawn")
    paths = context.Queue()
    killed = context.Process(target=_put_and_hang, args=(str(tmp_path), paths))
    alive = context.Process(target=_put_and_hang, args=(str(tmp_path), paths))
    killed.start()
    alive.start()
    try:
        pools = {paths.get(timeout=60), paths.get(timeout=60)}
        dead_path = next(p for p in pools if f"omni-shm-{killed.pid}-" in p)
        live_path = next(p for p in pools if f"omni-shm-{alive.pid}-" in p)
        killed.kill()
        killed.join(60)
        assert os.path.exists(dead_path)  # nobody unlinked it
        other_namespace = tmp_path / f"omni-shm-{killed.pid}-1-0123456789ab"  # pid means nothing here
        unrelated = tmp_path / "omni-shm-notes.txt"
        other_namespace.touch()
        unrelated.touch()

        connector = SharedMemoryConnector(capacity_bytes=4 * MIB, directory=str(tmp_path))
        handle = connector.put({"x": torch.ones(4)})  # creates this process's pool: the sweep
        assert not os.path.exists(dead_path)
        assert os.path.exists(live_path) and other_namespace.exists() and unrelated.exists()
        connector.release(handle)
        connector.close()
    finally:
        for process in (killed, alive):
            process.kill()
            process.join(60)


def test_shm_numpy_only_payload_comes_back_as_numpy(shm: SharedMemoryConnector) -> None:
    payload = {"audio": np.linspace(0, 1, 100, dtype=np.float32), "rate": 24000}
    handle = shm.put(payload)
    assert_payload_equal(shm.get(handle), payload)
    shm.release(handle)


# -- create_connector ------------------------------------------------------------------------------


def test_create_connector_builds_from_ref_and_rejects_unknown_options() -> None:
    connector = create_connector("omni_core.connectors.shm:SharedMemoryConnector", {"capacity_bytes": 2 * MIB})
    handle = connector.put(mixed_payload(0))
    assert_payload_equal(connector.get(handle), mixed_payload(0))
    connector.release(handle)
    connector.close()
    with pytest.raises(ConfigError, match="capacity_bytes"):
        create_connector(SharedMemoryConnector, {"capacity": 1})
    with pytest.raises(ConfigError, match="not a Connector"):
        create_connector("omni_core.errors:ConnectorError")


class _NeedsADirectory(SharedMemoryConnector):
    def __init__(self, root: str) -> None:
        raise FileNotFoundError(root)


def test_a_failing_connector_constructor_names_the_edge() -> None:
    with pytest.raises(ConfigError) as info:
        create_connector(_NeedsADirectory, {"root": "/proc/nope"}, where="edges.lm->tone")
    assert info.value.key == "edges.lm->tone"
    assert "_NeedsADirectory({'root': '/proc/nope'}) failed: FileNotFoundError: /proc/nope" in str(info.value)
