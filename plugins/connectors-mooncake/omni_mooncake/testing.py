"""Test helpers: a Mooncake master on loopback for a test's duration.

    from omni_mooncake.testing import start_master

    with start_master() as master:          # "127.0.0.1:PORT"
        options = {"master": master}
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from omni_mooncake.master import MooncakeMaster


@contextmanager
def start_master(host: str = "127.0.0.1", lease_ttl_s: float = 2.0) -> Iterator[str]:
    """Run a ``mooncake_master`` on free ports of `host` (2 s read lease) and yield ``"HOST:PORT"``;
    stop it on exit. Takes well under a second."""
    master = MooncakeMaster(host=host, lease_ttl_s=lease_ttl_s)
    try:
        yield master.address
    finally:
        master.stop()
