"""Message channels between the engine and a worker process: pickled frames over two pipes.

A frame is an 8-byte big-endian length followed by that many bytes of pickle. The engine's end is
served by its event loop (a reader callback on the pipe; writes that the pipe does not take at once
are buffered and flushed when it drains), so no thread hands messages over and the loop never
blocks on a slow worker. The worker's end reads its pipe directly: a blocking read when it is idle,
a non-blocking drain between steps. Its writes may block while the pipe is full: that is the
backpressure a worker should feel, and the engine's loop always reads.

The pipes are `multiprocessing` connections because those are what a spawned child can inherit;
only their file descriptors are used. The engine's end uses `loop.add_reader`/`add_writer` rather
than asyncio's pipe transports because those are made by a coroutine, and a replica is started (or
restarted, from a callback) synchronously.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import pickle
import queue
import select
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!Q")
READ_SIZE = 1 << 16  # a Linux pipe holds 64 KiB by default: one read takes what it has


def encode(message: Any) -> bytes:
    """One frame: length prefix and pickle of `message`."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class FrameDecoder:
    """Turns a byte stream, fed in any pieces, back into messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        """The messages completed by `data`, in order; a partial frame is kept for the next feed."""
        if self._buffer:
            self._buffer += data
            data = self._buffer
        messages = []
        start = 0
        with memoryview(data) as view:
            while len(data) - start >= _LENGTH.size:
                (size,) = _LENGTH.unpack_from(data, start)
                end = start + _LENGTH.size + size
                if len(data) < end:
                    break
                messages.append(pickle.loads(view[start + _LENGTH.size : end]))
                start = end
        if data is self._buffer:
            del self._buffer[:start]
        elif start < len(data):
            self._buffer = bytearray(data[start:])
        return messages

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buffer)


class WorkerChannel:
    """The worker's end: an inbox (`get`, as `queue.SimpleQueue` has it) and `send`.

    `get` raises `queue.Empty` when it must not block and no whole message has arrived, and
    `EOFError` once the engine's end is closed.
    """

    def __init__(self, incoming: Connection, outgoing: Connection) -> None:
        self._incoming = incoming
        self._outgoing = outgoing
        self._read_fd = incoming.fileno()
        self._write_fd = outgoing.fileno()
        self._decoder = FrameDecoder()
        self._received: collections.deque[Any] = collections.deque()
        self._poll = select.poll()
        self._poll.register(self._read_fd, select.POLLIN)
        self._write_lock = threading.Lock()  # a runtime may report progress from its own threads

    def get(self, block: bool = True) -> Any:
        while not self._received:
            if not block and not self._poll.poll(0):
                raise queue.Empty
            data = os.read(self._read_fd, READ_SIZE)
            if not data:
                raise EOFError("the engine closed its end of the channel")
            self._received.extend(self._decoder.feed(data))
        return self._received.popleft()

    def send(self, message: Any) -> None:
        frame = memoryview(encode(message))
        with self._write_lock:
            while frame:
                frame = frame[os.write(self._write_fd, frame) :]

    def close(self) -> None:
        self._incoming.close()
        self._outgoing.close()


class EngineChannel:
    """The engine's end of a worker's pipes, served by the event loop it is created on.

    Every message from the worker is passed to `on_message` on the loop, in order. `send` must be
    called on the loop's thread; it never blocks, and after the worker has gone it drops the
    message (whoever watches the process reports the death). Reading stops at end of file.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        incoming: Connection,
        outgoing: Connection,
        on_message: Callable[[Any], None],
    ) -> None:
        self._loop = loop
        self._incoming = incoming
        self._outgoing = outgoing
        self._read_fd = incoming.fileno()
        self._write_fd = outgoing.fileno()
        self._on_message = on_message
        self._decoder = FrameDecoder()
        self._unsent: collections.deque[memoryview] = collections.deque()
        self._reading = True
        self._writing = True
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        loop.add_reader(self._read_fd, self._read)

    # -- worker -> engine ------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            data = os.read(self._read_fd, READ_SIZE)
        except BlockingIOError:
            return
        self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        if not data:
            self._stop_reading()
            return
        for message in self._decoder.feed(data):
            try:
                self._on_message(message)
            except Exception:  # one bad handler must not lose the messages behind it
                logger.exception("handling worker message %r failed", type(message).__name__)

    def drain(self) -> None:
        """Deliver everything the pipe holds now (the worker has exited), then stop reading."""
        while self._reading:
            try:
                data = os.read(self._read_fd, READ_SIZE)
            except BlockingIOError:
                break
            self._deliver(data)
        self._stop_reading()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._read_fd)
            if self._decoder.pending_bytes:
                logger.warning("a worker's channel closed in the middle of a message (%d bytes)", self._decoder.pending_bytes)

    # -- engine -> worker ------------------------------------------------------------------------

    def send(self, message: Any) -> None:
        if not self._writing:
            return
        frame = memoryview(encode(message))
        if not self._unsent:
            try:
                frame = frame[os.write(self._write_fd, frame) :]
            except BlockingIOError:
                pass
            except OSError:  # BrokenPipeError: the worker is gone
                self._stop_writing()
                return
            if not frame:
                return
            self._loop.add_writer(self._write_fd, self._flush)
        self._unsent.append(frame)

    def _flush(self) -> None:
        unsent = self._unsent
        try:
            while unsent:
                written = os.write(self._write_fd, unsent[0])
                if written < len(unsent[0]):
                    unsent[0] = unsent[0][written:]
                    return
                unsent.popleft()
        except BlockingIOError:
            return
        except OSError:
            self._stop_writing()
            return
        self._loop.remove_writer(self._write_fd)

    def _stop_writing(self) -> None:
        if self._writing:
            self._writing = False
            if self._unsent:
                self._unsent.clear()
                self._loop.remove_writer(self._write_fd)

    @property
    def buffered_bytes(self) -> int:
        """Bytes sent but not yet taken by the pipe."""
        return sum(len(frame) for frame in self._unsent)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop reading and writing (unsent messages are dropped) and close the pipes; idempotent."""
        self._stop_reading()
        self._stop_writing()
        self._incoming.close()
        self._outgoing.close()
