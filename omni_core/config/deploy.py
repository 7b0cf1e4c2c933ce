"""How a pipeline is deployed (`DeployConfig`): placement, replicas, connectors, runtime options.

Runtime options are typed per runtime kind: each stage runtime class declares an attrs `Options`
class and `resolve()` checks a stage's `options` against the class of that stage's kind.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

# ``ray`` (multi-node actors) is designed for but not built yet: rejected at resolve time for now.
Placement = Literal["inline", "process"]
LoadBalancer = Literal["least_loaded", "round_robin"]


@attrs.frozen
class StageDeploy:
    """Deployment of one stage: where it runs, how many replicas, and its runtime options.

    `cpu_threads`: intra-op CPU threads of each replica's process (``OMP_NUM_THREADS``, set before
    torch loads). ``None`` keeps the libraries' default of one thread per core,
    which oversubscribes the cores when several stage processes share them. `nice`: how much the
    replica's process yields the CPU to the others (Unix niceness added to the engine's, 0-19), e.g.
    an upstream stage yielding to the stages nearer the output on a machine with few cores.
    `keep_freed_memory`: the replica's process keeps freed heap memory for reuse instead of handing
    it back to the OS (glibc ``mallopt``), so tensors of a few MiB do not page-fault afresh at every
    allocation (measured 2-7x faster CPU elementwise ops); its resident memory stays at its peak.
    All three apply to ``process`` placement; ``inline`` stages share the engine process.
    """

    placement: Placement = "process"
    replicas: int = 1
    devices: tuple[str, ...] = ()
    load_balancer: LoadBalancer = "least_loaded"
    cpu_threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    nice: int = attrs.field(default=0, validator=[attrs.validators.ge(0), attrs.validators.le(19)])
    keep_freed_memory: bool = True
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class EdgeDeploy:
    """The connector of one edge (``"source->target"``) and its options."""

    connector: str = "shm"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class DeployConfig:
    """A deploy file: `streaming` chunked edges, per-stage and per-edge settings.

    `defaults` apply to every stage before its own entry (e.g. ``placement: inline`` for tests);
    `output_connector` carries user-facing outputs from stage workers to the engine.
    """

    streaming: bool = True
    defaults: StageDeploy = attrs.field(factory=StageDeploy)
    stages: dict[str, StageDeploy] = attrs.field(factory=dict)
    edges: dict[str, EdgeDeploy] = attrs.field(factory=dict)
    output_connector: EdgeDeploy = attrs.field(factory=EdgeDeploy)
