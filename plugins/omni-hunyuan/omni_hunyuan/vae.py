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
import torch.nn.functional as F
from torch import nn

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
    return vae.to(device=device).eval()  # (built in fp32: the weights were copied into fp32 parameters)


class ImageDecoder(nn.Module):
    """The VAE's decoder for one latent frame (an image), in 2-D: the same numbers, a third of the work.

    The release decodes an image as a one-frame video: every causal 3x3x3 convolution pads the time axis
    with two copies of that frame (replicate padding), so its three time taps all see the same frame and
    it equals a 3x3 convolution with the taps' weights summed (up to float rounding). An upsampler that
    also doubles time keeps, of the first frame, half of its convolution's output channels: only those
    are computed. The mid-block attention of one frame has no causal mask to apply (so a batch decodes
    in one call, unlike with diffusers' 0.42 mask). Built from the diffusers decoder's weights
    (`from_vae`); everything else, norms in fp32 included, runs as diffusers runs it.
    """

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.conv_in = _conv(decoder.conv_in)
        self.repeat = decoder.repeat
        mid = decoder.mid_block
        self.mid = nn.ModuleList([_Resnet(mid.resnets[0])])
        for attn, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
            if attn is not None:
                self.mid.append(_Attention(attn))
            self.mid.append(_Resnet(resnet))
        self.up = nn.ModuleList()
        for block in decoder.up_blocks:
            self.up.extend(_Resnet(resnet) for resnet in block.resnets)
            if block.upsamplers is not None:
                self.up.extend(_Upsample(upsampler) for upsampler in block.upsamplers)
        self.norm_out = _Norm(decoder.norm_out)
        self.conv_out = _conv(decoder.conv_out)

    @staticmethod
    def from_vae(vae: Any) -> ImageDecoder:
        """The decoder of a diffusers ``AutoencoderKLHunyuanVideo15`` (its weights copied, its dtype and device)."""
        parameter = next(vae.parameters())
        return ImageDecoder(vae.decoder).to(device=parameter.device, dtype=parameter.dtype).eval()

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """Unscaled latents ``[B, C, h, w]`` -> pixels ``[B, 3, H, W]`` in about [-1, 1]."""
        hidden = self.conv_in(latents) + latents.repeat_interleave(self.repeat, dim=1)
        for module in (*self.mid, *self.up):
            hidden = module(hidden)
        return self.conv_out(F.silu(self.norm_out(hidden)))


