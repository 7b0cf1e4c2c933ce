"""Omni hook implementations of the Cosmos3 plugin (fast: no torch import, no I/O)."""

from __future__ import annotations

from typing import Callable

from omni_core import hookimpl
from omni_core.families import PipelineFamily

FAMILY = PipelineFamily(
    name="cosmos3",
    pipeline="omni_cosmos3.pipeline:build_pipeline",
    diffusers_classes=("Cosmos3OmniPipeline",),
    make_tiny="omni_cosmos3.tiny:make_tiny",
    description="Cosmos3 (diffusers Cosmos3OmniPipeline): text -> image, video, video with audio (one diffusion stage)",
)


@hookimpl
def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
    register(FAMILY)
