"""Fixtures several test modules of the core share: the toy family's tiny checkpoint (one write per
session) and a plugin host with every installed plugin."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core.plugins import load_plugins


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy family's (tests/toy-plugin) tiny checkpoint."""
    from omni_toy.tiny import make_tiny

    path = tmp_path_factory.mktemp("toy")
    make_tiny(path, "tiny")
    return path


@pytest.fixture(scope="module")
def host():
    return load_plugins()