def _conv(causal: nn.Module, keep: torch.Tensor | None = None) -> nn.Conv2d:
    """A causal Conv3d over one replicate-padded frame as a Conv2d (its time taps summed); `keep`
    selects output channels."""
    conv3d = causal.conv
    if len(set(conv3d.kernel_size)) != 1 or set(conv3d.stride) != {1}:  # (the padding below assumes both)
        raise ValueError(f"a cubic, stride-1 causal convolution was expected, got {conv3d}")
    weight, bias = conv3d.weight.detach().sum(dim=2), conv3d.bias.detach()
    if keep is not None:
        weight, bias = weight[keep], bias[keep]
    size = weight.shape[-1]
    conv = nn.Conv2d(weight.shape[1], weight.shape[0], size, padding=size // 2, padding_mode="replicate")
    conv.weight.data.copy_(weight)
    conv.bias.data.copy_(bias)
    return conv


def _pointwise(conv3d: nn.Conv3d) -> nn.Conv2d:
    conv = nn.Conv2d(conv3d.in_channels, conv3d.out_channels, 1)
    conv.weight.data.copy_(conv3d.weight.detach()[:, :, 0])
    conv.bias.data.copy_(conv3d.bias.detach())
    return conv


class _Norm(nn.Module):
    """diffusers' ``HunyuanVideo15RMS_norm`` over channels (normalized in fp32, then scaled by gamma)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.scale = norm.scale
        self.gamma = nn.Parameter(norm.gamma.detach().reshape(-1, 1, 1).clone())
        self.bias = nn.Parameter(norm.bias.detach().reshape(-1, 1, 1).clone()) if isinstance(norm.bias, nn.Parameter) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduced = x.dtype in (torch.float16, torch.bfloat16)
        out = F.normalize(x.float() if reduced else x, dim=1).to(x.dtype) * self.scale * self.gamma
        return out if self.bias is None else out + self.bias


class _Resnet(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm1, self.conv1 = _Norm(block.norm1), _conv(block.conv1)
        self.norm2, self.conv2 = _Norm(block.norm2), _conv(block.conv2)
        self.shortcut = None if block.conv_shortcut is None else _pointwise(block.conv_shortcut)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return hidden + (x if self.shortcut is None else self.shortcut(x))


class _Attention(nn.Module):
    """Single-head attention over a frame's pixels (one frame: nothing is masked)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm = _Norm(block.norm)
        self.q, self.k, self.v, self.out = (_pointwise(c) for c in (block.to_q, block.to_k, block.to_v, block.proj_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        normed = self.norm(x)
        q, k, v = (proj(normed).flatten(2).transpose(1, 2)[:, None] for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v)[:, 0]
        return self.out(attended.transpose(1, 2).reshape(batch, channels, height, width)) + x


class _Upsample(nn.Module):
    """diffusers' ``HunyuanVideo15Upsample`` on a first (only) frame: 2x in space; an upsampler that
    doubles time keeps half of the first frame's channels (those alone are computed here)."""

    def __init__(self, upsample: nn.Module) -> None:
        super().__init__()
        conv3d = upsample.conv.conv
        self.temporal = bool(upsample.add_temporal_upsample)
        self.repeats = upsample.repeats // 2 if self.temporal else upsample.repeats
        keep = None
        if self.temporal:  # of each of the 4 space groups' 2*out channels, the first out
            out = conv3d.out_channels // 8
            keep = torch.arange(conv3d.out_channels).view(4, 2 * out)[:, :out].reshape(-1)
        self.conv = _conv(upsample.conv, keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.temporal:  # the shortcut: depth to space first, then the channel repeat
            shortcut = _depth_to_space(x).repeat_interleave(self.repeats, dim=1)
        else:
            shortcut = _depth_to_space(x.repeat_interleave(self.repeats, dim=1))
        return _depth_to_space(self.conv(x)) + shortcut


def _depth_to_space(x: torch.Tensor) -> torch.Tensor:
    """``[B, 4c, h, w]`` -> ``[B, c, 2h, 2w]``, channel group (i, j) to pixel (2h+i, 2w+j): diffusers'
    ``_dcae_upsample_rearrange`` for one frame (not `torch.pixel_shuffle`'s channel order)."""
    batch, packed, height, width = x.shape
    channels = packed // 4
    x = x.reshape(batch, 2, 2, channels, height, width).permute(0, 3, 4, 1, 5, 2)
    return x.reshape(batch, channels, height * 2, width * 2)


def load_image_decoder(model_path: str | Path, vae_config: Mapping[str, Any], device: str = "cpu") -> ImageDecoder:
    """The checkpoint's VAE decoder as an `ImageDecoder` (fp32; the encoder is not kept)."""
    return ImageDecoder.from_vae(load_vae(model_path, vae_config, device=device))


@torch.no_grad()
def decode_latents(decoder: ImageDecoder, latents: torch.Tensor, vae_config: Mapping[str, Any]) -> torch.Tensor:
    """Scaled latents ``[B, C, h, w]`` -> uint8 images ``[B, H, W, 3]``, as the release decodes them.

    Undo the scaling (``/ scaling_factor``, then ``+ shift_factor`` when set), decode one image a call
    (an image does not depend on what was decoded beside it; batching gained 3% on an H100,
    bench/results/hunyuan-profile-h100-8layers-decoder.md), map [-1, 1] to [0, 255] and round. On CUDA
    the decode runs under fp16 autocast, as the release pipeline's does (nemo-automodel's port keeps it:
    the reference in `bench/hunyuan_image3.py`); elsewhere it runs in the decoder's dtype (fp32: what the
    CPU tests compare with diffusers' VAE).
    """
    latents = latents.float() / float(vae_config.get("scaling_factor") or 1.0)
    if vae_config.get("shift_factor"):
        latents = latents + float(vae_config["shift_factor"])
    dtype = next(decoder.parameters()).dtype
    with torch.autocast(device_type=latents.device.type, dtype=torch.float16, enabled=latents.device.type == "cuda"):
        pixels = torch.cat([decoder(latent[None].to(dtype)) for latent in latents])
    image = (pixels.float() / 2 + 0.5).clamp(0, 1)
    return (image.permute(0, 2, 3, 1) * 255).round().to(torch.uint8)
