"""`file`: payloads pass through files in a directory that producer and consumer both reach."""
import contextlib
import os
import pickle
import uuid

from omni_core.connectors.base import Connector
from omni_core.connectors.capacity import SharedCapacity
from omni_core.errors import ConnectorError


class FileConnector(Connector):
    """Options: `root` (the directory), `max_bytes` (bound of the bytes stored, 0: none),
    `put_timeout_s` (how long a put waits for room)."""

    def __init__(self, root: str, max_bytes: int = 0, put_timeout_s: float = 60.0):
        super().__init__(root=root, max_bytes=max_bytes, put_timeout_s=put_timeout_s)
        self.own = os.path.join(root, uuid.uuid4().hex)  # what this instance puts, until released
        os.makedirs(self.own)
        self.capacity = SharedCapacity(os.path.join(root, "capacity"), max_bytes or None, what=f"file connector at {root}")

    def put(self, payload, timeout=None):
        self.check_open()
        data = pickle.dumps(payload, protocol=5)
        self.capacity.acquire(len(data), self.options["put_timeout_s"] if timeout is None else timeout)
        path = os.path.join(self.own, uuid.uuid4().hex)
        with open(path + ".tmp", "wb") as file:
            file.write(data)
        os.rename(path + ".tmp", path)  # never seen half-written
        return path, len(data)

    def get(self, handle):
        self.check_open()
        try:
            with open(handle[0], "rb") as file:
                return pickle.load(file)
        except FileNotFoundError:
            raise ConnectorError(f"{handle[0]} is gone: released already, or its producer closed") from None

    def release(self, handle):
        try:
            os.remove(handle[0])
        except FileNotFoundError:
            return  # its producer closed and freed it
        self.capacity.release(handle[1])

    def close(self):
        if self.closed:
            return
        super().close()
        for name in os.listdir(self.own):  # put here, never released: gone for every consumer
            path = os.path.join(self.own, name)
            with contextlib.suppress(FileNotFoundError):  # a consumer released it meanwhile
                self.release((path, os.path.getsize(path)))
        with contextlib.suppress(OSError):
            os.rmdir(self.own)
        self.capacity.close()
