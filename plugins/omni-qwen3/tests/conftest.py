"""Fixtures shared by the plugin's tests: one tiny checkpoint per test session (read-only) and the
transformers model loaded from it per module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen3-Omni checkpoint (tests must not modify it: copy it first)."""
    from omni_qwen3.tiny import make_tiny

    directory = tmp_path_factory.mktemp("qwen3-omni-tiny")
    make_tiny(directory)
    return directory


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Any:
    """transformers' Qwen3OmniMoeForConditionalGeneration on the tiny checkpoint."""
    from omni_qwen3.reference import load_model

    return load_model(tiny_dir)
