"""Message channels between the engine and a worker process: pickled frames over two pipes.

A frame is an 8-byte big-endian length followed by that many bytes of pickle. The engine's end is
served by its event loop (a reader callback on the pipe; writes that the pipe does not take at once
are buffered and flushed when it drains), so no thread hands messages over and the loop never
blocks on a slow worker. The worker's end reads its pipe directly: a blocking read when it is idle,
a non-blocking drain between steps. Its writes may block while the pipe is full: that is the
backpressure a worker should feel, and the engine's loop always reads.

Both ends coalesce: a step's worth of messages (a worker's `batch`, one event-loop turn on the
engine's end) goes out as one write. A step emits a message or two per request, and a system call
per message was a visible share of a stage process's time; the reader takes several frames per
read anyway.

The pipes are `multiprocessing` connections because those are what a spawned child can inherit;
only their file descriptors are used. The engine's end uses `loop.add_reader`/`add_writer` rather
than asyncio's pipe transports because those are made by a coroutine, and a replica is started (or
restarted, from a callback) synchronously.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import pickle
import queue
import select
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator

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
    """The worker's end: an inbox (`get`, as `queue.SimpleQueue` has it), `send` and `batch`.

    `get` raises `queue.Empty` when it must not block and no whole message has arrived, and
    `EOFError` once the engine's end is closed. `send` may be called from any thread.
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
        self._batches = 0  # open `batch` blocks; while any is, frames wait in `_held`
        self._held: list[bytes] = []

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
        """Write `message` now, or at the end of the open `batch` (it blocks while the pipe is full)."""
        frame = encode(message)
        with self._write_lock:
            if self._batches:
                self._held.append(frame)
            else:
                self._write(frame)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold every `send` until the block ends, then write them all at once (blocks nest).

        Sends from other threads meanwhile are held too, so the pipe carries messages in the order
        `send` was called; the held ones are written even if the block raises.
        """
        with self._write_lock:
            self._batches += 1
        try:
            yield
        finally:
            with self._write_lock:
                self._batches -= 1
                if not self._batches and self._held:
                    held = b"".join(self._held)
                    self._held.clear()
                    self._write(held)

    def _write(self, data: bytes) -> None:
        """Write all of `data`; the caller holds the write lock, so frames never interleave."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._write_fd, view) :]

    def close(self) -> None:
        self._incoming.close()
        self._outgoing.close()


class EngineChannel:
    """The engine's end of a worker's pipes, served by the event loop it is created on.

    Every message from the worker is passed to `on_message` on the loop, in order. `send` must be
    called on the loop's thread; it never blocks, and after the worker has gone it drops the
    message (whoever watches the process reports the death). What is sent during one turn of the
    loop is written together at the next (handling one read of worker messages sends several).
    Reading stops at end of file.
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
        self._pending: list[bytes] = []  # frames sent this turn, written by `_write_pending`
        self._pending_write: asyncio.Handle | None = None
        self._unsent: collections.deque[memoryview] = collections.deque()  # not taken by the pipe yet: `_flush` writes it as it drains
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

    @property
    def reading(self) -> bool:
        """False once the worker's end is closed (end of file read) or `close` was called."""
        return self._reading

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
        """Queue `message`; the frames of this turn of the loop are written together soon after."""
        if not self._writing:
            return
        self._pending.append(encode(message))
        if self._pending_write is None:
            self._pending_write = self._loop.call_soon(self._write_pending)

    def _write_pending(self) -> None:
        """Write the queued frames in one piece, behind whatever the pipe has not taken yet."""
        if self._pending_write is not None:
            self._pending_write.cancel()  # when `close` writes them before their turn
            self._pending_write = None
        if not self._pending:
            return
        data = memoryview(b"".join(self._pending))
        self._pending.clear()
        if not self._unsent:
            try:
                data = data[os.write(self._write_fd, data) :]
            except BlockingIOError:
                pass
            except OSError:  # BrokenPipeError: the worker is gone
                self._stop_writing()
                return
            if not data:
                return
            self._loop.add_writer(self._write_fd, self._flush)
        self._unsent.append(data)

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
            self._pending.clear()
            if self._pending_write is not None:
                self._pending_write.cancel()
                self._pending_write = None
            if self._unsent:
                self._unsent.clear()
                self._loop.remove_writer(self._write_fd)

    @property
    def buffered_bytes(self) -> int:
        """Bytes sent but not yet taken by the pipe."""
        return sum(len(frame) for frame in self._pending) + sum(len(frame) for frame in self._unsent)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop reading and writing and close the pipes; idempotent.

        This turn's messages are written first, as far as the pipe takes them without blocking (a
        `Shutdown` sent just before still arrives); what it does not take is dropped.
        """
        if self._writing:
            self._write_pending()
        self._stop_reading()
        self._stop_writing()
        self._incoming.close()
        self._outgoing.close()
