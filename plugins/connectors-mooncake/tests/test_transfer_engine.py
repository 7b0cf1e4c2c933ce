"""The Mooncake transfer engine connector: the contract suite, TTL reclaim, remote release."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omni_core.errors import ConnectorError, ConnectorFullError
from omni_core.testing.connector_contract import MIB, ConnectorContract
from omni_mooncake.transfer_engine import MooncakeTransferEngineConnector


class TestMooncakeTransferEngineContract(ConnectorContract):
    connector_ref = "omni_mooncake.transfer_engine:MooncakeTransferEngineConnector"
    options = {"pool_bytes": 80 * MIB, "buffer_bytes": 80 * MIB}
    bounded_options = {"pool_bytes": 4 * MIB}


@pytest.fixture
def producer() -> Iterator[MooncakeTransferEngineConnector]:
    connector = MooncakeTransferEngineConnector(pool_bytes=2 * MIB, page_bytes=64 << 10, ttl_s=0.5)
    yield connector
    connector.close()


def test_unreleased_payloads_are_reclaimed_after_the_ttl(producer: MooncakeTransferEngineConnector) -> None:
    payload = {"x": torch.zeros(MIB // 4 - 64)}  # one payload fills half the pool
    first = producer.put(payload, timeout=0.1)
    producer.put(payload, timeout=0.1)
    with pytest.raises(ConnectorFullError):
        producer.put(payload, timeout=0.1)  # nothing released, the TTL not reached yet
    started = time.monotonic()
    producer.put(payload, timeout=5)  # the consumer "died": the oldest run comes back after ttl_s
    assert 0.2 < time.monotonic() - started < 2.0
    consumer = MooncakeTransferEngineConnector()
    try:
        with pytest.raises(ConnectorError, match="reclaimed after ttl_s"):
            consumer.get(first)
    finally:
        consumer.close()


def _get_and_release(handle: Any, results: Any) -> None:
    consumer = MooncakeTransferEngineConnector()
    try:
        assert float(consumer.get(handle)["x"][0]) == 7.0  # numpy: the worker need not import torch
        consumer.release(handle)
        results.put("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        consumer.close()


def test_release_in_another_process_frees_the_producer_run(producer: MooncakeTransferEngineConnector) -> None:
    payload = {"x": np.full(MIB // 4 - 64, 7.0, dtype=np.float32)}
    handle = producer.put(payload, timeout=0.1)
    producer.put(payload, timeout=0.1)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=_get_and_release, args=(handle, results))
    worker.start()
    assert results.get(timeout=60) == "ok"
    worker.join(30)
    started = time.monotonic()
    producer.put(payload, timeout=0.4)  # well before the 0.5 s TTL could free anything
    assert time.monotonic() - started < 0.3


def test_get_after_release_fails_instead_of_reading_a_reused_run() -> None:
    producer = MooncakeTransferEngineConnector(pool_bytes=1 * MIB)
    consumer = MooncakeTransferEngineConnector()
    try:
        handle = producer.put({"x": torch.ones(1000)})
        consumer.get(handle)
        consumer.release(handle)
        producer.put({"y": torch.zeros(1000)})  # reuses the released run
        with pytest.raises(ConnectorError, match="released already"):
            consumer.get(handle)
    finally:
        consumer.close()
        producer.close()


def test_bad_options_name_the_key() -> None:
    with pytest.raises(Exception, match="page_bytes"):
        MooncakeTransferEngineConnector(page_bytes=100)
    with pytest.raises(Exception, match="ttl_s"):
        MooncakeTransferEngineConnector(ttl_s=0)


def test_a_conjugated_tensor_arrives_as_its_values(producer: MooncakeTransferEngineConnector) -> None:
    values = torch.arange(64, dtype=torch.float32) * (1 + 2j)  # complex64
    payload = {"conj": values.conj(), "negated": values.conj().imag}
    consumer = MooncakeTransferEngineConnector()
    try:
        handle = producer.put(payload, timeout=1)
        got = consumer.get(handle)
        for key, tensor in payload.items():
            assert torch.equal(got[key], tensor.resolve_conj().resolve_neg()), key
        consumer.release(handle)
    finally:
        consumer.close()
