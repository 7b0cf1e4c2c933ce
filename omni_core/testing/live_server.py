"""`LiveServer`: a real ``omni serve`` subprocess on a free loopback port, for tests and benchmarks.

It runs in its own session (process group), so a test can send SIGINT to the whole group as a
terminal's Ctrl-C would, and its log goes to a file (a full pipe would block the server).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import attrs

from omni_core.errors import OmniError


PORT_ATTEMPTS = 3

_LAUNCH_ENV = dict(os.environ)
# This process's environment when this module was first imported (the test run's root conftest
# imports it before any test runs). Libraries that later run in the test process write their
# settings into os.environ for their own children: vLLM's CPU platform sets LD_PRELOAD to torch's
# libgomp, VLLM_* and torch inductor variables. A server started with those is not the one a user
# starts from a shell: with that libgomp preloaded, the stage processes' OpenMP threads spin and a
# qwen3 cancel took up to 6 s instead of 0.6 s on two cores.


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a shell would give a command started now: this process's as it was before
    any test ran (`_LAUNCH_ENV`), plus `extra`."""
    return {**_LAUNCH_ENV, **(extra or {})}


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def omni_command() -> list[str]:
    """The ``omni`` command of this interpreter's environment."""
    script = Path(sys.executable).with_name("omni")
    return [str(script)] if script.exists() else [sys.executable, "-m", "omni_cli.main"]


def leftover_processes(processes: list[Any], grace: float = 10.0) -> list[str]:
    """Of `processes` (psutil.Process objects), those still alive after `grace` seconds ("pid command")."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=grace)
    left = []
    for proc in alive:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left


@attrs.define
class LiveServer:
    """A started ``omni serve MODEL`` process; `url` is its base URL (no trailing slash)."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    api_key: str | None = None
    # psutil.Process objects: they refuse to signal a pid that was reused by another process.
    descendants: list[Any] = attrs.field(factory=list)

    @classmethod
    def start(
        cls,
        model: str,
        *,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
    ) -> "LiveServer":
        """Start ``omni serve model --port P *args`` and wait until ``/health`` answers 200.

        `api_key` is passed as ``--api-key`` (None: no key, unless `env` sets ``OMNI_API_KEY``).
        """
        for attempt in range(PORT_ATTEMPTS):
            # The port is free when chosen, but another process may take it before `omni serve`
            # binds it (the server binds before loading, so this window is its start-up only).
            server = cls.launch(model, args=args, env=env, api_key=api_key)
            process = server.process
            try:
                server.wait_ready(timeout)
            except OmniError:
                server.kill()
                if attempt + 1 < PORT_ATTEMPTS and process.returncode is not None and "already in use" in server.log_tail():
                    continue
                raise
            except BaseException:
                server.kill()
                raise
            return server
        raise AssertionError("unreachable")

    @classmethod
    def launch(
        cls, model: str, *, args: Sequence[str] = (), env: dict[str, str] | None = None, api_key: str | None = None
    ) -> "LiveServer":
        """Start ``omni serve model`` on a free port and return at once (`start` waits until it serves)."""
        key = api_key if api_key is not None else (env or {}).get("OMNI_API_KEY")
        port = free_port()
        log = Path(tempfile.mkstemp(prefix=f"omni-serve-{port}-", suffix=".log")[1])
        command = [*omni_command(), "serve", model, "--port", str(port), *args]
        if api_key is not None:
            command += ["--api-key", api_key]
        with log.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=launch_env(env), start_new_session=True)
        return cls(process, f"http://127.0.0.1:{port}", log, key)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise OmniError(f"`omni serve` exited with code {self.process.returncode} before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.descendants = self.children()
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise OmniError(f"`omni serve` was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def children(self) -> list[Any]:
        """Every process below the server (stage workers and their helpers), now (psutil)."""
        import psutil

        try:
            return list(psutil.Process(self.process.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return []

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, sig: int = signal.SIGTERM, *, group: bool = False, timeout: float = 60.0) -> int:
        """Send `sig` (to the whole process group with `group`, as Ctrl-C does) and wait for the exit code."""
        if self.process.poll() is None:
            known = {p.pid for p in self.descendants}
            self.descendants += [p for p in self.children() if p.pid not in known]
            if group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise OmniError(f"`omni serve` did not exit within {timeout:.0f} s of signal {sig}:\n{self.log_tail()}") from None

    def leftover_processes(self, grace: float = 10.0) -> list[str]:
        """Descendants seen while it ran that are still alive after `grace` seconds."""
        return leftover_processes(self.descendants, grace)

    def kill(self) -> None:
        """Stop everything it started, whatever state it is in (cleanup of a failed test)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(30)
        import psutil

        for proc in self.descendants:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        """Stop it politely (SIGTERM), then forcefully if needed."""
        try:
            self.stop(signal.SIGTERM, timeout=30)
        except OmniError:
            pass
        finally:
            self.kill()
