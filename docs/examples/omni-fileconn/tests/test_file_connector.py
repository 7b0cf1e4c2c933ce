import tempfile

from omni_core.plugins import load_plugins
from omni_core.testing.connector_contract import ConnectorContract

import omni_fileconn.plugin


class TestFileConnector(ConnectorContract):
    connector_ref = "omni_fileconn.connector:FileConnector"
    options = {"root": tempfile.mkdtemp()}
    bounded_options = {"max_bytes": 4 << 20}


def test_the_plugin_registers_the_connector():
    host = load_plugins(allowlist=[], entry_points=[], extra_plugins=[omni_fileconn.plugin])
    assert host.connectors["file"] == "omni_fileconn.connector:FileConnector"
