"""The one module that touches the `mooncake` package: lazy imports, the master binary, error codes.

Mooncake's extension modules (``store.so``, ``engine.so``) link Debian's libibverbs and libnl even
for TCP, so on a bare machine ``import mooncake.store`` fails with an ``ImportError`` naming a
shared library. Every import goes through here and turns that into `MooncakeUnavailableError`,
whose message carries the install command; nothing imports Mooncake at plugin load.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path
from typing import Any

from omni_core.errors import ConnectorError, MissingDependencyError

PIP_INSTALL = "pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1'"
APT_INSTALL = "apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200"
_SYSTEM_LIBRARIES = ("libibverbs", "libnl-3", "libnl-route-3", "librdmacm", "libnuma")

# Mooncake's ErrorCode values met by these connectors (mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200
"""The store has no room for the object (every mounted segment is full)."""
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
"""`remove` without force while a reader's lease holds (granted by every get)."""
_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
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


def import_store() -> tuple[Any, Any]:
    """``(MooncakeDistributedStore, ReplicateConfig)`` from `mooncake.store`."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except (ImportError, OSError) as exc:
        raise MooncakeUnavailableError(unavailable_message(exc)) from exc
    return MooncakeDistributedStore, ReplicateConfig


def import_transfer_engine() -> Any:
    """`TransferEngine` from `mooncake.engine`."""
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
