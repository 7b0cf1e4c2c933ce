"""The single-frame 2-D VAE decode against diffusers' `AutoencoderKLWan.decode`."""

from __future__ import annotations

import pytest
import torch

from omni_cosmos3.tiny import SPECS, vae_config
from omni_cosmos3.vae2d import SingleFrameDecoder


def make_vae(size: str, channels_last: bool = False):
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(**vae_config(SPECS[size])).eval()
    if channels_last:  # as `Cosmos3Model.load` lays out the 3-D weights on CUDA
        for module in vae.modules():
            if isinstance(module, torch.nn.Conv3d):
                module.to(memory_format=torch.channels_last_3d)
    return vae


def count_decodes(vae, monkeypatch) -> list[tuple[int, ...]]:
    """Record the shapes `vae.decode` is called with (the fallback), still decoding."""
    calls: list[tuple[int, ...]] = []
    original = vae.decode

    def decode(z, *args, **kwargs):
        calls.append(tuple(z.shape))
        return original(z, *args, **kwargs)

    monkeypatch.setattr(vae, "decode", decode)
    return calls


@pytest.mark.parametrize(("size", "channels_last"), [("tiny", False), ("bench", False), ("bench", True)])
@torch.inference_mode()
def test_one_frame_decode_equals_diffusers(size, channels_last, monkeypatch):
    vae = make_vae(size, channels_last)
    fast = SingleFrameDecoder(vae)
    z = torch.randn(2, vae.config.z_dim, 1, 6, 10, generator=torch.Generator().manual_seed(1))
    expected = vae.decode(z).sample
    calls = count_decodes(vae, monkeypatch)
    got = fast(z)
    assert calls == []  # the 2-D path, not the fallback
    factor = 2 ** (len(vae.config.dim_mult) - 1)
    assert got.shape == expected.shape == (2, 3, 1, 6 * factor, 10 * factor)
    assert expected.abs().max() < 1.0  # not saturated by the clamp: the comparison means something
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


@torch.inference_mode()
def test_several_frames_and_tiling_fall_back_to_diffusers(monkeypatch):
    vae = make_vae("bench")
    fast = SingleFrameDecoder(vae)
    calls = count_decodes(vae, monkeypatch)
    video = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    assert fast(video).shape == (1, 3, 5, 32, 32)
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24, tile_sample_stride_width=24)
    image = torch.randn(1, 16, 1, 6, 6, generator=torch.Generator().manual_seed(3))
    assert fast(image).shape == (1, 3, 1, 48, 48)
    assert calls == [(1, 16, 2, 4, 4), (1, 16, 1, 6, 6)]


@torch.inference_mode()
def test_wan22_style_vae_falls_back_to_diffusers(monkeypatch):
    from diffusers import AutoencoderKLWan

    # Wan 2.2's layout (residual up blocks, patchified pixels) at a tiny width.
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
        is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=8,
    ).eval()
    fast = SingleFrameDecoder(vae)
    calls = count_decodes(vae, monkeypatch)
    out = fast(torch.randn(1, 4, 1, 4, 4))
    assert calls == [(1, 4, 1, 4, 4)]
    assert out.shape[2] == 1
