"""Config: what a family declares (`PipelineConfig`), how it is deployed (`DeployConfig`), and
`resolve()`, which merges both into the plain-data `ResolvedPipeline` every stage receives."""

from __future__ import annotations

from omni_core.config.deploy import DeployConfig, EdgeDeploy, StageDeploy
from omni_core.config.modelref import (
    cache_dir,
    checkpoint_dtype,
    read_hf_config,
    resolve_dtype,
    resolve_model_path,
)
from omni_core.config.pipeline import MODALITIES, EdgeSpec, PipelineConfig, StageSpec
from omni_core.config.resolve import resolve, resolve_pipeline, structure_config
from omni_core.config.resolved import ResolvedEdge, ResolvedPipeline, ResolvedStage

__all__ = [
    "MODALITIES",
    "DeployConfig",
    "EdgeDeploy",
    "EdgeSpec",
    "PipelineConfig",
    "ResolvedEdge",
    "ResolvedPipeline",
    "ResolvedStage",
    "StageDeploy",
    "StageSpec",
    "cache_dir",
    "checkpoint_dtype",
    "read_hf_config",
    "resolve",
    "resolve_dtype",
    "resolve_model_path",
    "resolve_pipeline",
    "structure_config",
]
