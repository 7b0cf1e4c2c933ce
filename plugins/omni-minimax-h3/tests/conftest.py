"""Fixtures of the MiniMax-H3 tests: the tiny checkpoint resolved inline, diffusers' own pipeline on it,
and the plugin's parts, each loaded once per session.

diffusers and transformers are imported at the top: without them the tests fail, never skip.
"""

from __future__ import annotations

from typing import Any

import diffusers  # noqa: F401  (a missing library fails the suite here)
import pytest
import transformers  # noqa: F401

from omni_core.config import resolve
from omni_core.parts import PartContext
from omni_core.stages.diffusion import DiffusionStageRuntime
from omni_core.stages.generation import GenerationStageRuntime

MODEL = "omni-tiny/minimax-h3"
INLINE = ("encoder.placement=inline", "dit.placement=inline")


@pytest.fixture(scope="session")
def pipeline() -> Any:
    return resolve(MODEL, overrides=INLINE)


@pytest.fixture(scope="session")
def reference(pipeline: Any) -> Any:
    """diffusers' `MiniMaxH3ModularPipeline` on the tiny checkpoint, float32."""
    from omni_minimax_h3.reference import load_reference

    return load_reference(pipeline.model_path)


@pytest.fixture(scope="session")
def processor(pipeline: Any) -> Any:
    from omni_minimax_h3.pipeline import MiniMaxH3InputProcessor

    part = MiniMaxH3InputProcessor(PartContext(pipeline=pipeline, stage=None))
    part.load()
    return part


@pytest.fixture(scope="session")
def encoder(pipeline: Any) -> GenerationStageRuntime:
    runtime = GenerationStageRuntime(pipeline, pipeline.stage("encoder"))
    runtime.load()
    return runtime


@pytest.fixture(scope="session")
def dit(pipeline: Any) -> DiffusionStageRuntime:
    import attrs

    stage = pipeline.stage("dit")
    runtime = DiffusionStageRuntime(pipeline, attrs.evolve(stage, options={**stage.options, "admission_window_ms": 0.0}))
    runtime.load()
    return runtime
