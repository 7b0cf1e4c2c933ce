"""Fixtures of the Mooncake connector tests: a real master on loopback (ephemeral ports, 2 s lease).

Mooncake must import here: a test run on a machine without it (or without libibverbs) fails at the
first fixture with the install command, instead of skipping.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omni_mooncake.testing import start_master


@pytest.fixture(scope="session")
def master() -> Iterator[str]:
    """``"127.0.0.1:PORT"`` of a master shared by the session's tests."""
    with start_master() as address:
        yield address
