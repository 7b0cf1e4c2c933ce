"""The one module that touches the `mooncake` package: lazy imports, the master binary, error codes.

Mooncake's extension modules (``store.so``, ``engine.so``) link Debian's libibverbs and libnl even
for TCP, so on a bare machine ``import mooncake.store`` fails with an ``ImportError`` naming a
shared library. Every import goes through here and turns that into `MooncakeUnavailableError`,
whose message carries the install command; nothing imports Mooncake at plugin load.

Every import also sets Mooncake's log level first (`default_log_level`): its native code logs
with glog to stderr, INFO included, a dozen lines per client and one at every close.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from omni_core.errors import ConnectorError, MissingDependencyError

PIP_INSTALL = "pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1'"
APT_INSTALL = "apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200"
_SYSTEM_LIBRARIES = ("libibverbs", "libnl-3", "libnl-route-3", "librdmacm", "libnuma")

# Mooncake's two log-level variables and their matching values (glog severities: 0 INFO,
# 1 WARNING, 2 ERROR). glog reads GLOG_minloglevel when Mooncake's libglog loads; Mooncake's
# transfer engine then overwrites that level with MC_LOG_LEVEL (INFO when unset) as it reads its
# config, at the first client's setup: both must agree, or the level changes halfway.
GLOG_LEVEL_VARIABLE = "GLOG_minloglevel"
MC_LOG_LEVEL_VARIABLE = "MC_LOG_LEVEL"
DEFAULT_LOG_LEVEL = "WARNING"
_GLOG_LEVELS = {"TRACE": "0", "INFO": "0", "WARNING": "1", "ERROR": "2"}
_MC_LEVELS = {"0": "INFO", "1": "WARNING", "2": "ERROR", "3": "ERROR"}

# Mooncake's ErrorCode values met by these connectors (mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200
"""The store has no room for the object (every mounted segment is full)."""
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
"""`remove` without force while a reader's lease holds (granted by every get)."""
LEASE_EXPIRED = -707
"""A get whose transfer outlasted the read lease the master granted it (a large object on a busy
host: the first 64 MiB read into never-touched pages took over the 2 s lease there)."""
_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
}


class MooncakeUnavailableError(MissingDependencyError, ConnectorError):
    """Mooncake (or a system library it links) is not installed; the message says how to install it.

    A `ConnectorError` too, so that building a connector on an edge reports it as it is (the core
    wraps other exceptions of a constructor in a `ConfigError`).
    """


def unavailable_message(exc: BaseException) -> str:
    """What to tell the user when importing Mooncake raised `exc`.

    A missing shared library (``libibverbs.so.1: cannot open shared object file``) needs the
    Debian packages; a missing Python package needs pip. Both commands are in the message when
    the cause is unclear, since a partial install can fail either way.
    """
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) or any(name in str(exc) for name in _SYSTEM_LIBRARIES):
        return f"Mooncake cannot load a system library it needs ({text}); install them: {APT_INSTALL}"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "mooncake":
        return f"the Mooncake connectors need the mooncake package ({text}): {PIP_INSTALL}"
    return f"Mooncake failed to import ({text}); reinstall it with {PIP_INSTALL}, and its system libraries with {APT_INSTALL}"


def default_log_level(environ: MutableMapping[str, str] = os.environ) -> None:
    """Make Mooncake log warnings and errors only, unless the user chose a level.

    Called before Mooncake's libraries load (every import below goes through it). Neither
    variable set: both set to WARNING. One set: the other set to match, so the user's choice holds
    from the library's load on. Both set: left alone. Mooncake's INFO lines (segment mounts,
    handshakes, a ``removeSegmentDesc ... finish`` at every close) are for debugging Mooncake
    itself: ``MC_LOG_LEVEL=INFO`` brings them back.
    """
    glog, mooncake = environ.get(GLOG_LEVEL_VARIABLE), environ.get(MC_LOG_LEVEL_VARIABLE)
    if glog is None and mooncake is None:
        environ[GLOG_LEVEL_VARIABLE] = _GLOG_LEVELS[DEFAULT_LOG_LEVEL]
        environ[MC_LOG_LEVEL_VARIABLE] = DEFAULT_LOG_LEVEL
    elif glog is None and mooncake in _GLOG_LEVELS:
        environ[GLOG_LEVEL_VARIABLE] = _GLOG_LEVELS[mooncake]
    elif mooncake is None and glog in _MC_LEVELS:
        environ[MC_LOG_LEVEL_VARIABLE] = _MC_LEVELS[glog]


def import_store() -> tuple[Any, Any]:
    """``(MooncakeDistributedStore, ReplicateConfig)`` from `mooncake.store`."""
    default_log_level()
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except (ImportError, OSError) as exc:
        raise MooncakeUnavailableError(unavailable_message(exc)) from exc
    return MooncakeDistributedStore, ReplicateConfig


def import_transfer_engine() -> Any:
    """`TransferEngine` from `mooncake.engine`."""
    default_log_level()
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:
        raise MooncakeUnavailableError(unavailable_message(exc)) from exc
    return TransferEngine


def master_binary() -> Path:
    """The ``mooncake_master`` executable bundled in the wheel (found without importing mooncake).

    Run directly rather than through the ``mooncake_master`` console script: that script is a
    Python process that only ``execv``s this file, and may not be on ``PATH`` of a venv not
    activated.
    """
    spec = importlib.util.find_spec("mooncake")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        binary = Path(location) / "mooncake_master"
        if binary.is_file():
            if not os.access(binary, os.X_OK):  # wheels do not always keep the executable bit
                binary.chmod(binary.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return binary
    raise MooncakeUnavailableError(f"no mooncake_master binary in the mooncake package ({locations or 'not installed'}): {PIP_INSTALL}")


def error_name(code: int) -> str:
    """``"-704 (OBJECT_NOT_FOUND)"``: a Mooncake return code as a reader can look it up."""
    name = _NAMES.get(code)
    return f"{code} ({name})" if name else str(code)
