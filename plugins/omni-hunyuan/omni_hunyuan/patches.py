"""HunyuanImage-3.0's image-token ends and its timestep embeddings, named as the release names its weights.

The noisy latents enter the decoder through `UNetDown` (``patch_embed``: a convolution and a
timestep-modulated residual block, one token per latent pixel) and leave it through `UNetUp`
(``final_layer``) as the velocity; `TimestepEmbedder` makes the ``<timestep>`` token and the two
UNets' conditioning. The decoder layers are `omni_hunyuan.layers`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FREQUENCY_EMBEDDING_SIZE = 256
"""Width of the sinusoidal timestep features (the release's TimestepEmbedder)."""

GROUP_NORM_GROUPS = 32


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[B, dim]`` of (fractional) timesteps, cosine half first, fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        features = torch.cat([features, torch.zeros_like(features[:, :1])], dim=-1)
    return features


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features through Linear-GELU-Linear (keys ``mlp.0``, ``mlp.2``)."""

    def __init__(self, hidden: int, frequency_size: int = FREQUENCY_EMBEDDING_SIZE) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden), nn.GELU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_features(t, self.frequency_size).to(self.mlp[0].weight.dtype))


class GroupNorm32(nn.GroupNorm):
    """32-group GroupNorm computed in fp32 (the release runs it under autocast, which upcasts it)."""

    def __init__(self, channels: int) -> None:
        super().__init__(GROUP_NORM_GROUPS, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class ResBlock(nn.Module):
    """Conv residual block whose second norm is modulated by the timestep: ``norm(h) * (1 + scale) + shift``."""

    def __init__(self, channels: int, emb_channels: int, out_channels: int) -> None:
        super().__init__()
        self.in_layers = nn.Sequential(GroupNorm32(channels), nn.SiLU(), nn.Conv2d(channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, 2 * out_channels))
        self.out_layers = nn.Sequential(
            GroupNorm32(out_channels), nn.SiLU(), nn.Dropout(p=0.0), nn.Conv2d(out_channels, out_channels, 3, padding=1)
        )
        self.skip_connection = nn.Identity() if channels == out_channels else nn.Conv2d(channels, out_channels, 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb)[:, :, None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1.0 + scale) + shift
        h = self.out_layers[1:](h)
        return self.skip_connection(x) + h


class UNetDown(nn.Module):
    """Latents ``[B, C, h, w]`` -> image tokens ``[B, h*w, hidden]`` (patch size 1), timestep-conditioned."""

    def __init__(self, latent_channels: int, hidden: int, patch_hidden: int) -> None:
        super().__init__()
        self.model = nn.ModuleList(
            [nn.Conv2d(latent_channels, patch_hidden, 3, padding=1), ResBlock(patch_hidden, hidden, hidden)]
        )

    def forward(self, latents: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = self.model[1](self.model[0](latents), emb)
        return x.flatten(2).transpose(1, 2)


class UNetUp(nn.Module):
    """Image-token hidden states ``[B, h*w, hidden]`` -> velocity ``[B, C, h, w]``, timestep-conditioned."""

    def __init__(self, latent_channels: int, hidden: int, patch_hidden: int) -> None:
        super().__init__()
        self.model = nn.ModuleList(
            [
                ResBlock(hidden, hidden, patch_hidden),
                nn.Sequential(GroupNorm32(patch_hidden), nn.SiLU(), nn.Conv2d(patch_hidden, latent_channels, 3, padding=1)),
            ]
        )

    def forward(self, tokens: torch.Tensor, emb: torch.Tensor, height: int, width: int) -> torch.Tensor:
        batch, _, channels = tokens.shape
        x = tokens.transpose(1, 2).reshape(batch, channels, height, width)
        return self.model[1](self.model[0](x, emb))
