"""Omni hook implementations of the Mooncake connectors plugin (fast: no Mooncake import, no I/O)."""

from __future__ import annotations

from collections.abc import Callable

from omni_core import hookimpl


@hookimpl
def register_connectors(register: Callable[[str, str], None]) -> None:
    register("mooncake-store", "omni_mooncake.store:MooncakeStoreConnector")
    register("mooncake-te", "omni_mooncake.transfer_engine:MooncakeTransferEngineConnector")
