"""The contract suite every connector passes, reusable by third-party connector packages.

Subclass `ConnectorContract` in a test module under a ``Test*`` name and say how to build the
connector::

    from omni_core.testing.connector_contract import ConnectorContract

    class TestMyConnector(ConnectorContract):
        connector_ref = "my_pkg.connector:MyConnector"
        options = {"address": "127.0.0.1:7000"}
        bounded_options = {"capacity_bytes": 4 << 20}   # small enough to fill with 1 MiB payloads

Every instance is built as ``Class(**options)``, exactly as producer and consumer processes build
theirs; override `make_connector` when building needs more (a server to start, say).

As in a deployment, payloads are consumed in another process by default: the test process puts,
a spawned peer process (one per test class) builds its own connector from `connector_ref` and the
options, gets, checks and releases; other tests spawn producer processes. `connector_ref`, the
options and the payload builders must therefore be importable and picklable. A connector whose two
ends share one instance in one process (``inproc``) sets ``cross_process = False``: its payloads
are then consumed by the same instance. Needs torch and numpy (``pip install 'omni-core[testing]'``).
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

from omni_core.connectors.base import Connector
from omni_core.errors import ConnectorClosedError, ConnectorError, ConnectorFullError
from omni_core.refs import load_ref

MIB = 1 << 20


# -- payloads (top-level so spawned processes can build the same ones) ---------------------------


def mixed_payload(seed: int) -> dict[str, Any]:
    """A payload with every kind of leaf a stage emits, its values determined by `seed`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    matrix = torch.randn(6, 5, generator=generator)
    return {
        "seed": seed,
        "hidden": torch.randn(3, 7, generator=generator),
        "bf16": torch.randn(4, 9, generator=generator).to(torch.bfloat16),
        "fp16": torch.randn(17, generator=generator).to(torch.float16),
        "ids": torch.randint(0, 1 << 40, (11,), generator=generator, dtype=torch.int64),
        "mask": torch.rand(2, 3, generator=generator) > 0.5,
        "scalar_tensor": torch.tensor(seed * 1.5),
        "empty": torch.empty(0, 4),
        "transposed": matrix.t(),  # non-contiguous
        "image": rng.integers(0, 256, size=(8, 6, 3), dtype=np.uint8),
        "audio": rng.standard_normal(33).astype(np.float32),
        "grid": np.asfortranarray(rng.standard_normal((4, 5))),  # column-major
        "count": np.array(seed, dtype=np.int32),  # 0-d array
        "nested": {"codes": [torch.arange(seed, seed + 4), np.arange(3, dtype=np.int16)], "pair": (seed, "x")},
        "text": f"request-{seed} ✓",
        "raw": bytes(range(seed % 7, 40)),
        "flag": seed % 2 == 0,
        "ratio": seed / 3,
        "nothing": None,
    }


