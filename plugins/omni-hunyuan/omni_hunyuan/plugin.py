"""Omni hook implementations of the HunyuanImage-3.0 plugin (fast: no torch import, no I/O)."""

from __future__ import annotations

from collections.abc import Callable

from omni_core import hookimpl
from omni_core.families import PipelineFamily

FAMILY = PipelineFamily(
    name="hunyuan-image3",
    pipeline="omni_hunyuan.pipeline:build_pipeline",
    architectures=("HunyuanImage3ForCausalMM",),
    # `Hunyuan` in the base release's config.json, `hunyuan_image_3_moe` in later ones.
    model_types=("Hunyuan", "hunyuan_image_3_moe"),
    make_tiny="omni_hunyuan.tiny:make_tiny",
    tiny_format=4,  # 2: a smaller init of the velocity conv; 3: the release VAE (GroupNorm, plain Conv3d names);
    # 4: config.json's vit_type, cond_image_type / cond_token_attn_type and the vit section's output flags,
    # generation_config's use_system_prompt (the release's code reads them all)
    description="HunyuanImage-3.0 (HunyuanImage3ForCausalMM): one MoE that writes text and draws images",
)


@hookimpl
def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
    register(FAMILY)
