"""The image VAE: the release's ``AutoencoderKLConv3D``, written from its architecture.

A KL autoencoder over video-shaped tensors ``[B, C, T, H, W]`` (32 latent channels, 16x spatial and 4x
temporal compression). Every convolution is a plain 3-D one, zero-padded on all sides (not causal);
every norm a 32-group GroupNorm (eps 1e-6, affine); the down/upsamplers trade space (and time) for
channels (``DCAE``: a convolution to a fraction of the channels, then space-to-depth, plus a shortcut
that averages (down) or repeats (up) channels); the encoder's end and the decoder's start have channel
shortcuts too; the mid blocks carry one single-head attention over every position. (diffusers'
``AutoencoderKLHunyuanVideo15`` shares the layout but not the numbers: causal, replicate-padded
convolutions and RMS norms.)

An image is a one-frame video. Encoding repeats it to ``ffactor_temporal`` frames, which the encoder's
temporal downsamplers fold back into one latent frame; decoding a one-frame latent gives
``ffactor_temporal`` frames, of which the release keeps the last. The module and parameter names are
the release's (``encoder.down.{i}.block.{j}.norm1.weight``, ``decoder.mid.attn_1.q.weight``, ...), so the
checkpoint's ``vae.*`` tensors load as they are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VAE_PREFIX = "vae."


class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` (the release's 32 groups, eps 1e-6, affine; the same parameters), whose statistics
    on CUDA come from a parallel reduction: PyTorch's group-norm statistics kernel
    (``RowwiseMomentsCUDAKernel``) took 163 of the 462 ms of a 1024x1024 decode on an H100
    (bench/hunyuan_vae_decode.py --profile, `bench/results/hunyuan-vae-decode-h100.md`): one thread block
    per (sample, group) row, 32 blocks over rows of up to ~16M values. In fp32, as autocast runs group
    norm (`group_norm_by_reduction`, equal to ``F.group_norm`` within fp32 rounding: tests/test_pieces.py):
    the decode then takes 312 ms (`bench/results/hunyuan-vae-decode-h100-norms.md`; compiled, either
    way, 231). Elsewhere, or with `by_reduction` off (`use_release_ops`), the library's kernel."""

    by_reduction = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.by_reduction and x.is_cuda):
            return super().forward(x)
        return group_norm_by_reduction(x, self.num_groups, self.weight, self.bias, self.eps)


