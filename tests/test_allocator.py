"""`allocator`: which library a stage's worker process is spawned with (``LD_PRELOAD``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core.config.resolve import resolve
from omni_core.errors import ConfigError
from omni_core.runtime.allocator import allocator_environment, find_library, preloaded


def _libs(directory: Path, *names: str) -> list[str]:
    for name in names:
        (directory / name).touch()
    return [str(directory)]


@pytest.fixture(autouse=True)
def _no_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", raising=False)


def test_auto_prefers_tcmalloc_then_jemalloc_then_the_system(tmp_path: Path) -> None:
    both = _libs(tmp_path, "libtcmalloc_minimal.so.4", "libjemalloc.so.2")
    env = allocator_environment("auto", "s", both)
    assert env["LD_PRELOAD"] == str(tmp_path / "libtcmalloc_minimal.so.4")
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # no line per KV cache allocation
    (tmp_path / "libtcmalloc_minimal.so.4").unlink()
    assert allocator_environment("auto", "s", both) == {"LD_PRELOAD": str(tmp_path / "libjemalloc.so.2")}
    (tmp_path / "libjemalloc.so.2").unlink()
    assert allocator_environment("auto", "s", both) == {}
    assert allocator_environment("system", "s", _libs(tmp_path, "libtcmalloc_minimal.so.4")) == {}


def test_the_library_goes_in_front_of_what_is_preloaded_and_an_operators_choice_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs = _libs(tmp_path, "libtcmalloc_minimal.so.4", "libjemalloc.so.2")
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libgomp.so.1")
    assert allocator_environment("jemalloc", "s", dirs)["LD_PRELOAD"] == f"{tmp_path}/libjemalloc.so.2:/opt/lib/libgomp.so.1"
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libgomp.so.1 /usr/lib/libjemalloc.so.2")
    assert preloaded() == "jemalloc"
    assert allocator_environment("tcmalloc", "s", dirs) == {}


def test_an_allocator_that_is_not_installed_names_its_package(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"stage 'talker'.*'jemalloc' is not installed.*apt-get install libjemalloc2"):
        allocator_environment("jemalloc", "talker", [str(tmp_path)])
    with pytest.raises(ConfigError, match="allocator must be one of auto, system, tcmalloc, jemalloc"):
        allocator_environment("mimalloc", "talker", [str(tmp_path)])


def test_an_unknown_allocator_in_the_deploy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="allocator"):
        resolve("omni-tiny/toy", overrides=["lm.allocator=mimalloc"])


def test_tcmalloc_is_installed() -> None:
    """scripts/install.sh installs it (libtcmalloc-minimal4): the stage processes run on it."""
    assert find_library("tcmalloc") is not None
