"""Single-frame decoding of Wan 2.1 latents with 2-D convolutions: the text-to-image VAE fast path.

`AutoencoderKLWan` decodes frame by frame, and every causal 3-D convolution pads its input with
``2 * padding_t`` zero frames in front. For the first (here: only) latent frame the temporal
kernel therefore multiplies zeros with all its taps but the last one, and the first chunk skips the
temporal convolution of each ``upsample3d`` resample (its feature cache holds ``"Rep"``). So a
one-frame decode is a 2-D network: each causal convolution is a `conv2d` with the last temporal
tap of its weight and the same spatial padding. `SingleFrameDecoder` runs that network on the
diffusers modules themselves (norms, activations, attention, spatial resampling); only the
convolution call differs, with the 2-D weights sliced once, at construction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from omni_cosmos3 import diffusers_private


class SingleFrameDecoder:
    """``vae.decode(z).sample`` for an `AutoencoderKLWan`, in 2-D when `z` has one latent frame.

    Everything else goes to ``vae.decode``: several frames, tiling or slicing enabled, accelerate
    offload hooks, and VAE variants this walk does not follow (Wan 2.2's patchified, residual one).
    Build it after the VAE has its final device, dtype and weight layout: the 2-D weights are taken
    once, here, and laid out channels-last where the 3-D ones are (`Cosmos3Model.load` on CUDA).
    """

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        self._convs = _prepare(vae)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        if self._convs is None or z.shape[2] != 1 or vae.use_tiling or vae.use_slicing or diffusers_private.has_offload_hook(vae):
            return vae.decode(z).sample
        return self.decode(z)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """`AutoencoderKLWan._decode` of one latent frame ([B, z_dim, 1, h, w]), the batch at once."""
        decoder = self.vae.decoder
        x = self._conv(decoder.conv_in, self._conv(self.vae.post_quant_conv, z))
        mid = decoder.mid_block
        x = self._residual(mid.resnets[0], x)
        for attn, resnet in zip(mid.attentions, mid.resnets[1:]):
            if attn is not None:
                x = attn(x)
            x = self._residual(resnet, x)
        for block in decoder.up_blocks:
            for resnet in block.resnets:
                x = self._residual(resnet, x)
            if block.upsamplers is not None:
                # 'upsample2d', or 'upsample3d' on its first chunk: the spatial resampling only.
                x = block.upsamplers[0].resample(x[:, :, 0]).unsqueeze(2)
        x = self._conv(decoder.conv_out, decoder.nonlinearity(decoder.norm_out(x)))
        return torch.clamp(x, min=-1.0, max=1.0)

    def _residual(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        """`WanResidualBlock.forward` of one frame."""
        h = x if isinstance(block.conv_shortcut, torch.nn.Identity) else self._conv(block.conv_shortcut, x)
        x = self._conv(block.conv1, block.nonlinearity(block.norm1(x)))
        x = self._conv(block.conv2, block.dropout(block.nonlinearity(block.norm2(x))))
        return x + h

    def _conv(self, conv: Any, x: torch.Tensor) -> torch.Tensor:
        """A `WanCausalConv3d` of one frame ([B, C, 1, H, W]): its last temporal tap as a 2-D convolution."""
        weight, padding = self._convs[conv]
        out = F.conv2d(x[:, :, 0], weight, conv.bias, conv.stride[1:], padding, conv.dilation[1:], conv.groups)
        return out.unsqueeze(2)


def _prepare(vae: Any) -> dict[Any, tuple[torch.Tensor, tuple[int, int]]] | None:
    """Each causal convolution's 2-D weight and spatial padding, or None where the walk does not apply."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan, WanCausalConv3d, WanUpBlock

    if type(vae) is not AutoencoderKLWan or vae.config.patch_size is not None or vae.config.is_residual:
        return None
    if not all(isinstance(block, WanUpBlock) for block in vae.decoder.up_blocks):
        return None
    convs = [vae.post_quant_conv, *(m for m in vae.decoder.modules() if isinstance(m, WanCausalConv3d))]
    prepared = {}
    with torch.no_grad():
        for conv in convs:
            pad_w, _, pad_h, _, pad_t, _ = diffusers_private.causal_conv_padding(conv)
            # With `pad_t` zero frames in front, the real frame meets only the last tap.
            if (conv.kernel_size[0] - 1) * conv.dilation[0] != pad_t:
                return None
            channels_last = conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
            layout = torch.channels_last if channels_last else torch.contiguous_format
            prepared[conv] = (conv.weight[:, :, -1].contiguous(memory_format=layout), (pad_h, pad_w))
    return prepared


__all__ = ["SingleFrameDecoder"]
