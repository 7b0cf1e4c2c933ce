"""Image understanding (i2t) on the torch side: the image block's layout, preprocessing, the image
encoder's weights and what it computes against our VAE and transformers' Siglip2, and that the
block's two-way attention and 2-D positions change the answer (so the vLLM test, which compares with
`prompt_forward`, would see either go missing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from omni_hunyuan.config import HunyuanConfig
from omni_hunyuan.resolution import drawable, ratio_sizes
from omni_hunyuan.understanding import BlockShape, ImageEncoder, i2t_prompt_ids, layout, preprocess


@pytest.fixture(scope="module")
def config(checkpoint: Path) -> HunyuanConfig:
    return HunyuanConfig.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def encoder(checkpoint: Path) -> ImageEncoder:
    return ImageEncoder.from_pretrained(checkpoint)


def test_the_block_layout(tokens: Any) -> None:
    """``<boi> <size> <ratio_k> <timestep> <img>*6 <sep> <img>*5 <eoi>`` at index 5: the VAE slots on a
    2x3 grid centred in their span, the first 4 ViT slots on a 2x2 grid, the padding slot and the
    rest 1-D; the two-way span runs from the first VAE slot to the last ViT slot."""
    shape = BlockShape(ratio=3, vae_grid=(2, 3), vit_grid=(2, 2), vit_slots=5)
    ids = shape.ids(tokens)
    assert ids == [tokens.boi, tokens.size, tokens.ratios[3], tokens.timestep, *[tokens.image] * 6, tokens.joint_img_sep, *[tokens.image] * 5, tokens.eoi]
    assert shape.length == len(ids) == 17 and shape.slots == 12
    positions = shape.positions(5).tolist()
    assert positions[:4] == [[5, 5], [6, 6], [7, 7], [8, 8]]
    # VAE: L = 9, span 6: y = 9 + (6 - 2) // 2 + row, x = 9 + (6 - 3) // 2 + col.
    assert positions[4:10] == [[11, 10], [11, 11], [11, 12], [12, 10], [12, 11], [12, 12]]
    assert positions[10] == [15, 15]  # <joint_img_sep>
    # ViT: L = 16, span 4: y = 16 + 1 + row, x = 16 + 1 + col; then the padding slot, then <eoi>.
    assert positions[11:15] == [[17, 17], [17, 18], [18, 17], [18, 18]]
    assert positions[15:] == [[20, 20], [21, 21]]
    assert shape.span(5) == (9, 21)


def test_preprocess_stretches_to_the_nearest_ratio_and_pads_the_vit_patches(config: HunyuanConfig, tokens: Any) -> None:
    image = Image.new("RGB", (100, 60), (200, 30, 30))
    cond = preprocess(image, config, len(tokens.ratios))
    sizes = ratio_sizes(config.image_base_size, len(tokens.ratios))
    valid = drawable(config.image_base_size, len(tokens.ratios), config.vae_downsample)
    assert cond.ratio in valid
    assert all(abs(sizes[cond.ratio][1] / sizes[cond.ratio][0] - 0.6) <= abs(sizes[i][1] / sizes[i][0] - 0.6) for i in valid)
    width, height = sizes[cond.ratio]
    assert cond.vae_pixels.shape == (3, height, width)
    red = torch.tensor([200, 30, 30]) / 255.0 * 2 - 1
    torch.testing.assert_close(cond.vae_pixels[:, height // 2, width // 2], red, atol=1e-6, rtol=0)
    slots = config.raw["vit_processor"]["max_num_patches"]
    assert cond.vit_pixels.shape[0] == slots and int(cond.vit_mask.sum()) == cond.vit_grid[0] * cond.vit_grid[1] < slots
    assert cond.shape.vit_slots == slots


def test_the_encoder_equals_the_vae_and_transformers_siglip2(checkpoint: Path, config: HunyuanConfig, encoder: ImageEncoder, model: Any, tokens: Any, vae: Any) -> None:
    """The embedded run: ``patch_embed(scaled VAE sample, time_embed(0))`` (the VAE: test_release.py), the
    separator, ``aligner(Siglip2)`` of every row, padding included (the release's rule); its modules carry the same weights as
    the transformer's (``patch_embed``, ``time_embed``, ``timestep_emb``)."""
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

    from omni_hunyuan.weights import read_tensors

    for name in ("patch_embed", "time_embed", "timestep_emb"):
        ours, theirs = getattr(encoder, name).state_dict(), getattr(model, name).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    cond = preprocess(Image.radial_gradient("L").convert("RGB").resize((40, 90)), config, len(tokens.ratios))
    separator = torch.randn(config.hidden_size)
    run = encoder.embed(cond, separator, seed=7)
    h, w = cond.shape.vae_grid
    assert run.shape == (cond.shape.slots, config.hidden_size)

    t = torch.zeros(1)
    with torch.no_grad():
        latents = vae.sample_latents(cond.vae_pixels[None], torch.Generator().manual_seed(7))
        expected_vae = model.patch_embed(latents, model.time_embed(t))[0]
    torch.testing.assert_close(run[: h * w], expected_vae, atol=1e-5, rtol=0)
    torch.testing.assert_close(run[h * w], separator)

    vit = {k: v for k, v in config.raw["vit"].items() if k not in ("model_type", "use_return_dict")}
    tower = Siglip2VisionModel(Siglip2VisionConfig(**vit))
    tower.load_state_dict({k.removeprefix("vision_model."): v for k, v in read_tensors(checkpoint, ("vision_model.",)).items()})
    aligner = read_tensors(checkpoint, ("vision_aligner.",))
    with torch.no_grad():
        hidden = tower(pixel_values=cond.vit_pixels[None], pixel_attention_mask=cond.vit_mask[None], spatial_shapes=torch.tensor([cond.vit_grid])).last_hidden_state[0]
        assert not cond.vit_mask.all()  # (a padding row, which the aligner takes as the tower gives it)
        first = torch.nn.functional.linear(hidden, aligner["vision_aligner.layers.0.weight"], aligner["vision_aligner.layers.0.bias"])
        expected_vit = torch.nn.functional.linear(torch.nn.functional.gelu(first), aligner["vision_aligner.layers.2.weight"], aligner["vision_aligner.layers.2.bias"])
    torch.testing.assert_close(run[h * w + 1 :], expected_vit, atol=1e-5, rtol=0)


def test_two_way_attention_and_2d_positions_change_the_answer(config: HunyuanConfig, encoder: ImageEncoder, model: Any, tokenizer: Any, tokens: Any) -> None:
    cond = preprocess(Image.new("RGB", (100, 60), (200, 30, 30)), config, len(tokens.ratios))
    prompt = layout(i2t_prompt_ids(tokenizer, tokens, "What is in the image?", 1), [cond], tokens, model.model.wte, encoder)
    assert prompt.ids.count(tokens.image) == cond.shape.slots - 1 and len(prompt.spans) == 1
    ids = torch.tensor([prompt.ids])
    flat = torch.arange(len(prompt.ids))[None, :, None].repeat(1, 1, 2)
    full = model.greedy(ids, 8, prompt=(prompt.embeds[None], prompt.positions[None], prompt.spans))
    assert full != model.greedy(ids, 8, prompt=(prompt.embeds[None], prompt.positions[None], ()))  # causal only
    assert full != model.greedy(ids, 8, prompt=(prompt.embeds[None], flat, prompt.spans))  # 1-D positions
    # Text after the block (and generated text) goes on from the block's end: positions = indices.
    end = prompt.spans[0][1]
    assert prompt.positions[end:, 0].tolist() == list(range(end, len(prompt.ids)))


def test_an_input_image_covers_its_bucket_and_is_centre_cropped() -> None:
    """The release's default for an input image's VAE branch: scaled with its aspect ratio kept to cover
    the bucket's size, then its centre cut out (not stretched)."""
    import numpy as np
    from PIL import Image

    from omni_hunyuan.understanding import cover_crop

    rng = np.random.default_rng(0)
    wide = rng.integers(0, 256, (100, 200, 3), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(cover_crop(Image.fromarray(wide), 100, 100)), wide[:, 50:150])
    tall = rng.integers(0, 256, (300, 100, 3), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(cover_crop(Image.fromarray(tall), 100, 200)), tall[50:250])
    half = np.asarray(cover_crop(Image.fromarray(wide), 50, 40))  # scaled to 80x40 first, then 15 px off each side
    np.testing.assert_array_equal(half, np.asarray(Image.fromarray(wide).resize((80, 40), Image.Resampling.LANCZOS))[:, 15:65])
