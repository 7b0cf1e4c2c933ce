"""The plugins under docs/examples work: each runs its own tests (the contract suites), as its
author would, in a fresh interpreter that finds the example's package on PYTHONPATH (the test
environment itself is left as it was)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_core.testing.live_server import launch_env

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


@pytest.mark.parametrize("example", ["omni-fileconn"])
def test_the_example_passes_its_own_tests(example: str, tmp_path: Path) -> None:
    root = EXAMPLES / example
    env = launch_env({"PYTHONPATH": str(root)})
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root), str(root / "tests")]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
