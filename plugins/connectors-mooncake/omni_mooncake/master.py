"""`MooncakeMaster`: a ``mooncake_master`` process on loopback, owned and stopped by this process.

The store connector's embedded default: an instance built without ``master`` starts one on free
ports of 127.0.0.1, shares its address (`Connector.shared_options`) and stops it in `close`. Tests
and other tools use it through `omni_mooncake.testing.start_master`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import weakref

from omni_core.errors import ConnectorError
from omni_mooncake.mooncake_bridge import master_binary
from omni_mooncake.net import free_port, port_open, sleep_backoff

_START_ATTEMPTS = 3


def _terminate(process: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if process.poll() is None:
        process.terminate()  # SIGTERM: the master shuts down gracefully in a few ms
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _stop(process: subprocess.Popen[bytes], log_path: str) -> None:
    _terminate(process)
    try:
        os.unlink(log_path)
    except FileNotFoundError:
        pass


class MooncakeMaster:
    """A running ``mooncake_master`` bound to `host` (loopback by default): `address` is ``HOST:PORT``.

    `lease_ttl_s` is the read lease every get grants (the object cannot be removed without force
    until it ends); the connectors remove with force after their single read, so a short lease
    only matters to other clients. The HTTP metadata server stays off: the connectors handshake
    peer to peer (``P2PHANDSHAKE``). The master's log goes to a temporary file, quoted when it
    fails to start. Stopped by `stop`, or when this object is collected or the interpreter exits
    (a SIGKILLed owner leaves it running: it holds two ports and no data worth keeping).
    """

    def __init__(self, host: str = "127.0.0.1", lease_ttl_s: float = 2.0, start_timeout_s: float = 10.0) -> None:
        self.host = host
        binary = str(master_binary())
        last_error = ""
        for _ in range(_START_ATTEMPTS):  # a free port may be taken before the master binds it
            rpc_port, metrics_port = free_port(host), free_port(host)
            log = tempfile.NamedTemporaryFile(prefix="omni-mooncake-master-", suffix=".log", delete=False)
            command = [
                binary,
                f"--rpc_address={host}",
                f"--rpc_port={rpc_port}",
                f"--metrics_host={host}",
                f"--metrics_port={metrics_port}",
                f"--default_kv_lease_ttl={int(lease_ttl_s * 1000)}",
                "--logtostderr=true",  # glog would otherwise write files under /tmp
                "--rpc_thread_num=2",
            ]
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
            log.close()
            if self._wait_ready(process, rpc_port, start_timeout_s):
                self.process = process
                self.port = rpc_port
                self.address = f"{host}:{rpc_port}"
                self._finalizer = weakref.finalize(self, _stop, process, log.name)
                return
            _terminate(process)
            last_error = self._log_tail(log.name)
            _stop(process, log.name)
        raise ConnectorError(f"mooncake_master did not start on {host} ({_START_ATTEMPTS} attempts); its log ends with:\n{last_error}")

    def _wait_ready(self, process: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while time.monotonic() < deadline:
            if process.poll() is not None:
                return False
            if port_open(self.host, port):
                return True
            delay = sleep_backoff(delay, deadline, 0.1)
        return False

    @staticmethod
    def _log_tail(path: str, lines: int = 20) -> str:
        try:
            with open(path, errors="replace") as log:
                return "".join(log.readlines()[-lines:]) or "(empty)"
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        """Whether the master process is still running."""
        return self.process.poll() is None

    def stop(self) -> None:
        """Stop the master (SIGTERM, then SIGKILL after 5 s); idempotent."""
        self._finalizer()
