"""How a pipeline is deployed (`DeployConfig`): placement, replicas, connectors, runtime options.

Runtime options are typed per runtime kind: each stage runtime class declares an attrs `Options`
class and `resolve()` checks a stage's `options` against the class of that stage's kind.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

# ``ray`` (multi-node actors) is designed for but not built yet: rejected at resolve time for now.
LoadBalancer = Literal["least_loaded", "round_robin"]

ENGINE_HOST = "engine"
"""What a placement's `Replica.host` says of a stage on the engine's own host."""


@attrs.frozen
class StageDeploy:
    """Deployment of one stage: where it runs, how many replicas, and its runtime options.

    Each field's ``metadata["doc"]`` documents it (`omni stages`, ``docs/stage-options.md``).
    """

    placement: str = attrs.field(
        default="process",
        metadata={
            "doc": "Where each replica runs, a registered placement (``omni plugins``): ``process``, a spawned worker "
            "process of its own; ``inline``, a thread of the engine's process (tests, light stages)."
        },
    )
    replicas: int = attrs.field(
        default=1, metadata={"doc": "How many copies of the stage run; each request goes to one (`load_balancer`)."}
    )
    devices: tuple[str, ...] = attrs.field(
        default=(),
        metadata={
            "doc": "The stage's devices (``cpu``, ``cuda:0``, ...): its runtime runs on the first, and a ``process`` "
            "replica sees only these GPUs (``CUDA_VISIBLE_DEVICES``). Empty: CUDA when there is one, else CPU."
        },
    )
    load_balancer: LoadBalancer = attrs.field(
        default="least_loaded",
        metadata={
            "doc": "How a new request picks a replica: ``least_loaded`` (fewest requests in flight) or "
            "``round_robin``; a replica still loading is picked only when none is ready."
        },
    )
    cpu_threads: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.ge(1)),
        metadata={
            "doc": "Intra-op CPU threads of each replica's process (``OMP_NUM_THREADS``, set before torch loads). "
            "``None`` keeps the libraries' default of one thread per core, which oversubscribes the cores when "
            "several stage processes share them. ``process`` placement only."
        },
    )
    nice: int = attrs.field(
        default=0,
        validator=[attrs.validators.ge(0), attrs.validators.le(19)],
        metadata={
            "doc": "How much the replica's process yields the CPU to the others (Unix niceness added to the "
            "engine's, 0-19), e.g. an upstream stage yielding to the stages nearer the output on a machine with "
            "few cores. ``process`` placement only."
        },
    )
    keep_freed_memory: bool = attrs.field(
        default=True,
        metadata={
            "doc": "The replica's process keeps freed heap memory for reuse instead of handing it back to the OS "
            "(glibc ``mallopt``), so tensors of a few MiB do not page-fault afresh at every allocation (measured "
            "2-7x faster CPU elementwise ops); its resident memory stays at its peak. ``process`` placement only."
        },
    )
    options: dict[str, Any] = attrs.field(
        factory=dict,
        metadata={
            "doc": "The runtime options of the stage's kind (listed per kind); ``--set STAGE.OPTION=VALUE`` sets one."
        },
    )


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
