"""`omni_mooncake.testing.start_master` and the message for a missing system library."""

from __future__ import annotations

import socket

import pytest

from omni_core.errors import ConnectorError, MissingDependencyError
from omni_mooncake.master import MooncakeMaster
from omni_mooncake.mooncake_bridge import (
    APT_INSTALL,
    PIP_INSTALL,
    MooncakeUnavailableError,
    default_log_level,
    unavailable_message,
)
from omni_mooncake.testing import start_master


def test_start_master_yields_a_loopback_address_and_stops_it() -> None:
    with start_master() as address:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1"
        socket.create_connection((host, int(port)), timeout=1).close()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()


def test_master_stop_is_idempotent() -> None:
    master = MooncakeMaster()
    assert master.alive()
    master.stop()
    master.stop()
    assert not master.alive()


def test_missing_system_library_message_names_the_apt_command() -> None:
    # What `import mooncake.store` raises on a machine without Debian's libibverbs1.
    exc = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    message = unavailable_message(exc)
    assert APT_INSTALL in message and "libibverbs.so.1" in message
    assert APT_INSTALL == "apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200"
    assert APT_INSTALL in unavailable_message(OSError("libnl-route-3.so.200: cannot open shared object file"))


def test_missing_package_message_names_pip() -> None:
    exc = ModuleNotFoundError("No module named 'mooncake'", name="mooncake")
    assert PIP_INSTALL in unavailable_message(exc)


def test_the_error_is_both_a_connector_error_and_a_missing_dependency() -> None:
    # A ConnectorError passes through create_connector as it is, naming the fix.
    assert issubclass(MooncakeUnavailableError, ConnectorError)
    assert issubclass(MooncakeUnavailableError, MissingDependencyError)


def test_plugin_import_does_not_import_mooncake() -> None:
    import subprocess
    import sys

    code = "import sys, omni_mooncake.plugin, omni_mooncake.store, omni_mooncake.transfer_engine; print(sorted(m for m in sys.modules if m.startswith('mooncake')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_failing_mooncake_import_becomes_the_install_error() -> None:
    # In a fresh interpreter, a None entry in sys.modules makes `import mooncake.engine` fail as
    # a missing module does; building a connector must then say how to install (the message for
    # a missing system library is checked above, on the exception the loader raises).
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['mooncake.engine'] = None\n"
        "from omni_core.connectors import create_connector\n"
        "try:\n"
        "    create_connector('omni_mooncake.transfer_engine:MooncakeTransferEngineConnector', {}, 'edges.a->b')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("MooncakeUnavailableError ") and PIP_INSTALL in out, out


@pytest.mark.parametrize(
    ("chosen", "expected"),
    [
        ({}, {"GLOG_minloglevel": "1", "MC_LOG_LEVEL": "WARNING"}),  # warnings and errors only
        ({"MC_LOG_LEVEL": "INFO"}, {"GLOG_minloglevel": "0", "MC_LOG_LEVEL": "INFO"}),
        ({"GLOG_minloglevel": "2"}, {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}),
        ({"GLOG_minloglevel": "0", "MC_LOG_LEVEL": "ERROR"}, {"GLOG_minloglevel": "0", "MC_LOG_LEVEL": "ERROR"}),
    ],
)
def test_mooncake_log_level_defaults_to_warning_unless_the_user_chose(chosen: dict[str, str], expected: dict[str, str]) -> None:
    environ = {"PATH": "/bin", **chosen}
    default_log_level(environ)
    assert environ == {"PATH": "/bin", **expected}
