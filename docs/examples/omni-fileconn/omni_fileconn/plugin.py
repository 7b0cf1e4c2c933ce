from omni_core import hookimpl


@hookimpl
def register_connectors(register):
    register("file", "omni_fileconn.connector:FileConnector")
