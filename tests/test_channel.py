"""The engine <-> worker channel: framing of messages of any size in both directions, an event
loop that never waits for a slow reader, and what happens when either end goes away.

The worker's end runs in a thread here; test_engine.py runs it in spawned processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time

import pytest

from omni_core.runtime import messages as m
from omni_core.runtime.channel import EngineChannel, FrameDecoder, WorkerChannel, encode

pytestmark = pytest.mark.timeout(60)

PIPE_BYTES = 64 << 10  # what a Linux pipe holds by default


def make_ends(loop: asyncio.AbstractEventLoop, on_message) -> tuple[EngineChannel, WorkerChannel]:
    worker_in, engine_out = multiprocessing.Pipe(duplex=False)
    engine_in, worker_out = multiprocessing.Pipe(duplex=False)
    return EngineChannel(loop, engine_in, engine_out, on_message), WorkerChannel(worker_in, worker_out)


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
