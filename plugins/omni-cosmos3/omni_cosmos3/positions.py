"""Rotary positions of a Cosmos3 row: the prompt tokens', then the generator's (vision, sound,
action), as `Cosmos3OmniPipeline` numbers them (diffusers' `get_3d_mrope_ids_*` helpers)."""

from __future__ import annotations

import math
from typing import Any

import torch

from omni_cosmos3.samples import Row


def build_row(
    config: Any, input_ids: list[int], latent_shape: tuple[int, ...], sound: torch.Tensor | None, fps: float,
    patch: int, temporal_factor: int, device: torch.device, action_len: int = 0,
) -> Row:
    """One guidance branch's row: its prompt ids with text and generator positions on `device`
    (`config`: the transformer's; `patch`, `temporal_factor`: the latent patch and VAE time factor)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import get_3d_mrope_ids_text_tokens, get_3d_mrope_ids_vae_tokens

    modulated = bool(config.enable_fps_modulation)
    text_positions, next_offset = get_3d_mrope_ids_text_tokens(len(input_ids), 0, use_float_positions=modulated)
    offset = next_offset + config.unified_3d_mrope_temporal_modality_margin
    _, _, latent_t, latent_h, latent_w = latent_shape
    vision, _ = get_3d_mrope_ids_vae_tokens(
        grid_t=latent_t,
        grid_h=math.ceil(latent_h / patch),
        grid_w=math.ceil(latent_w / patch),
        temporal_offset=offset,
        reset_spatial_indices=config.unified_3d_mrope_reset_spatial_ids,
        fps=fps if modulated else None,
        base_fps=float(config.base_fps),
        temporal_compression_factor=temporal_factor,
    )
    parts = [vision]
    if sound is not None:
        sound_positions, _ = get_3d_mrope_ids_vae_tokens(
            grid_t=int(sound.shape[1]),
            grid_h=1,
            grid_w=1,
            temporal_offset=offset,
            reset_spatial_indices=config.unified_3d_mrope_reset_spatial_ids,
            fps=float(config.sound_latent_fps) if modulated else None,
            base_fps=float(config.base_fps),
            temporal_compression_factor=1,
        )
        parts.append(sound_positions)
    if action_len:
        action_positions, _ = get_3d_mrope_ids_vae_tokens(
            grid_t=action_len,
            grid_h=1,
            grid_w=1,
            temporal_offset=offset,
            reset_spatial_indices=config.unified_3d_mrope_reset_spatial_ids,
            fps=fps if modulated else None,
            base_fps=float(config.base_fps),
            temporal_compression_factor=1,
            base_temporal_compression_factor=temporal_factor,
            start_frame_offset=1,
        )
        parts.append(action_positions)
    dtype = torch.float32 if any(p.is_floating_point() for p in parts) or text_positions.is_floating_point() else torch.long
    gen_positions = torch.cat([p.to(dtype) for p in parts], dim=1)
    return Row(list(input_ids), text_positions.to(device), gen_positions.to(device))
