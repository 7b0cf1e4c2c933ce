"""How a pipeline is deployed (`DeployConfig`): placement, replicas, connectors, runtime options.

Runtime options are typed per runtime kind: each stage runtime class declares an attrs `Options`
class and `resolve()` checks a stage's `options` against the class of that stage's kind.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

Allocator = Literal["auto", "system", "tcmalloc", "jemalloc"]
LoadBalancer = Literal["least_loaded", "round_robin"]

ENGINE_HOST = "engine"
"""What a placement's `Replica.host` says of a stage on the engine's own host."""


@attrs.frozen
class RayStageDeploy:
    """Where a ``ray`` replica's actor may run and what it reserves (``stages.NAME.ray``)."""

    resources: dict[str, float] = attrs.field(
        factory=dict,
        metadata={
            "doc": "Ray resources each replica's actor reserves, e.g. ``{node_b: 0.01}`` for a custom resource "
            "that one node (or group of nodes) declares (``ray start --resources``). Stages with equal custom "
            "resources and labels are taken to share a host."
        },
    )
    num_cpus: float = attrs.field(
        default=1.0, validator=attrs.validators.ge(0), metadata={"doc": "CPUs each replica's actor reserves."}
    )
    num_gpus: float = attrs.field(
        default=0.0,
        validator=attrs.validators.ge(0),
        metadata={"doc": "GPUs each replica's actor reserves; Ray sets its ``CUDA_VISIBLE_DEVICES``."},
    )
    label_selector: dict[str, str] = attrs.field(
        factory=dict,
        metadata={"doc": "Node labels the actor's node must have (``ray start --labels``), e.g. ``{omni-node: b}``."},
    )

    @property
    def custom_resources(self) -> list[str]:
        """The custom resources asked for (not CPUs, GPUs or memory), sorted: what names a node."""
        return sorted(name for name in self.resources if name not in _RAY_BUILTIN_RESOURCES)

    @property
    def pinned(self) -> bool:
        """Whether these options tie the actor to a chosen node or group (a custom resource or a label)."""
        return bool(self.label_selector) or bool(self.custom_resources)


_RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


@attrs.frozen
class RayDeploy:
    """The Ray cluster of the ``ray`` placement (the deploy file's top-level ``ray``)."""

    address: str | None = attrs.field(
        default=None,
        metadata={
            "doc": "``auto`` (the cluster this machine joined with ``ray start``) or ``HOST:PORT``. Unset: "
            "``RAY_ADDRESS`` when set, else a local Ray that Omni starts with the engine and stops with it."
        },
    )


@attrs.frozen
class StageDeploy:
    """Deployment of one stage: where it runs, how many replicas, and its runtime options.

    Each field's ``metadata["doc"]`` documents it (`omni stages`, ``docs/stage-options.md``).
    """

    placement: str = attrs.field(
        default="process",
        metadata={
            "doc": "Where each replica runs, a registered placement (``omni plugins``): ``process``, a spawned worker "
            "process of its own; ``inline``, a thread of the engine's process (tests, light stages); ``ray``, a Ray "
            "actor on any node of a Ray cluster (``pip install 'omni-core[ray]'``; see `ray`)."
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
    allocator: Allocator = attrs.field(
        default="auto",
        metadata={
            "doc": "The memory allocator of the replica's process, preloaded when it is spawned: ``tcmalloc`` "
            "(what vLLM preloads on CPU; Debian package ``libtcmalloc-minimal4``), ``jemalloc`` (``libjemalloc2``), "
            "``system`` (the C library's malloc) or ``auto``: tcmalloc, else jemalloc, where installed, else the "
            "system's. glibc's malloc fragments under varied tensor sizes (measured on the qwen3-omni soak: "
            "code2wav's resident memory +12.4% in 30 min, +5.3% with tcmalloc, which also served 1.2x the requests). "
            "An ``LD_PRELOAD`` already naming one wins. ``process`` placement only."
        },
    )
    watchdog_s: float | None = attrs.field(
        default=300.0,
        validator=attrs.validators.optional(attrs.validators.gt(0)),
        metadata={
            "doc": "A ready replica that answers no ping for this many seconds (a deadlock, a stopped process) is "
            "killed: its requests fail at once and it is restarted as a crashed one is (the crash-loop limit counts "
            "it). A worker answers between steps, so keep this above the stage's longest step. ``None``: never. "
            "``process`` and ``ray`` placements (an inline thread cannot be killed: it is only reported)."
        },
    )
    keep_freed_memory: bool = attrs.field(
        default=True,
        metadata={
            "doc": "The replica's process keeps freed heap memory for reuse instead of handing it back to the OS "
            "(glibc ``mallopt``), so tensors of a few MiB do not page-fault afresh at every allocation (measured "
            "2-7x faster CPU elementwise ops); its resident memory stays at its peak. Acts on the ``system`` "
            "allocator only. ``process`` placement only."
        },
    )
    kernel_cache: int | None = attrs.field(
        default=128,
        validator=attrs.validators.optional(attrs.validators.ge(0)),
        metadata={
            "doc": "How many compiled CPU kernels (oneDNN primitives: one per matmul or convolution shape) the "
            "replica's process keeps (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, set before torch loads). Each batch "
            "size makes its own, at ~0.4 MiB each, so oneDNN's default of 1024 lets memory grow for hours "
            "under varied load; 128 bounds it at no measured cost in throughput. ``None`` keeps the library's "
            "default; an ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` already in the environment wins. ``process`` "
            "placement only."
        },
    )
    share_model_with: str | None = attrs.field(
        default=None,
        metadata={
            "doc": "Another stage whose loaded model this stage's runtime uses instead of loading its own copy (one "
            "copy of weights two stages share, e.g. HunyuanImage-3.0's ``dit`` running its denoising forwards on the "
            "modules its ``ar`` stage loaded on vLLM). Replica i of this stage waits for replica i of that one to "
            "load, then takes what its runtime offers (`StageRuntime.shared_model`), so both run in one process: "
            "both ``process`` (that stage's worker process runs this one's worker too, in a thread; the process "
            "settings (``cpu_threads``, ``allocator``, ...) are set on that stage, and the two restart together) or both "
            "``inline``. When that stage reloads its runtime (after a failed step), this one loads again on the new "
            "model between its requests. As many replicas and the same devices; the model part must take it."
        },
    )
    ray: RayStageDeploy = attrs.field(
        factory=RayStageDeploy,
        metadata={"doc": "``ray`` placement only: the node (resources, labels) and reservations of each replica's actor."},
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
    ray: RayDeploy = attrs.field(factory=RayDeploy)
