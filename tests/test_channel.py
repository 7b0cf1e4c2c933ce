"""The engine <-> worker channel: framing of messages of any size in both directions, an event
loop that never waits for a slow reader, and what happens when either end goes away.

The worker's end runs in a thread here; test_engine.py runs it in spawned processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import select
import threading
import time
from multiprocessing.connection import Connection
from typing import Iterator

import pytest

from omni_core.runtime import messages as m
from omni_core.runtime.channel import EngineChannel, FrameDecoder, WorkerChannel, encode
from omni_core.runtime.replica import build_connectors, stage_connector_keys
from omni_core.runtime.worker import StageWorker
from omni_core.testing.fakes import passthrough_pipeline

pytestmark = pytest.mark.timeout(60)

PIPE_BYTES = 64 << 10  # what a Linux pipe holds by default


def make_ends(loop: asyncio.AbstractEventLoop, on_message) -> tuple[EngineChannel, WorkerChannel]:
    worker_in, engine_out = multiprocessing.Pipe(duplex=False)
    engine_in, worker_out = multiprocessing.Pipe(duplex=False)
    return EngineChannel(loop, engine_in, engine_out, on_message), WorkerChannel(worker_in, worker_out)


def packet_pipe() -> tuple[int, Connection]:
    """A pipe in packet mode: each read returns what one write wrote (up to `select.PIPE_BUF`).

    That counts writes: frames that come back from one read were written together.
    """
    read_fd, write_fd = os.pipe2(os.O_DIRECT)
    return read_fd, Connection(write_fd, readable=False)


def read_one_write(fd: int) -> list:
    return FrameDecoder().feed(os.read(fd, PIPE_BYTES))


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def emits(count: int) -> list[m.Emit]:
    return [m.Emit(f"r{i}", "next", 3, False, ("shm", i)) for i in range(count)]


def test_frames_split_anywhere_decode_to_the_same_messages() -> None:
    messages = [m.Ping(1), {"blob": b"x" * (3 * PIPE_BYTES)}, m.Abort("r" * 1000), m.Shutdown()]
    stream = b"".join(encode(message) for message in messages)
    for piece in (1, 7, 8, 9, 4096, PIPE_BYTES, len(stream)):
        decoder = FrameDecoder()
        decoded = [msg for start in range(0, len(stream), piece) for msg in decoder.feed(stream[start : start + piece])]
        assert decoded == messages
        assert decoder.pending_bytes == 0


async def test_large_messages_cross_in_both_directions_in_order() -> None:
    loop = asyncio.get_running_loop()
    received: asyncio.Queue = asyncio.Queue()
    engine, worker = make_ends(loop, received.put_nowait)
    sent = [m.Ping(0), m.Pong(1, 0, {"blob": "a" * (5 << 20)}), m.Ping(2), m.Pong(3, 0, {"blob": b"b" * (PIPE_BYTES + 1)})]

    def echo() -> None:
        for _ in sent:
            worker.send(worker.get())

    echoing = asyncio.create_task(asyncio.to_thread(echo))
    for message in sent:
        engine.send(message)
    echoed = [await asyncio.wait_for(received.get(), 30) for _ in sent]
    await echoing
    assert echoed == sent
    engine.close()
    worker.close()


async def test_send_never_blocks_the_loop_on_a_worker_that_does_not_read() -> None:
    loop = asyncio.get_running_loop()
    engine, worker = make_ends(loop, lambda message: None)
    blob = "x" * (1 << 20)
    start = time.monotonic()
    for i in range(16):  # 16 MiB: 256 times what the pipe holds
        engine.send(m.Pong(i, 0, {"blob": blob}))
    assert time.monotonic() - start < 5
    assert engine.buffered_bytes > 8 << 20

    got = await asyncio.to_thread(lambda: [worker.get() for _ in range(16)])  # the loop flushes meanwhile
    assert [pong.token for pong in got] == list(range(16))
    assert all(pong.stats["blob"] == blob for pong in got)
    assert engine.buffered_bytes == 0
    engine.close()
    worker.close()


async def test_a_worker_reads_without_blocking_between_steps() -> None:
    loop = asyncio.get_running_loop()
    engine, worker = make_ends(loop, lambda message: None)
    with pytest.raises(queue.Empty):
        worker.get(block=False)
    engine.send(m.Ping(7))
    assert await asyncio.to_thread(worker.get) == m.Ping(7)
    engine.close()
    worker.close()


async def test_when_the_worker_is_gone_sends_are_dropped_and_reading_stops() -> None:
    loop = asyncio.get_running_loop()
    received: list = []
    engine, worker = make_ends(loop, received.append)
    worker.send(m.Ready(1))
    worker.close()  # what the worker's exit does to its ends
    engine.drain()
    assert received == [m.Ready(1)]
    for _ in range(3):
        engine.send(m.Pong(0, 0, {"blob": "x" * PIPE_BYTES}))  # EPIPE inside: dropped, not raised
    await asyncio.sleep(0)  # the turn's sends are written (and dropped) after it
    assert engine.buffered_bytes == 0
    engine.close()


async def test_a_worker_sees_end_of_file_when_the_engine_is_gone() -> None:
    loop = asyncio.get_running_loop()
    engine, worker = make_ends(loop, lambda message: None)
    engine.send(m.Ping(1))
    engine.close()
    assert worker.get() == m.Ping(1)  # what was sent before still arrives
    with pytest.raises(EOFError):
        worker.get()
    with pytest.raises(EOFError):
        worker.get(block=False)
    worker.close()


# -- coalescing: one write per worker step, one per turn of the engine's loop ----------------------


@pytest.fixture
def packet_worker() -> Iterator[tuple[WorkerChannel, int]]:
    """A worker's channel writing into a `packet_pipe`, and that pipe's read end."""
    read_fd, outgoing = packet_pipe()
    incoming, _ = multiprocessing.Pipe(duplex=False)
    worker = WorkerChannel(incoming, outgoing)
    yield worker, read_fd
    worker.close()
    os.close(read_fd)


def test_a_batch_is_written_in_one_piece_at_its_end(packet_worker: tuple[WorkerChannel, int]) -> None:
    worker, read_fd = packet_worker
    worker.send(m.Ready(1))
    assert read_one_write(read_fd) == [m.Ready(1)]  # outside a batch: at once
    sent = emits(16)  # a step with 16 requests in flight
    with worker.batch():
        for message in sent:
            worker.send(message)
        assert not readable(read_fd)
    assert read_one_write(read_fd) == sent
    assert not readable(read_fd)
    worker.send(m.Pong(1, 16))
    assert read_one_write(read_fd) == [m.Pong(1, 16)]


def test_a_send_from_another_thread_during_a_batch_keeps_its_place(packet_worker: tuple[WorkerChannel, int]) -> None:
    worker, read_fd = packet_worker
    with worker.batch():
        worker.send(m.Progress("a", 0.1))
        other = threading.Thread(target=worker.send, args=(m.Progress("b", 0.2),))
        other.start()
        other.join(5)
        assert not other.is_alive()  # held, not waiting for the batch
        worker.send(m.Progress("c", 0.3))
    assert read_one_write(read_fd) == [m.Progress("a", 0.1), m.Progress("b", 0.2), m.Progress("c", 0.3)]


def test_a_batch_that_raises_still_writes_what_it_held(packet_worker: tuple[WorkerChannel, int]) -> None:
    worker, read_fd = packet_worker
    with pytest.raises(RuntimeError), worker.batch():
        worker.send(m.RequestFailed("r0", "bad"))
        with worker.batch():  # nested: written with the outer one
            worker.send(m.RequestFailed("r1", "bad"))
        assert not readable(read_fd)
        raise RuntimeError
    assert read_one_write(read_fd) == [m.RequestFailed("r0", "bad"), m.RequestFailed("r1", "bad")]


async def test_threads_sending_during_batches_never_split_a_frame() -> None:
    loop = asyncio.get_running_loop()
    received: list = []
    engine, worker = make_ends(loop, received.append)
    blob = "x" * (PIPE_BYTES // 2)  # frames larger than one atomic pipe write

    def progress() -> None:
        for i in range(50):
            worker.send(m.Progress(blob, i))

    def steps() -> None:
        for step in range(50):
            with worker.batch():
                worker.send(m.Pong(step, 0, {"blob": blob}))
                worker.send(m.Pong(step, 1))

    threads = [threading.Thread(target=progress), threading.Thread(target=steps)]
    for thread in threads:
        thread.start()
    await asyncio.to_thread(lambda: [thread.join() for thread in threads])
    await asyncio.to_thread(worker.close)
    for _ in range(500):
        if len(received) == 150:
            break
        await asyncio.sleep(0.01)
    assert [msg.fraction for msg in received if isinstance(msg, m.Progress)] == list(range(50))
    assert [(msg.token, msg.active_requests) for msg in received if isinstance(msg, m.Pong)] == [(s, a) for s in range(50) for a in (0, 1)]
    engine.close()


def test_a_worker_writes_the_emits_of_a_step_in_one_piece() -> None:
    pipeline = passthrough_pipeline(stages=1)
    stage = pipeline.stage("s0")
    connectors = build_connectors(stage_connector_keys(pipeline, stage))
    read_fd, outgoing = packet_pipe()
    incoming, engine_out = multiprocessing.Pipe(duplex=False)
    channel = WorkerChannel(incoming, outgoing)
    worker = StageWorker(pipeline, stage, 0, connectors, channel.send, channel.batch)
    serving = threading.Thread(target=worker.run, args=(channel,))
    serving.start()
    try:
        assert read_one_write(read_fd) == [m.Progress("loaded", 1.0)]
        assert isinstance(read_one_write(read_fd)[0], m.Ready)
        submits = []
        for i in range(8):
            handle = connectors["request"].put({"data": {"prompt": f"p{i}"}, "params": {}})
            submits.append(m.Submit(f"r{i}", "request", 0, True, handle, {}, (), True))
        os.write(engine_out.fileno(), b"".join(encode(submit) for submit in submits))  # one step takes all 8
        step = read_one_write(read_fd)
        assert [(emit.request_id, emit.final) for emit in step] == [(f"r{i}", True) for i in range(8)]
        assert [connectors["output"].get(emit.handle)["prompt"] for emit in step] == [f"p{i}" for i in range(8)]
    finally:
        os.write(engine_out.fileno(), encode(m.Shutdown()))
        serving.join(10)
        channel.close()
        engine_out.close()
        os.close(read_fd)
        for connector in set(connectors.values()):
            connector.close()
    assert not serving.is_alive()


async def test_sends_of_one_loop_turn_go_out_in_one_write() -> None:
    loop = asyncio.get_running_loop()
    read_fd, engine_out = packet_pipe()
    engine_in, _ = multiprocessing.Pipe(duplex=False)
    engine = EngineChannel(loop, engine_in, engine_out, lambda message: None)
    sent = [m.Submit(f"r{i}", "s0", 0, True, ("shm", i)) for i in range(16)]
    for message in sent:
        engine.send(message)
    assert not readable(read_fd)
    await asyncio.sleep(0)
    assert read_one_write(read_fd) == sent
    assert not readable(read_fd)
    engine.send(m.Ping(1))  # the next turn's own write
    await asyncio.sleep(0)
    assert read_one_write(read_fd) == [m.Ping(1)]
    engine.close()
    os.close(read_fd)


async def test_sends_queued_behind_a_full_pipe_keep_their_order() -> None:
    loop = asyncio.get_running_loop()
    engine, worker = make_ends(loop, lambda message: None)
    engine.send(m.Pong(0, 0, {"blob": "x" * (4 * PIPE_BYTES)}))
    await asyncio.sleep(0)
    assert engine.buffered_bytes > 0  # the pipe took a part; the loop writes the rest as it drains
    engine.send(m.Ping(1))
    await asyncio.sleep(0)
    engine.send(m.Ping(2))
    engine.send(m.Ping(3))
    got = await asyncio.to_thread(lambda: [worker.get() for _ in range(4)])
    assert [type(msg).__name__ for msg in got] == ["Pong", "Ping", "Ping", "Ping"]
    assert [msg.token for msg in got] == [0, 1, 2, 3]
    engine.close()
    worker.close()


async def test_close_writes_what_was_sent_in_its_turn() -> None:
    loop = asyncio.get_running_loop()
    engine, worker = make_ends(loop, lambda message: None)
    engine.send(m.Abort("r0"))
    engine.send(m.Abort("r1"))
    engine.send(m.Shutdown())
    engine.close()  # in the same turn, as a replica's stop path may
    assert [worker.get() for _ in range(3)] == [m.Abort("r0"), m.Abort("r1"), m.Shutdown()]
    with pytest.raises(EOFError):
        worker.get()
    worker.close()
