"""A Ray cluster of several simulated nodes on this machine, for tests of the ``ray`` placement.

Each node declares a custom resource named after it (``node_a``, ``node_b``, ...) and the label
``omni-node=<letter>``, so a deploy pins a stage with ``ray: {resources: {node_b: 0.01}}``. The
nodes share 127.0.0.1, ``/dev/shm`` and the filesystem: only the resources tell them apart, as the
placement's `Replica.host` does (never a hostname or an address).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

import attrs

# Everything on loopback, nothing reported anywhere (see FACTS: Mooncake and Ray on loopback).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray starts its workers at niceness 15, below its own daemons and the engine; stage actors then
# lose the CPU to them, and their relative `nice` (upstream stages yield to downstream ones) is
# capped away. A node that runs Omni stages starts its workers at 0 (`ray start` reads the same).
WORKER_NICENESS = {"RAY_worker_niceness": "0"}


@attrs.frozen
class SimulatedCluster:
    address: str
    nodes: tuple[str, ...]
    cluster: object  # ray.cluster_utils.Cluster

    def deploy_pin(self, node: str) -> dict[str, object]:
        """The ``stages.NAME.ray`` entry that places a stage on `node`."""
        return {"resources": {f"node_{node}": 0.01}, "num_cpus": 0}


@contextlib.contextmanager
def simulated_cluster(nodes: tuple[str, ...] = ("a", "b"), cpus_per_node: int = 2) -> Iterator[SimulatedCluster]:
    """Start a head node and one worker node per further letter; stop them all afterwards.

    The test process is not connected to it: an engine joins it through ``ray: {address: ...}``
    (and leaves it at shutdown).
    """
    saved = {key: os.environ.get(key) for key in (*RAY_ENV, *WORKER_NICENESS, "RAY_TMPDIR")}
    tmp = tempfile.TemporaryDirectory(prefix="omni-ray-")
    os.environ.update(RAY_ENV, **WORKER_NICENESS, RAY_TMPDIR=tmp.name)
    cluster = None
    try:
        # Read once, at Ray's import: with it on, Ray swaps 127.0.0.1 in an address for the
        # machine's outward address (found through a public IP) and cannot reach the nodes.
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        if ray_constants.ENABLE_RAY_CLUSTER:
            raise RuntimeError(
                "Ray was imported before simulated_cluster() set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: "
                "set it in the environment of the test run"
            )
        head, *others = nodes
        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                num_cpus=cpus_per_node,
                node_ip_address="127.0.0.1",
                resources={f"node_{head}": 1},
                labels={"omni-node": head},
                include_dashboard=False,
            ),
        )
        for node in others:
            cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1", resources={f"node_{node}": 1}, labels={"omni-node": node})
        cluster.wait_for_nodes()
        yield SimulatedCluster(cluster.address, tuple(nodes), cluster)
    finally:
        if cluster is not None:
            cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tmp.cleanup()
