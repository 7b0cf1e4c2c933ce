"""Addresses: which one this process advertises, free ports, waiting for a listener."""

from __future__ import annotations

import socket
import time

from omni_core.errors import ConfigError

AUTO_HOST = "auto"


def resolve_host(host: str) -> str:
    """The address this process's Mooncake endpoint listens on and tells its peers.

    ``"auto"`` is the address this machine's own hostname resolves to (``/etc/hosts`` or DNS): on
    several hosts every worker is built from the same options, so a literal address cannot fit
    them all. Nothing is contacted to find it (no route lookup towards a public address): a
    hostname that resolves to loopback is refused, since peers on other hosts could not reach it.
    """
    if host != AUTO_HOST:
        return host
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as exc:
        raise ConfigError(f"host: auto could not resolve this machine's hostname {name!r} ({exc}); set host to this host's address", key="host") from None
    if address.startswith("127."):
        raise ConfigError(
            f"host: auto resolved this machine's hostname {name!r} to the loopback address {address}, which other "
            "hosts cannot reach; map the hostname to this host's network address (/etc/hosts) or set host explicitly",
            key="host",
        )
    return address


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the kernel's pick; a server started next may lose it
    to another process, so callers that start one retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


def split_address(address: str, what: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``, with a `ConfigError` naming `what` when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"expected HOST:PORT, got {address!r}", key=what)
    return host, int(port)


def sleep_backoff(delay: float, deadline: float, cap: float) -> float:
    """Sleep `delay` (never past `deadline`) and return the next delay: doubled, at most `cap`.

    Waits that depend on another process (a release there, a server starting) poll, since no
    signal crosses from there; doubling keeps the first answers quick and the idle cost low.
    """
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
    return min(delay * 2, cap)
