"""Omni hook implementations of the MiniMax-H3 plugin (fast: no torch import, no I/O)."""

from __future__ import annotations

from typing import Callable

from omni_core import hookimpl
from omni_core.families import PipelineFamily

FAMILY = PipelineFamily(
    name="minimax-h3",
    pipeline="omni_minimax_h3.pipeline:build_pipeline",
    # diffusers' modular layout, and a native partition (FL2VA/, Ref2VA/: model_index.json `MiniMaxH3Pipeline`)
    diffusers_classes=("MiniMaxH3ModularPipeline", "MiniMaxH3Pipeline"),
    make_tiny="omni_minimax_h3.tiny:make_tiny",
    tiny_format=2,  # 2: canvas_max_pixels 832x480 (the largest video a request may ask for)
    description="MiniMax-H3 (diffusers MiniMaxH3ModularPipeline): text or keyframes -> 24 fps video with stereo sound (encoder + dit)",
)


@hookimpl
def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
    register(FAMILY)