def large_payload(nbytes: int, seed: int = 0) -> dict[str, Any]:
    """One float32 tensor of `nbytes` bytes with a recognisable pattern."""
    import torch

    values = torch.arange(nbytes // 4, dtype=torch.float32)
    return {"tensor": values.mul_(0.5).add_(seed)}


def transfer_payload(seed: int) -> dict[str, Any]:
    """A mixed payload plus a 512 KiB tensor: cross-process tests fill a bounded connector with it."""
    return {**mixed_payload(seed), **large_payload(MIB // 2, seed)}


def plain_payload() -> dict[str, Any]:
    """A payload without tensors (what a text stage sends)."""
    return {"text": "hello", "token_ids": [1, 2, 3], "final": True}


Expected = tuple[Callable[..., Any], tuple[Any, ...]]
"""A payload as the peer process rebuilds it: a top-level builder and its arguments."""


def assert_payload_equal(actual: Any, expected: Any, path: str = "payload") -> None:
    """Exact equality of payloads: same container types, tensor kinds, dtypes, shapes and values."""
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a torch tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert torch.equal(actual.cpu(), expected.cpu()), f"{path}: values differ"
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: expected a numpy array, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        assert np.array_equal(actual, expected), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_payload_equal(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for index, (got, want) in enumerate(zip(actual, expected)):
            assert_payload_equal(got, want, f"{path}[{index}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"


# -- helpers run in spawned processes -------------------------------------------------------------


def produce_in_child(
    ref: str, options: dict[str, Any], producer: int, count: int, handles: Any, done: Any
) -> None:
    """Put `count` transfer payloads (seeds ``producer * 1000 + i``) and send their handles.

    Stays alive until `done` is set: a producer's storage may live only as long as its connector.
    """
    connector = load_ref(ref)(**options)
    try:
        for index in range(count):
            seed = producer * 1000 + index
            handles.put((seed, connector.put(transfer_payload(seed), timeout=30)))
        done.wait(60)
    except BaseException as exc:  # report instead of letting the parent wait for handles forever
        handles.put((-1, repr(exc)))
        raise
    finally:
        connector.close()


def serve_as_peer(ref: str, options: dict[str, Any], bounded_options: dict[str, Any], commands: Any, replies: Any) -> None:
    """The peer process: run `ConsumerPeer` commands until ``None``, one reply each.

    Builds its connectors (plain and bounded) on first use, from `ref` and the options, exactly as a
    stage process builds its own.
    """
    connectors: dict[bool, Connector] = {}
    try:
        while (command := commands.get()) is not None:
            op, bounded, handle, expected = command
            try:
                if bounded not in connectors:
                    connectors[bounded] = load_ref(ref)(**{**options, **(bounded_options if bounded else {})})
                connector = connectors[bounded]
                if op == "check":
                    builder, args = expected
                    assert_payload_equal(connector.get(handle), builder(*args))
                    connector.release(handle)
                    replies.put(("ok", None))
                elif op == "get_fails":
                    try:
                        connector.get(handle)
                    except ConnectorError as exc:
                        replies.put(("ok", type(exc).__name__))
                    else:
                        replies.put(("failed", "get() of a closed producer's handle returned a payload"))
            except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails with it; keep serving
                replies.put(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        for connector in connectors.values():
            connector.close()


class ConsumerPeer:
    """A spawned process that consumes handles with its own connector, as a downstream stage would.

    `check` sends a handle (the peer gets it, compares it with the expected payload, releases it);
    `wait` collects one reply per command, in order, and raises on a failed one.
    """

    def __init__(self, ref: str, options: dict[str, Any], bounded_options: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")
        self._commands = context.Queue()
        self._replies = context.Queue()
        self._sent = 0
        self.process = context.Process(
            target=serve_as_peer, args=(ref, options, bounded_options, self._commands, self._replies), daemon=True
        )
        self.process.start()

    def check(self, handle: Any, expected: Expected, bounded: bool = False) -> None:
        """Have the peer get `handle`, compare it with ``builder(*args)`` and release it."""
        self._send(("check", bounded, handle, expected))

    def get_fails(self, handle: Any) -> None:
        """Have the peer check that getting `handle` raises a `ConnectorError`."""
        self._send(("get_fails", False, handle, None))

    def wait(self, timeout: float = 120) -> list[Any]:
        """Every outstanding reply, in order; a failed command fails the calling test."""
        results, failures = [], []
        deadline = time.monotonic() + timeout
        while self._sent:  # every reply is read, so a failure never leaks into the next test
            try:
                status, detail = self._replies.get(timeout=1)
            except queue.Empty:
                if not self.process.is_alive():
                    pytest.fail(f"the consumer peer process died (exit code {self.process.exitcode})")
                if time.monotonic() > deadline:
                    pytest.fail(f"the consumer peer process did not answer within {timeout} s")
                continue
            self._sent -= 1
            (results if status == "ok" else failures).append(detail)
        if failures:
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            pytest.fail(f"in the consumer peer process: {failures[0]}{more}")
        return results

    def stop(self) -> None:
        self._commands.put(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()

    def _send(self, command: tuple[Any, ...]) -> None:
        self._commands.put(command)
        self._sent += 1


# -- the suite --------------------------------------------------------------------------------------


class ConnectorContract:
    """Contract tests of a connector; subclass it under a ``Test*`` name (see the module doc)."""

    connector_ref: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}
    bounded_options: ClassVar[dict[str, Any]] = {}
    """Options that make capacity small enough to fill with a few 1 MiB payloads (< 64 of them)."""
    cross_process: ClassVar[bool] = True
    """False only for connectors whose two ends live in one process (``inproc``)."""
    shared_instance: ClassVar[bool] = False
    """True for connectors whose two ends must share one instance (in-process connectors)."""
    large_bytes: ClassVar[int] = 64 * MIB

    def make_connector(self, bounded: bool = False) -> Connector:
        """A new instance, as a producer or consumer process would build it."""
        options = {**self.options, **(self.bounded_options if bounded else {})}
        return load_ref(self.connector_ref)(**options)

    @pytest.fixture
    def connector(self) -> Iterator[Connector]:
        connector = self.make_connector()
        yield connector
        connector.close()

    @pytest.fixture
    def bounded(self) -> Iterator[Connector]:
        connector = self.make_connector(bounded=True)
        yield connector
        connector.close()

    @pytest.fixture(scope="class")
    @classmethod
    def peer(cls) -> Iterator[ConsumerPeer | None]:
        """The class's consumer process (None where the connector does not cross processes)."""
        if not cls.cross_process:
            yield None
            return
        if cls.shared_instance:
            pytest.fail("a shared_instance connector cannot cross processes: set cross_process = False")
        peer = ConsumerPeer(cls.connector_ref, dict(cls.options), dict(cls.bounded_options))
        try:
            yield peer
        finally:
            peer.stop()

    def consume(self, peer: ConsumerPeer | None, connector: Connector, handles: list[Any], expected: list[Expected]) -> None:
        """Get, check and release `handles` in order: in the peer process, or here when there is none."""
        if peer is None:
            for handle, (builder, args) in zip(handles, expected):
                assert_payload_equal(connector.get(handle), builder(*args))
                connector.release(handle)
            return
        for handle, item in zip(handles, expected):
            peer.check(handle, item)
        peer.wait()

    # -- a producer here, the consumer in the peer process (or here, for in-process connectors) ---

    def test_round_trip_mixed_payload(self, connector: Connector, peer: ConsumerPeer | None) -> None:
        self.consume(peer, connector, [connector.put(mixed_payload(3))], [(mixed_payload, (3,))])

    def test_payload_without_tensors(self, connector: Connector, peer: ConsumerPeer | None) -> None:
        self.consume(peer, connector, [connector.put(plain_payload())], [(plain_payload, ())])

    def test_ordering(self, connector: Connector, peer: ConsumerPeer | None) -> None:
        handles = [connector.put(mixed_payload(seed)) for seed in range(24)]
        self.consume(peer, connector, handles, [(mixed_payload, (seed,)) for seed in range(24)])

    def test_large_tensor(self, connector: Connector, peer: ConsumerPeer | None) -> None:
        handle = connector.put(large_payload(self.large_bytes, seed=7))
        self.consume(peer, connector, [handle], [(large_payload, (self.large_bytes, 7))])

    # -- one process ------------------------------------------------------------------------------

    def test_full_put_times_out_and_release_frees_capacity(self, bounded: Connector) -> None:
        payload = large_payload(MIB)
        handles = []
        with pytest.raises(ConnectorFullError):
            for _ in range(64):
                handles.append(bounded.put(payload, timeout=0.2))
        assert handles, "a bounded connector must take at least one payload"
        started = time.monotonic()
        with pytest.raises(ConnectorFullError):
            bounded.put(payload, timeout=0.3)
        assert time.monotonic() - started >= 0.25, "a full put must wait for its timeout (backpressure)"
        bounded.release(handles.pop(0))
        handles.append(bounded.put(payload, timeout=5))
        for handle in handles:
            assert_payload_equal(bounded.get(handle), payload)
            bounded.release(handle)

    def test_blocked_put_resumes_when_another_thread_releases(self, bounded: Connector) -> None:
        payload = large_payload(MIB)
        handles = []
        with pytest.raises(ConnectorFullError):
            for _ in range(64):
                handles.append(bounded.put(payload, timeout=0.2))
        releaser = threading.Timer(0.3, bounded.release, args=(handles.pop(),))
        releaser.start()
        started = time.monotonic()
        handles.append(bounded.put(payload, timeout=10))
        assert time.monotonic() - started >= 0.2, "put returned before any capacity was released"
        releaser.join()
        for handle in handles:
            bounded.release(handle)

    def test_concurrent_producer_threads(self, bounded: Connector) -> None:
        # A bounded connector, so producers also wait on each other's released capacity.
        producers, per_producer = 4, 12
        handles: queue.Queue[tuple[int, Any]] = queue.Queue()
        errors: list[BaseException] = []

        def produce(producer: int) -> None:
            try:
                for index in range(per_producer):
                    seed = producer * 1000 + index
                    handles.put((seed, bounded.put(transfer_payload(seed), timeout=30)))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        for thread in threads:
            thread.start()
        seen = set()
        for _ in range(producers * per_producer):
            seed, handle = handles.get(timeout=60)
            assert_payload_equal(bounded.get(handle), transfer_payload(seed))
            bounded.release(handle)
            seen.add(seed)
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert seen == {p * 1000 + i for p in range(producers) for i in range(per_producer)}

    def test_concurrent_consumer_threads(self, connector: Connector) -> None:
        # The engine gets and releases user-facing chunks on several threads at once.
        handles = [(seed, connector.put(mixed_payload(seed))) for seed in range(16)]
        errors: list[BaseException] = []

        def consume(share: list[tuple[int, Any]]) -> None:
            try:
                for seed, handle in share:
                    assert_payload_equal(connector.get(handle), mixed_payload(seed))
                    connector.release(handle)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=consume, args=(handles[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors

    def test_handles_are_picklable_and_work_in_another_instance(self, connector: Connector) -> None:
        handle = connector.put(mixed_payload(5))
        copied = pickle.loads(pickle.dumps(handle))
        consumer = connector if self.shared_instance else self.make_connector()
        try:
            assert_payload_equal(consumer.get(copied), mixed_payload(5))
            consumer.release(copied)
        finally:
            if consumer is not connector:
                consumer.close()

    def test_close(self, peer: ConsumerPeer | None) -> None:
        producer = self.make_connector()
        consumer = self.make_connector()
        handle = producer.put(mixed_payload(1))
        consumer.close()
        with pytest.raises(ConnectorClosedError):
            consumer.get(handle)
        producer.close()
        producer.close()  # idempotent
        with pytest.raises(ConnectorClosedError):
            producer.put(mixed_payload(2))
        with pytest.raises(ConnectorClosedError):
            producer.get(handle)
        later = self.make_connector()
        try:  # a closed producer's handles are gone for everyone, with a clear error, not garbage
            with pytest.raises(ConnectorError):
                later.get(handle)
        finally:
            later.close()
        if peer is not None:  # ... in other processes too
            peer.get_fails(handle)
            peer.wait()

    # -- across processes -----------------------------------------------------------------------

    def _context(self) -> multiprocessing.context.SpawnContext:
        if not self.cross_process:
            pytest.skip("connector does not cross processes (cross_process = False)")
        if self.shared_instance:
            pytest.fail("a shared_instance connector cannot cross processes: set cross_process = False")
        return multiprocessing.get_context("spawn")

    def test_concurrent_producer_processes(self) -> None:
        context = self._context()
        producers, per_producer = 3, 10
        handles = context.Queue()
        done = context.Event()
        options = {**self.options, **self.bounded_options}
        processes = [
            context.Process(
                target=produce_in_child,
                args=(self.connector_ref, options, p, per_producer, handles, done),
                daemon=True,
            )
            for p in range(producers)
        ]
        for process in processes:
            process.start()
        consumer = self.make_connector(bounded=True)
        seen = set()
        try:
            for _ in range(producers * per_producer):
                seed, handle = handles.get(timeout=120)
                assert seed >= 0, f"a producer process failed: {handle}"
                # Releasing here frees capacity in the producer's process: with a bounded
                # connector the producers only finish if that works.
                assert_payload_equal(consumer.get(handle), transfer_payload(seed))
                consumer.release(handle)
                seen.add(seed)
        finally:
            done.set()
            consumer.close()
            for process in processes:
                process.join(30)
        assert seen == {p * 1000 + i for p in range(producers) for i in range(per_producer)}
        assert all(process.exitcode == 0 for process in processes)

    def test_consumer_process_releases_producer_capacity(self, peer: ConsumerPeer | None) -> None:
        self._context()
        assert peer is not None
        producer = self.make_connector(bounded=True)
        try:
            # Twice the capacity: the puts only succeed if the peer's releases free pages here.
            for seed in range(24):
                peer.check(producer.put(transfer_payload(seed), timeout=60), (transfer_payload, (seed,)), bounded=True)
            assert len(peer.wait()) == 24
        finally:
            producer.close()
