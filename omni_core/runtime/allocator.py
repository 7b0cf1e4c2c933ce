"""The memory allocator of a stage's worker process (`StageDeploy.allocator`).

glibc's malloc serves a long-running PyTorch process on CPU poorly: tensors of many sizes, freed in
any order, fragment its single heap, so a decoder stage's resident memory creeps up for tens of
minutes under varied load (the qwen3-omni soak: code2wav +12% in 30 min), and every new tensor of a
few MiB page-faults unless its thresholds are raised (`keep_freed_memory`). tcmalloc (what vLLM
preloads on CPU) and jemalloc keep per-size free lists instead. A library cannot be swapped inside
a running process, so the engine preloads it (``LD_PRELOAD``) into the worker it spawns.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import get_args

from omni_core.config.deploy import Allocator
from omni_core.errors import ConfigError

# Allocator -> (file name pattern, the Debian/Ubuntu package that installs it).
LIBRARIES = {
    "tcmalloc": ("libtcmalloc_minimal.so*", "libtcmalloc-minimal4"),
    "jemalloc": ("libjemalloc.so*", "libjemalloc2"),
}
ALLOCATORS: tuple[str, ...] = get_args(Allocator)
_SYSTEM_DIRS = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
    "/usr/lib64", "/usr/lib", "/usr/local/lib",
)
# gperftools prints a line for every allocation above this (default 1 GiB): a KV cache is one.
_TCMALLOC_REPORT = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"


def library_dirs() -> list[str]:
    """Where allocator libraries are looked for: vLLM's bundled ``vllm/libs`` (its CPU wheels ship
    tcmalloc there), then the system's library directories."""
    dirs = []
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        dirs += [os.path.join(location, "libs") for location in spec.submodule_search_locations]
    return dirs + list(_SYSTEM_DIRS)


def find_library(allocator: str, dirs: list[str] | None = None) -> str | None:
    """The path of `allocator`'s shared library (``tcmalloc`` or ``jemalloc``), or ``None``."""
    pattern = LIBRARIES[allocator][0]
    for directory in library_dirs() if dirs is None else dirs:
        found = sorted(glob.glob(os.path.join(directory, pattern)))
        if found:
            return found[0]
    return None


def preloaded(value: str | None = None) -> str | None:
    """The allocator an ``LD_PRELOAD`` value (this process's by default) already names, if any."""
    entries = (os.environ.get("LD_PRELOAD", "") if value is None else value).replace(" ", ":").split(":")
    for name in LIBRARIES:
        if any(Path(entry).name.startswith(f"lib{name}") for entry in entries if entry):
            return name
    return None


def allocator_environment(allocator: str, stage: str, dirs: list[str] | None = None) -> dict[str, str]:
    """The environment that makes a worker process of `stage` run on `allocator` (see `ALLOCATORS`):
    ``LD_PRELOAD`` with the library in front of what is there. Empty for ``system``, for ``auto``
    where neither library is installed, and where ``LD_PRELOAD`` already names one (the operator's
    choice wins). An explicit allocator that is not installed is a `ConfigError` naming the package."""
    if allocator not in ALLOCATORS:
        raise ConfigError(f"stage {stage!r}: allocator must be one of {', '.join(ALLOCATORS)}, got {allocator!r}")
    if allocator == "system" or preloaded() is not None:
        return {}
    candidates = list(LIBRARIES) if allocator == "auto" else [allocator]
    for name in candidates:
        path = find_library(name, dirs)
        if path is not None:
            current = os.environ.get("LD_PRELOAD", "")
            env = {"LD_PRELOAD": f"{path}:{current}" if current else path}
            if name == "tcmalloc" and _TCMALLOC_REPORT not in os.environ:
                env[_TCMALLOC_REPORT] = str(1 << 40)
            return env
    if allocator == "auto":
        return {}
    package = LIBRARIES[allocator][1]
    raise ConfigError(
        f"stage {stage!r}: allocator {allocator!r} is not installed (no {LIBRARIES[allocator][0]} in "
        f"{', '.join(library_dirs() if dirs is None else dirs)}); install it (Debian/Ubuntu: apt-get install {package}) "
        "or set allocator: auto"
    )


def running_allocator() -> str:
    """The allocator this process runs on, from the libraries mapped into it: ``tcmalloc``,
    ``jemalloc`` or ``system`` (the C library's)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    for name in LIBRARIES:
        if f"/lib{name}" in maps:
            return name
    return "system"


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with `values` set for the block (what a process spawned in it inherits), then
    as it was."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