def group_norm_by_reduction(x: torch.Tensor, groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.group_norm`` in fp32 from ``torch.var_mean`` over each (sample, group) row (`GroupNorm`'s CUDA
    path): the statistics and the affine folded into one scale and shift per (sample, channel), then one
    ``shift + x * scale`` pass (as the library's kernel applies them)."""
    batch, channels = x.shape[:2]
    values = x.float()
    var, mean = torch.var_mean(values.reshape(batch, groups, -1), dim=-1, correction=0)
    scale = weight.float().reshape(groups, -1) * torch.rsqrt(var + eps)[..., None]  # [B, G, C/G]
    shift = bias.float().reshape(groups, -1) - mean[..., None] * scale
    shape = (batch, channels) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.reshape(shape), values, scale.reshape(shape))


class FrameConv3d(nn.Conv3d):
    """``nn.Conv3d`` with a kernel of 3 frames, zero-padded by one frame on each side (the release's
    convolutions; the same parameters), that multiplies only the kernel's frames that meet an input
    frame. An image decodes through one, two and four frames (`Decoder`): one frame meets only the
    kernel's middle frame (a third of a plain convolution's products), and the first and last of
    several frames meet two of the three, so a plain convolution spends 2/3, 1/3 and 1/6 of its
    products on the zero padding. Here: the first and last frames from two-frame kernels, the others
    from the whole kernel without time padding. Equal to the plain convolution in exact arithmetic
    (the padding's products are zeros; the sums are the same, grouped otherwise); with `by_frames`
    off (`use_release_ops`), the plain convolution."""

    by_frames = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[2]
        other_kernel = (self.kernel_size[0], self.padding[0], self.stride[0], self.dilation[0]) != (3, 1, 1, 1)
        if not self.by_frames or other_kernel or self.padding_mode != "zeros" or x.dim() != 5:
            return super().forward(x)
        spatial = (0, *self.padding[1:])
        if frames == 1:
            return F.conv3d(x, self.weight[:, :, 1:2], self.bias, padding=spatial)
        first = F.conv3d(x[:, :, :2], self.weight[:, :, 1:], self.bias, padding=spatial)
        last = F.conv3d(x[:, :, -2:], self.weight[:, :, :2], self.bias, padding=spatial)
        if frames == 2:
            return torch.cat([first, last], dim=2)
        return torch.cat([first, F.conv3d(x, self.weight, self.bias, padding=spatial), last], dim=2)


def use_release_ops(module: nn.Module) -> nn.Module:
    """`module`'s `GroupNorm`s on the library's kernel and its `FrameConv3d`s as plain convolutions
    everywhere (as the release runs them: a reference's VAE, `omni_hunyuan.reference.ReleaseVAECall`);
    returns `module`."""
    for part in module.modules():
        if isinstance(part, GroupNorm):
            part.by_reduction = False
        elif isinstance(part, FrameConv3d):
            part.by_frames = False
    return module


def _norm(channels: int) -> nn.GroupNorm:
    return GroupNorm(32, channels, eps=1e-6, affine=True)


def _conv(in_channels: int, out_channels: int, kernel: int = 3) -> nn.Conv3d:
    return (FrameConv3d if kernel == 3 else nn.Conv3d)(in_channels, out_channels, kernel, padding=kernel // 2)


def _space_to_depth(x: torch.Tensor, temporal: bool) -> torch.Tensor:
    """``[B, C, T*r, 2H, 2W]`` -> ``[B, r*2*2*C, T, H, W]`` (r = 2 if `temporal`), the channel index
    ``((dt * 2 + dy) * 2 + dx) * C + c``."""
    r = 2 if temporal else 1
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t // r, r, h // 2, 2, w // 2, 2).permute(0, 3, 5, 7, 1, 2, 4, 6)
    return x.reshape(b, r * 4 * c, t // r, h // 2, w // 2)


def _depth_to_space(x: torch.Tensor, temporal: bool) -> torch.Tensor:
    """The inverse of `_space_to_depth`."""
    r = 2 if temporal else 1
    b, packed, t, h, w = x.shape
    c = packed // (r * 4)
    x = x.reshape(b, r, 2, 2, c, t, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)
    return x.reshape(b, c, t * r, h * 2, w * 2)


class ResnetBlock(nn.Module):
    """``x + conv2(silu(norm2(conv1(silu(norm1(x))))))``, the skip through a 1x1x1 ``nin_shortcut``
    when the width changes."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(in_channels), _conv(in_channels, out_channels)
        self.norm2, self.conv2 = _norm(out_channels), _conv(out_channels, out_channels)
        if in_channels != out_channels:
            self.nin_shortcut = _conv(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + hidden


class AttnBlock(nn.Module):
    """Single-head attention over every (t, y, x) position, 1x1x1 projections, residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (_conv(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        normed = self.norm(x)
        q, k, v = (proj(normed).reshape(b, 1, c, t * h * w).transpose(-1, -2).contiguous() for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj_out(out.transpose(-1, -2).reshape(b, c, t, h, w))


class DownsampleDCAE(nn.Module):
    """Half the height and width (and the frames, if `temporal`): a convolution to ``out / factor``
    channels then space-to-depth, plus the input's space-to-depth averaged over groups of channels."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        factor = 8 if temporal else 4
        if out_channels % factor:
            raise ValueError(f"a downsampler to {out_channels} channels needs a multiple of {factor}")
        self.temporal = temporal
        self.group = factor * in_channels // out_channels
        self.conv = _conv(in_channels, out_channels // factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = _space_to_depth(self.conv(x), self.temporal)
        shortcut = _space_to_depth(x, self.temporal)
        b, _, t, h, w = shortcut.shape
        return hidden + shortcut.reshape(b, hidden.shape[1], self.group, t, h, w).mean(dim=2)


class UpsampleDCAE(nn.Module):
    """Twice the height and width (and the frames, if `temporal`): a convolution to ``out * factor``
    channels then depth-to-space, plus the input's channels repeated and put through depth-to-space."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        factor = 8 if temporal else 4
        self.temporal = temporal
        self.repeats = factor * out_channels // in_channels
        self.conv = _conv(in_channels, out_channels * factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = _depth_to_space(x.repeat_interleave(self.repeats, dim=1), self.temporal)
        return _depth_to_space(self.conv(x), self.temporal) + shortcut


def _mid(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(channels, channels)
    mid.attn_1 = AttnBlock(channels)
    mid.block_2 = ResnetBlock(channels, channels)
    return mid


def _run_mid(mid: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(x)))


class Encoder(nn.Module):
    """Pixels ``[B, 3, T, H, W]`` -> the posterior's mean and log-variance ``[B, 2 * latent, T/ft, H/fs, W/fs]``.

    Level i (of ``block_out_channels``) runs ``layers_per_block`` resnet blocks, then, while the spatial
    factor is not reached, a downsampler (temporal too once the remaining levels are the temporal
    factor's); the mid blocks; ``conv_out(silu(norm_out(h)))`` plus ``h`` averaged over channel groups."""

    def __init__(self, settings: VAESettings) -> None:
        super().__init__()
        widths, latent = settings.block_out_channels, settings.latent_channels
        if widths[-1] % (2 * latent):
            raise ValueError(f"the encoder's last width {widths[-1]} is not a multiple of 2 x {latent} latent channels")
        self.group = widths[-1] // (2 * latent)
        self.conv_in = _conv(settings.in_channels, widths[0])
        self.down = nn.ModuleList()
        spatial_levels = int(math.log2(settings.ffactor_spatial))
        first_temporal = int(math.log2(settings.ffactor_spatial // settings.ffactor_temporal))
        width = widths[0]
        for level, out in enumerate(widths):
            down = nn.Module()
            down.block = nn.ModuleList()
            for _ in range(settings.layers_per_block):
                down.block.append(ResnetBlock(width, out))
                width = out
            if level < spatial_levels:
                if level == len(widths) - 1:
                    raise ValueError(f"{len(widths)} VAE levels cannot downsample {settings.ffactor_spatial}x")
                target = widths[level + 1] if settings.downsample_match_channel else width
                down.downsample = DownsampleDCAE(width, target, temporal=level >= first_temporal)
                width = target
            self.down.append(down)
        self.mid = _mid(width)
        self.norm_out = _norm(width)
        self.conv_out = _conv(width, 2 * latent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.conv_in(x)
        for down in self.down:
            for block in down.block:
                hidden = block(hidden)
            if hasattr(down, "downsample"):
                hidden = down.downsample(hidden)
        hidden = _run_mid(self.mid, hidden)
        b, c, t, h, w = hidden.shape
        shortcut = hidden.reshape(b, c // self.group, self.group, t, h, w).mean(dim=2)
        out = self.conv_out(F.silu(self.norm_out(hidden)))
        out += shortcut  # in place, as the release adds it: under autocast the sum stays in the conv's dtype
        return out


class Decoder(nn.Module):
    """Latents ``[B, latent, T, h, w]`` -> pixels ``[B, 3, T * ft, h * fs, w * fs]``.

    ``conv_in(z)`` plus ``z`` repeated to its width; the mid blocks; level i (of the reversed
    ``block_out_channels``) runs ``layers_per_block + 1`` resnet blocks, then an upsampler while the
    spatial factor is not reached (temporal too for the first log2(temporal factor) levels);
    ``conv_out(silu(norm_out(h)))``."""

    def __init__(self, settings: VAESettings) -> None:
        super().__init__()
        widths, latent = tuple(reversed(settings.block_out_channels)), settings.latent_channels
        if widths[0] % latent:
            raise ValueError(f"the decoder's first width {widths[0]} is not a multiple of {latent} latent channels")
        self.repeats = widths[0] // latent
        width = widths[0]
        self.conv_in = _conv(latent, width)
        self.mid = _mid(width)
        self.up = nn.ModuleList()
        spatial_levels = int(math.log2(settings.ffactor_spatial))
        temporal_levels = int(math.log2(settings.ffactor_temporal))
        for level, out in enumerate(widths):
            up = nn.Module()
            up.block = nn.ModuleList()
            for _ in range(settings.layers_per_block + 1):
                up.block.append(ResnetBlock(width, out))
                width = out
            if level < spatial_levels or level < temporal_levels:
                if level == len(widths) - 1:
                    raise ValueError(f"{len(widths)} VAE levels cannot upsample {settings.ffactor_spatial}x")
                target = widths[level + 1] if settings.upsample_match_channel else width
                up.upsample = UpsampleDCAE(width, target, temporal=level < temporal_levels)
                width = target
            self.up.append(up)
        self.norm_out = _norm(width)
        self.conv_out = _conv(width, settings.out_channels)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        hidden = _run_mid(self.mid, self.conv_in(z) + z.repeat_interleave(self.repeats, dim=1))
        for up in self.up:
            for block in up.block:
                hidden = block(hidden)
            if hasattr(up, "upsample"):
                hidden = up.upsample(hidden)
        return self.conv_out(F.silu(self.norm_out(hidden)))

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_in.weight.dtype

    def decode_image(self, latents: torch.Tensor) -> torch.Tensor:
        """Unscaled latents ``[B, latent, h, w]`` -> pixels ``[B, 3, H, W]`` in about [-1, 1]: the one-frame
        latent decodes to ``ffactor_temporal`` frames, and the image is the last (the release's rule)."""
        return self(latents[:, :, None])[:, :, -1]  # (through __call__: a compiled decoder's `compile()` applies)


class VAESettings:
    """The config.json ``vae`` section's sizes (the release's ``AutoencoderKLConv3D`` arguments)."""

    def __init__(self, section: Mapping[str, Any]) -> None:
        self.in_channels = int(section.get("in_channels", 3))
        self.out_channels = int(section.get("out_channels", 3))
        self.latent_channels = int(section["latent_channels"])
        self.block_out_channels = tuple(int(c) for c in section["block_out_channels"])
        self.layers_per_block = int(section["layers_per_block"])
        self.ffactor_spatial = int(section.get("ffactor_spatial", 16))
        self.ffactor_temporal = int(section.get("ffactor_temporal", 4))
        self.downsample_match_channel = bool(section.get("downsample_match_channel", True))
        self.upsample_match_channel = bool(section.get("upsample_match_channel", True))
        self.scaling_factor = float(section.get("scaling_factor") or 1.0)
        self.shift_factor = float(section.get("shift_factor") or 0.0)
        for name, factor in (("ffactor_spatial", self.ffactor_spatial), ("ffactor_temporal", self.ffactor_temporal)):
            if factor < 1 or factor & (factor - 1):
                raise ValueError(f"vae.{name} must be a power of two, got {factor}")
        if self.ffactor_temporal > self.ffactor_spatial:
            raise ValueError("vae.ffactor_temporal larger than ffactor_spatial is not a layout the release builds")


class VAE(nn.Module):
    """The release's ``AutoencoderKLConv3D``: ``encoder`` and/or ``decoder`` (`parts`), and how the release
    pipeline encodes and decodes images with them."""

    def __init__(self, section: Mapping[str, Any], parts: tuple[str, ...] = ("encoder", "decoder")) -> None:
        super().__init__()
        self.settings = VAESettings(section)
        if "encoder" in parts:
            self.encoder = Encoder(self.settings)
        if "decoder" in parts:
            self.decoder = Decoder(self.settings)

    def moments(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images ``[B, 3, H, W]`` in [-1, 1] -> the posterior's mean and std ``[B, latent, h, w]``: each
        image repeated to ``ffactor_temporal`` frames (the release's rule for a one-frame input), log-variance
        clamped to [-30, 20]."""
        video = pixels[:, :, None].expand(-1, -1, self.settings.ffactor_temporal, -1, -1)
        mean, logvar = self.encoder(video)[:, :, 0].chunk(2, dim=1)
        return mean, torch.exp(0.5 * logvar.clamp(-30.0, 20.0))

    def sample_latents(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Scaled latents ``[B, latent, h, w]`` of images: a posterior sample (the noise drawn from `generator`
        in the latents' shape, device and dtype), ``- shift_factor``, ``* scaling_factor``. On CUDA under
        fp16 autocast, as the release encodes."""
        on_cuda = pixels.device.type == "cuda"
        with torch.autocast(device_type=pixels.device.type, dtype=torch.float16, enabled=on_cuda):
            mean, std = self.moments(pixels)
            # Drawn where the generator lives (a CPU generator for CUDA latents too), then moved: diffusers'
            # `randn_tensor`, which the release's posterior samples with.
            where = mean.device if generator is None else generator.device
            noise = torch.randn(mean.shape, generator=generator, device=where, dtype=mean.dtype).to(mean.device)
            latents = mean + std * noise
        return (latents - self.settings.shift_factor) * self.settings.scaling_factor


def build_vae(section: Mapping[str, Any], parts: tuple[str, ...] = ("encoder", "decoder")) -> VAE:
    """A `VAE` with random weights (PyTorch's default init), sized from the release ``vae`` section."""
    return VAE(section, parts)


def load_vae(model_path: str | Path, section: Mapping[str, Any], device: str = "cpu", parts: tuple[str, ...] = ("encoder", "decoder")) -> VAE:
    """The VAE (its `parts`) with the checkpoint's ``vae.*`` weights, in fp32 (`decode_latents` and
    `VAE.sample_latents` autocast on CUDA); every tensor of those parts must be there, and no other."""
    from omni_hunyuan.weights import read_tensors

    vae = build_vae(section, parts)
    prefixes = tuple(f"{VAE_PREFIX}{part}." for part in parts)
    state = {key[len(VAE_PREFIX) :]: tensor for key, tensor in read_tensors(model_path, prefixes).items()}
    result = vae.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"vae.* weights do not match the release VAE: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return vae.to(device=device, dtype=torch.float32).eval()


def load_image_decoder(model_path: str | Path, section: Mapping[str, Any], device: str = "cpu") -> Decoder:
    """The checkpoint's VAE decoder alone (fp32), what the ``dit`` stage decodes with."""
    return load_vae(model_path, section, device=device, parts=("decoder",)).decoder


@torch.no_grad()
def decode_latents(decoder: Decoder, latents: torch.Tensor, section: Mapping[str, Any]) -> torch.Tensor:
    """Scaled latents ``[B, C, h, w]`` -> uint8 images ``[B, H, W, 3]``, as the release decodes them.

    Undo the scaling (``/ scaling_factor``, then ``+ shift_factor`` when set), decode (`Decoder.decode_image`:
    the last of the frames a one-frame latent gives), map [-1, 1] to [0, 255] and round. One image a call
    (an image does not depend on what is decoded beside it; the memory of one 1024x1024 decode is the
    peak). On CUDA under fp16 autocast, as the release pipeline decodes; elsewhere in the decoder's dtype."""
    settings = VAESettings(section)
    latents = latents.float() / settings.scaling_factor + settings.shift_factor
    on_cuda = latents.device.type == "cuda"
    with torch.autocast(device_type=latents.device.type, dtype=torch.float16, enabled=on_cuda):
        pixels = torch.cat([decoder.decode_image(latent[None].to(decoder.dtype)) for latent in latents])
    image = (pixels / 2 + 0.5).clamp(0, 1).float()  # (denormalized in the decode's dtype, as diffusers' postprocess does)
    return (image.permute(0, 2, 3, 1) * 255).round().to(torch.uint8)
