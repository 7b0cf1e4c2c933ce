"""`ResolvedPipeline`: the plain-data result of `resolve()`, what every stage worker receives."""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from omni_core.config.pipeline import TaskSpec

_converter = cattrs.Converter()


@attrs.frozen
class ResolvedEdge:
    """An edge with its connector chosen; `adapter` as in `EdgeSpec`."""

    source: str
    target: str
    adapter: str | None
    connector: str
    connector_ref: str
    connector_options: dict[str, Any] = attrs.field(factory=dict)

    @property
    def key(self) -> str:
        return f"{self.source}->{self.target}"


@attrs.frozen
class ResolvedStage:
    """A stage with its deployment merged in; `options` are the validated runtime options."""

    name: str
    kind: str
    runtime_ref: str
    model: str
    inputs: tuple[ResolvedEdge, ...] = ()
    output: str | None = None
    extra_outputs: tuple[str, ...] = ()
    output_adapter: str | None = None
    final: bool = False
    params: dict[str, Any] = attrs.field(factory=dict)
    placement: str = "process"
    # The registered class of `placement` ("module:Class", an `omni_core.runtime.placement.Replica`).
    placement_ref: str | None = None
    # What the placement takes from the stage's deploy entry (`Replica.stage_options`, e.g. the
    # ``ray`` placement's resources), as plain data.
    placement_options: dict[str, Any] = attrs.field(factory=dict)
    replicas: int = 1
    devices: tuple[str, ...] = ()
    load_balancer: str = "least_loaded"
    cpu_threads: int | None = None
    nice: int = 0
    allocator: str = "auto"
    watchdog_s: float | None = 300.0
    keep_freed_memory: bool = True
    kernel_cache: int | None = 128
    # The stage whose loaded model this one's runtime uses (`StageDeploy.share_model_with`).
    share_model_with: str | None = None
    # What the registered resolver of the `quantization` option returned for this stage's kind
    # (vLLM engine arguments for `ar`, a linear-swap spec for `diffusion`): resolved once, at
    # resolve time, so workers import no resolver.
    quantization: dict[str, Any] | None = None
    options: dict[str, Any] = attrs.field(factory=dict)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every modality this stage produces: `output`, then `extra_outputs`."""
        return ((self.output,) if self.output else ()) + tuple(self.extra_outputs)


@attrs.frozen
class ResolvedPipeline:
    """Everything needed to run a pipeline, as plain data (JSON via `to_dict`)."""

    model: str
    model_path: str
    family: str
    stages: tuple[ResolvedStage, ...]
    streaming: bool = True
    input_processor: str | None = None
    default_modalities: tuple[str, ...] = ("text",)
    tasks: tuple[TaskSpec, ...] = ()
    output_connector: str = "shm"
    output_connector_ref: str = "omni_core.connectors.shm:SharedMemoryConnector"
    output_connector_options: dict[str, Any] = attrs.field(factory=dict)
    # Per placement the stages use, what it takes from the whole deploy (`Replica.deploy_options`,
    # e.g. the ``ray`` placement's cluster address).
    placements: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    def stage(self, name: str) -> ResolvedStage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def task(self, name: str) -> TaskSpec:
        for task in self.tasks:
            if task.name == name:
                return task
        raise KeyError(name)

    def downstream(self, name: str) -> list[ResolvedEdge]:
        """Edges leaving stage `name`."""
        return [edge for stage in self.stages for edge in stage.inputs if edge.source == name]

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(modality for s in self.stages for modality in s.outputs))

    def to_dict(self) -> dict[str, Any]:
        return _converter.unstructure(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ResolvedPipeline":
        return _converter.structure(data, cls)
