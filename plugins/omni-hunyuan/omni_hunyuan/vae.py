"""The image VAE: the release's ``AutoencoderKLConv3D``, run as diffusers' ``AutoencoderKLHunyuanVideo15``.

Both are Tencent's causal Conv3D VAE (32 latent channels, 16x spatial and 4x temporal compression,
channel-matching down/upsamplers, RMS norms with ``gamma``) with the same config keys; diffusers renamed
the modules when it ported it (scripts/convert_hunyuan_video1_5_to_diffusers.py). We keep the weights in the
release's names on disk (``vae.encoder.down.{i}.block.{j}...``) and rename them on load, so a release
checkpoint and the tiny one load the same way. Their equality with the release's own VAE is inferred from
that lineage, not yet measured: the release comparison of issue 25 is what checks it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

VAE_PREFIX = "vae."

# (release pattern, diffusers replacement), applied in order to the key after "vae.".
_RELEASE_TO_DIFFUSERS: tuple[tuple[str, str], ...] = (
    (r"^(encoder|decoder)\.mid\.block_(\d+)\.", lambda m: f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}."),  # type: ignore[dict-item]
    (r"^(encoder|decoder)\.mid\.attn_1\.(q|k|v)\.", r"\1.mid_block.attentions.0.to_\2."),
    (r"^(encoder|decoder)\.mid\.attn_1\.", r"\1.mid_block.attentions.0."),
    (r"^encoder\.down\.(\d+)\.block\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2."),
    (r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0."),
    (r"^decoder\.up\.(\d+)\.block\.(\d+)\.", r"decoder.up_blocks.\1.resnets.\2."),
    (r"^decoder\.up\.(\d+)\.upsample\.", r"decoder.up_blocks.\1.upsamplers.0."),
    (r"\.nin_shortcut\.", ".conv_shortcut."),
)
_DIFFUSERS_TO_RELEASE: tuple[tuple[str, str], ...] = (
    (r"^(encoder|decoder)\.mid_block\.resnets\.(\d+)\.", lambda m: f"{m[1]}.mid.block_{int(m[2]) + 1}."),  # type: ignore[dict-item]
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_(q|k|v)\.", r"\1.mid.attn_1.\2."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.", r"\1.mid.attn_1."),
    (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.down.\1.block.\2."),
    (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
    (r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.", r"decoder.up.\1.block.\2."),
    (r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", r"decoder.up.\1.upsample."),
    (r"\.conv_shortcut\.", ".nin_shortcut."),
)


def _rename(key: str, table: tuple[tuple[str, Any], ...]) -> str:
    """The first matching module-path rule (anchored at the start), then the shortcut rule (anywhere)."""
    *paths, (shortcut, shortcut_new) = table
    for pattern, replacement in paths:
        key, count = re.subn(pattern, replacement, key)
        if count:
            break
    return re.sub(shortcut, shortcut_new, key)


def release_to_diffusers_key(key: str) -> str:
    """``encoder.down.0.block.1.conv1.conv.weight`` -> ``encoder.down_blocks.0.resnets.1.conv1.conv.weight``."""
    return _rename(key, _RELEASE_TO_DIFFUSERS)


def diffusers_to_release_key(key: str) -> str:
    """The inverse of `release_to_diffusers_key` (make_tiny writes the release names)."""
    return _rename(key, _DIFFUSERS_TO_RELEASE)


def build_vae(vae_config: Mapping[str, Any]) -> Any:
    """An ``AutoencoderKLHunyuanVideo15`` with random weights, sized from the release ``vae`` section."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(
        in_channels=int(vae_config.get("in_channels", 3)),
        out_channels=int(vae_config.get("out_channels", 3)),
        latent_channels=int(vae_config["latent_channels"]),
        block_out_channels=tuple(vae_config["block_out_channels"]),
        layers_per_block=int(vae_config["layers_per_block"]),
        spatial_compression_ratio=int(vae_config.get("ffactor_spatial", 16)),
        temporal_compression_ratio=int(vae_config.get("ffactor_temporal", 4)),
        downsample_match_channel=bool(vae_config.get("downsample_match_channel", True)),
        upsample_match_channel=bool(vae_config.get("upsample_match_channel", True)),
        scaling_factor=float(vae_config.get("scaling_factor") or 1.0),
    )


def load_vae(model_path: str | Path, vae_config: Mapping[str, Any], device: str = "cpu") -> Any:
    """The VAE with the checkpoint's ``vae.*`` weights in fp32 (`decode_latents` autocasts on CUDA)."""
    from omni_hunyuan.weights import read_tensors

    vae = build_vae(vae_config)
    state = {release_to_diffusers_key(k[len(VAE_PREFIX) :]): v for k, v in read_tensors(model_path, (VAE_PREFIX,)).items()}
    result = vae.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"vae.* weights do not match: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return vae.to(device=device, dtype=torch.float32).eval()


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor, vae_config: Mapping[str, Any]) -> torch.Tensor:
    """Scaled latents ``[B, C, h, w]`` -> uint8 images ``[B, H, W, 3]``, as the release decodes them.

    Undo the scaling (``/ scaling_factor``, then ``+ shift_factor`` when set), decode one latent frame,
    map [-1, 1] to [0, 255] and round. On CUDA the decode runs under fp16 autocast, as the release
    pipeline's does (nemo-automodel's port keeps it: the reference in `bench/hunyuan_image3.py`);
    elsewhere it runs in the VAE's dtype (fp32: what the CPU tests compare bit for bit).
    """
    latents = latents.float() / float(vae_config.get("scaling_factor") or 1.0)
    if vae_config.get("shift_factor"):
        latents = latents + float(vae_config["shift_factor"])
    dtype = next(vae.parameters()).dtype
    on_cuda = latents.device.type == "cuda"
    # One latent at a time: diffusers 0.42's HunyuanVideo15 mid-block attention builds a mask that
    # does not broadcast over a batch of more than one.
    with torch.autocast(device_type=latents.device.type, dtype=torch.float16, enabled=on_cuda):
        frames = torch.cat([vae.decode(z[None].unsqueeze(2).to(dtype)).sample for z in latents])
    image = frames[:, :, -1].float()
    image = (image / 2 + 0.5).clamp(0, 1)
    return (image.permute(0, 2, 3, 1) * 255).round().to(torch.uint8)
