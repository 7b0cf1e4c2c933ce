"""The toy families' registration (hook implementations only: imports nothing heavy)."""

from __future__ import annotations

from typing import Callable

from omni_core import hookimpl
from omni_core.families import PipelineFamily


@hookimpl
def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
    register(
        PipelineFamily(
            name="toy",
            pipeline="omni_toy.pipeline:build_toy_pipeline",
            architectures=("OmniToyPipeline",),
            model_types=("omni-toy",),
            make_tiny="omni_toy.tiny:make_tiny",
            description="Test family: tiny Qwen3 LM (vLLM) -> toy causal-conv vocoder (text + audio)",
        )
    )
    register(
        PipelineFamily(
            name="toy-passthrough",
            pipeline="omni_toy.pipeline:build_passthrough_pipeline",
            architectures=("OmniToyPassThrough",),
            model_types=("omni-toy-passthrough",),
            make_tiny="omni_toy.tiny:make_tiny_passthrough",
            description="Test family: one generation stage that copies its input frames to audio (no vLLM)",
        )
    )
