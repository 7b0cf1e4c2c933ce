"""The core's built-ins, registered through the same hooks as any plugin (a default plugin)."""

from __future__ import annotations

from typing import Callable

from omni_core.hookspecs import hookimpl


@hookimpl
def register_stage_runtimes(register: Callable[[str, str], None]) -> None:
    register("ar", "omni_core.stages.ar:ARStageRuntime")
    register("generation", "omni_core.stages.generation:GenerationStageRuntime")
    register("diffusion", "omni_core.stages.diffusion:DiffusionStageRuntime")


@hookimpl
def register_connectors(register: Callable[[str, str], None]) -> None:
    register("inproc", "omni_core.connectors.inproc:InProcessConnector")
    register("shm", "omni_core.connectors.shm:SharedMemoryConnector")


@hookimpl
def register_placements(register: Callable[[str, str], None]) -> None:
    register("inline", "omni_core.runtime.replica:InlineReplica")
    register("process", "omni_core.runtime.replica:ProcessReplica")
    register("ray", "omni_core.runtime.ray_placement:RayReplica")  # Ray imported only when one starts


@hookimpl
def register_quantization_resolvers(register: Callable[[str, str], None]) -> None:
    register("fp8", "omni_core.quantization:resolve_fp8")
    register("int8", "omni_core.quantization:resolve_int8")
