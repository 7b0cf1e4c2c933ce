"""Settings for the whole test run, before any test module imports a library that reads them."""

import os

from omni_core.testing.ray_cluster import RAY_ENV

# Ray reads these once, when it is imported (by a test module, or by the ray placement): keep every
# Ray of the test run on loopback, reporting nothing (see omni_core.testing.ray_cluster).
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)

# Snapshot the environment that servers and `omni` commands the tests start get (`launch_env`),
# before a test runs a library in this process that writes its own settings into os.environ.
from omni_core.testing import live_server  # noqa: E402,F401
