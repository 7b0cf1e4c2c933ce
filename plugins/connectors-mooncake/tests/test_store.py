"""The Mooncake store connector: the contract suite against a real master, and what is its own."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omni_core.connectors import create_connector
from omni_core.errors import ConnectorError
from omni_core.testing.connector_contract import MIB, ConnectorContract
from omni_mooncake.store import MooncakeStoreConnector, StoreHandle

REF = "omni_mooncake.store:MooncakeStoreConnector"
# A short get timeout: the contract gets closed producers' handles, which waits that long.
BASE = {"capacity_bytes": 80 * MIB, "buffer_bytes": 80 * MIB, "get_timeout_s": 0.3}


class TestMooncakeStoreContract(ConnectorContract):
    connector_ref = REF
    bounded_options = {"capacity_bytes": 4 * MIB}

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _join_master(cls, master: str) -> Iterator[None]:
        # The master's port is known only once it runs, and the suite builds every instance (in
        # the peer and producer processes too) from the class's options: set them before any.
        cls.options = {**BASE, "master": master}
        yield
        del cls.options


@pytest.fixture
def store(master: str) -> Iterator[MooncakeStoreConnector]:
    connector = MooncakeStoreConnector(**BASE, master=master)
    yield connector
    connector.close()


def test_get_of_a_missing_object_fails_after_the_bounded_wait(store: MooncakeStoreConnector) -> None:
    started = time.monotonic()
    with pytest.raises(ConnectorError, match=r"not in the Mooncake store .*waited 0.3 s.*released already"):
        store.get(StoreHandle("omni/nobody/0", 4096, None))
    assert 0.25 <= time.monotonic() - started < 2.0


def test_release_right_after_get_removes_the_object_despite_the_read_lease(store: MooncakeStoreConnector, master: str) -> None:
    other = MooncakeStoreConnector(**BASE, master=master)
    try:
        handle = store.put({"x": torch.ones(1024)})
        other.get(handle)
        started = time.monotonic()
        other.release(handle)  # the get's 2 s lease holds: a plain remove would fail here
        assert time.monotonic() - started < 1.0
        with pytest.raises(ConnectorError, match="released already"):
            other.get(handle)
        with pytest.raises(ConnectorError, match="release each handle exactly once"):
            other.release(handle)
    finally:
        other.close()


def test_objects_are_hard_pinned_not_evicted(master: str) -> None:
    # A 16 MiB segment filled past the master's eviction watermark (90 %): nothing may be lost.
    connector = MooncakeStoreConnector(master=master, capacity_bytes=15 * MIB, segment_bytes=16 * MIB)
    try:
        handles = [connector.put({"x": torch.full((MIB // 4,), float(i))}) for i in range(15)]
        time.sleep(0.3)
        for i, handle in enumerate(handles):
            assert torch.equal(connector.get(handle)["x"], torch.full((MIB // 4,), float(i)))
            connector.release(handle)
    finally:
        connector.close()


def test_unreachable_master_fails_fast_with_the_fix() -> None:
    with pytest.raises(ConnectorError, match="no Mooncake master answers at 127.0.0.1:9 .*leave the option master unset"):
        MooncakeStoreConnector(master="127.0.0.1:9", connect_timeout_s=0.2)


def test_bad_options_name_the_key() -> None:
    with pytest.raises(Exception, match="master: expected HOST:PORT"):
        create_connector(REF, {"master": "nowhere", "connect_timeout_s": 0.1}, "edges.a->b")
    with pytest.raises(Exception, match="protocol"):
        create_connector(REF, {"master": "127.0.0.1:9", "protocol": "udp"}, "edges.a->b")


# -- the embedded default: the engine's instance starts the master, the others join it ----------


def _numpy_payload() -> dict[str, Any]:
    # numpy only: the spawned worker then starts without importing torch (seconds on a busy CPU).
    return {"audio": np.arange(4096, dtype=np.float32), "text": "hi"}


def _consume_elsewhere(options: dict[str, Any], handle: Any, results: Any) -> None:
    connector = MooncakeStoreConnector(**options)
    try:
        payload = connector.get(handle)
        assert np.array_equal(payload["audio"], _numpy_payload()["audio"]) and payload["text"] == "hi"
        connector.release(handle)
        results.put("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        connector.close()


def test_embedded_master_is_shared_and_stopped_on_close() -> None:
    engine_side = MooncakeStoreConnector(capacity_bytes=8 * MIB)
    master = engine_side._master
    assert master is not None and master.alive()
    shared = engine_side.shared_options()
    assert shared["master"] == master.address and shared["master"].startswith("127.0.0.1:")
    assert {k: v for k, v in shared.items() if k != "master"} == {k: v for k, v in engine_side.options.items() if k != "master"}
    try:
        handle = engine_side.put(_numpy_payload())
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        worker = context.Process(target=_consume_elsewhere, args=(shared, handle, results))
        worker.start()
        # The worker joined the engine's master instead of starting its own: it read the payload.
        assert results.get(timeout=60) == "ok"
        worker.join(30)
        assert worker.exitcode == 0
    finally:
        engine_side.close()
    assert not master.alive()
    engine_side.close()  # idempotent


def test_an_instance_built_from_shared_options_starts_no_master(master: str) -> None:
    connector = MooncakeStoreConnector(**BASE, master=master)
    try:
        assert connector._master is None
        assert connector.shared_options()["master"] == master
    finally:
        connector.close()


def test_a_large_tensor_put_from_its_own_memory_is_a_copy(store: MooncakeStoreConnector) -> None:
    # One contiguous tensor of >= 1 MiB skips the staging copy; changing it after put (or
    # putting it twice) must not change what was put.
    tensor = torch.arange(MIB // 2, dtype=torch.float32)
    first, second = store.put({"x": tensor}), store.put({"x": tensor})
    tensor.zero_()
    for handle in (first, second):
        assert torch.equal(store.get(handle)["x"], torch.arange(MIB // 2, dtype=torch.float32))
        store.release(handle)


def test_a_conjugated_tensor_arrives_as_its_values(store: MooncakeStoreConnector, master: str) -> None:
    # Its memory holds the unconjugated values: copying its bytes (the direct path from 1 MiB
    # on, the memmove of small ones) would send those.
    values = torch.arange(MIB // 8, dtype=torch.float32) * (1 + 2j)  # complex64
    consumer = MooncakeStoreConnector(**BASE, master=master)
    try:
        for payload in ({"big": values.conj()}, {"small": values[:4].conj(), "negated": values[:4].conj().imag}):
            handle = store.put(payload)
            got = consumer.get(handle)
            for key, tensor in payload.items():
                assert torch.equal(got[key], tensor.resolve_conj().resolve_neg()), key
            consumer.release(handle)
        assert not consumer._segment_mounted, "an instance that only gets mounts no segment (it closes faster)"
    finally:
        consumer.close()
