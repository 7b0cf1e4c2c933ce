"""The image path against nemo-automodel's Apache-2.0 `hunyuan_image3` on the same weights
(FAMILIES.md 2.4/2.5); the VAE against the release's outputs is test_release.py.

nemo-automodel is imported at the top: if it is not installed (`pip install --no-deps
nemo-automodel==0.7.0`), this module fails rather than skips.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nemo_automodel.components.models.hunyuan_image3.pipeline as nemo_pipeline
import numpy as np
import pytest
import torch
from omni_hunyuan.config import HunyuanConfig, generation_defaults
from omni_hunyuan.prompt import t2i_rows
from omni_hunyuan.sampler import initial_noise, sample_t2i

PROMPT = "A red apple on a wooden table"
SQUARE = 16  # the middle of <img_ratio_0..32>; the tiny image is 64x64 = 4x4 latent tokens


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tokens: Any) -> Any:
    from omni_hunyuan.reference import nemo_model

    return nemo_model(checkpoint, tokens.image, tokens.timestep)


def _latent_size(checkpoint: Path) -> int:
    config = HunyuanConfig.from_pretrained(checkpoint)
    return config.image_base_size // config.vae_downsample


def test_denoising_forward_equals_nemo(checkpoint: Path, model: Any, reference: Any, tokenizer: Any, tokens: Any) -> None:
    side = _latent_size(checkpoint)
    rows = t2i_rows(tokenizer, tokens, PROMPT, SQUARE, side, side, cfg=True)
    latents = torch.randn(2, model.config.latent_channels, side, side, generator=torch.Generator().manual_seed(1))
    timestep = torch.tensor([1000.0, 437.5])
    with torch.no_grad():
        ours = model.velocity_from_ids(rows.rows, latents, timestep, tokens.image)
        (theirs,) = reference(rows.rows, latents, timestep)
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_text_logits_equal_nemo(model: Any, reference: Any, tokenizer: Any, tokens: Any) -> None:
    ids = torch.tensor([[tokens.bos, *tokenizer.encode(PROMPT, add_special_tokens=False)]])
    with torch.no_grad():
        ours, _ = model.text_forward(ids)
        theirs = reference.forward_text(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_two_step_t2i_equals_nemo(
    checkpoint: Path, model: Any, reference: Any, tokenizer: Any, tokens: Any, vae: Any, decoder: Any
) -> None:
    """Same seed, same noise, same 2-step CFG schedule: latents within 1e-5; the 8-bit image of our
    decoder and of the release-style decode nemo's pipeline runs (over our VAE: `ReleaseVAECall`) within one level."""
    from omni_hunyuan.reference import NemoPrompts, ReleaseVAECall
    from omni_hunyuan.vae import decode_latents

    config = HunyuanConfig.from_pretrained(checkpoint)
    side = _latent_size(checkpoint)
    shift = float(generation_defaults(checkpoint)["flow_shift"])
    guidance, seed = 5.0, 42

    release_vae = ReleaseVAECall(vae)
    pipe = nemo_pipeline.HunyuanImage3Pipeline(reference, release_vae, NemoPrompts(tokenizer, tokens, SQUARE, side), shift, torch.device("cpu"))
    size = side * config.vae_downsample
    image = pipe(PROMPT, generator=torch.Generator("cpu").manual_seed(seed), num_inference_steps=2, guidance_scale=guidance, height=size, width=size).images[0]
    theirs = release_vae.seen.squeeze(2) * config.vae["scaling_factor"]

    rows = t2i_rows(tokenizer, tokens, PROMPT, SQUARE, side, side, cfg=True)
    noise = initial_noise(seed, config.latent_channels, side, side)
    ours = sample_t2i(model, rows.prefix, noise, steps=2, guidance_scale=guidance, flow_shift=shift)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    pixels = decode_latents(decoder, ours, config.vae)[0].numpy()
    assert pixels.std() > 1, "a flat image would compare nothing"
    difference = np.abs(pixels.astype(int) - np.asarray(image, dtype=int))
    assert difference.max() <= 1 and (difference == 0).mean() > 0.99


def test_sampler_without_cfg_runs_one_row(checkpoint: Path, model: Any, tokenizer: Any, tokens: Any) -> None:
    side = _latent_size(checkpoint)
    rows = t2i_rows(tokenizer, tokens, PROMPT, SQUARE, side, side, cfg=False)
    noise = initial_noise(0, model.config.latent_channels, side, side)
    out = sample_t2i(model, rows.prefix, noise, steps=2, guidance_scale=1.0, flow_shift=3.0)
    assert out.shape == noise.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="CFG"):
        sample_t2i(model, rows.prefix, noise, steps=2, guidance_scale=5.0, flow_shift=3.0)
