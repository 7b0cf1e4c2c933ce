"""The -Instruct-Distil checkpoints (``cfg_distilled``, ``use_meanflow``), on a distilled tiny checkpoint.

The reference here is the release's whole sequence run at every step, written out in the test:
``... <answer> <boi> <img_size> <img_ratio> <timestep> <guidance> <timestep_r> <img>*(h*w) <eoi>``, one
causal forward in which only the image attends both ways, ``<timestep>`` holding ``timestep_emb(t)``,
``<guidance>`` ``guidance_emb`` of 1000 x the guidance scale as the release hands it over (a bfloat16
tensor: 2.5 -> 2496), ``<timestep_r>`` ``timestep_r_emb`` of the next step's timestep (0 after the
last); no uncond row; the Euler update. The ``dit`` stage instead encodes the prefix once and runs the
step tokens and the image over its keys/values, several requests in one forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_core.engine.request import OmniRequest

PROMPT = "A lighthouse at night"


@pytest.fixture(scope="module")
def distil(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_hunyuan.tiny import make_tiny

    directory = tmp_path_factory.mktemp("hunyuan-distil")
    make_tiny(directory, distil=True)
    return directory


@pytest.fixture(scope="module")
def parts(distil: Path) -> Any:
    """Our transformer (fp32), the image decoder, the tokenizer and its special tokens, the config."""
    from transformers import AutoTokenizer

    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.tokens import SpecialTokens
    from omni_hunyuan.vae import load_image_decoder
    from omni_hunyuan.weights import load_transformer

    config = HunyuanConfig.from_pretrained(distil)
    tokenizer = AutoTokenizer.from_pretrained(distil)
    tokens = SpecialTokens.from_tokenizer(tokenizer, config.image_base_size)
    decoder = load_image_decoder(distil, config.vae)
    return load_transformer(distil), decoder, tokenizer, tokens, config


@pytest.fixture(scope="module")
def runtime(distil: Path, inline_dit: Any) -> Any:
    runtime = inline_dit(distil)
    yield runtime
    runtime.close()


def _reference(
    parts: Any, ids: list[int], seed: int, steps: int, size: tuple[int, int], guidance_value: float, r_ahead: int = 1,
) -> np.ndarray:
    """The release's distilled sampler over the whole sequence after `ids` (ending with the ratio token);
    `r_ahead` 0 (a mutation) embeds the step's own timestep in <timestep_r>."""
    from omni_hunyuan.rope import image_positions, text_positions
    from omni_hunyuan.vae import decode_latents

    model, decoder, _, tokens, config = parts
    h, w = size[1] // config.vae_downsample, size[0] // config.vae_downsample
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn((1, config.latent_channels, h, w), generator=generator, dtype=torch.bfloat16).float()
    shift = 3.0
    sigmas = torch.linspace(1, 0, steps + 1)
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    length = len(ids)
    text = model.model.wte(torch.tensor(ids))
    eoi = model.model.wte(torch.tensor([tokens.eoi]))
    positions = torch.cat([text_positions(0, length + 3), image_positions(length + 3, h, w), text_positions(length + 3 + h * w, 1)])
    seq = length + 3 + h * w + 1
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask[length + 3 : length + 3 + h * w, length + 3 : length + 3 + h * w] = True
    with torch.no_grad():
        for step in range(steps):
            t, r = sigmas[step][None] * 1000, sigmas[step + r_ahead][None] * 1000
            scalars = [model.timestep_emb(t), model.guidance_emb(torch.tensor([guidance_value])), model.timestep_r_emb(r)]
            image = model.patch_embed(latents, model.time_embed(t))[0]
            embeds = torch.cat([text, *scalars, image, eoi])[None]
            hidden, _ = model._run(embeds, positions[None], mask[None, None], None)
            velocity = model.final_layer(hidden[:, length + 3 : length + 3 + h * w], model.time_embed_2(t), h, w)
            latents = latents + velocity * (sigmas[step + 1] - sigmas[step])
    return decode_latents(decoder, latents, config.vae)[0].numpy()


def _t2i_ids(parts: Any, size: tuple[int, int]) -> list[int]:
    """The instruct template's t2i text (no system prompt: the tiny checkpoint ships none) and the ratio step."""
    from omni_hunyuan.resolution import ratio_sizes

    _, _, tokenizer, tokens, config = parts

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ratio = ratio_sizes(config.image_base_size, len(tokens.ratios)).index(size)
    return [tokens.bos, *enc("User: "), *enc(PROMPT), *enc("\n\n"), *enc("Assistant: "), tokens.answer, tokens.boi, tokens.size, tokens.ratios[ratio]]


def test_the_checkpoint_carries_the_distil_schema(distil: Path, parts: Any) -> None:
    model, _, _, tokens, config = parts
    assert config.cfg_distilled and config.use_meanflow and config.step_tokens == 3
    assert tokens.guidance is not None and tokens.timestep_r is not None
    assert tokens.step_tokens(config) == [tokens.timestep, tokens.guidance, tokens.timestep_r]
    index = json.loads((distil / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"guidance_emb.mlp.0.weight", "timestep_r_emb.mlp.2.bias"} <= set(index)
    generation = json.loads((distil / "generation_config.json").read_text())
    assert (generation["diff_infer_steps"], generation["diff_guidance_scale"], generation["bot_task"]) == (8, 2.5, "think_recaption")


def test_distilled_t2i_equals_the_release_sequence_run_whole(runtime: Any, parts: Any, run_dit: Any) -> None:
    """No uncond row, the guidance scale and the next step in their tokens: the stage's image equals
    the whole sequence's; a guidance embedded unrounded (2500, not bfloat16's 2496) or the step's own
    timestep in <timestep_r> draw another (beyond the one 8-bit level allowed)."""
    seed, steps, size = 7, 3, (64, 64)
    image = run_dit(runtime, {"a": ({"prompt": PROMPT}, {"seed": seed, "num_inference_steps": steps, "size": size})})["a"]["image"]
    ids = _t2i_ids(parts, size)
    expected = _reference(parts, ids, seed, steps, size, guidance_value=2496.0)
    assert image.shape == expected.shape == (64, 64, 3)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    # the stand-alone sampler (what the benchmark runs) draws the same, from one row
    from omni_hunyuan.prompt import image_rows
    from omni_hunyuan.sampler import initial_noise, sample_t2i
    from omni_hunyuan.vae import decode_latents

    model, decoder, _, tokens, config = parts
    rows = image_rows(tokens, ids[:-3], tokens.ratios.index(ids[-1]), 4, 4, cfg=False, step_ids=tokens.step_tokens(config))
    latents = sample_t2i(model, rows.prefix, initial_noise(seed, config.latent_channels, 4, 4), steps, 2.5, 3.0)
    sampled = decode_latents(decoder, latents, config.vae)[0].numpy()
    assert np.abs(sampled.astype(int) - expected.astype(int)).max() <= 1
    for mutation in ({"guidance_value": 2500.0}, {"guidance_value": 2496.0, "r_ahead": 0}):
        other = _reference(parts, ids, seed, steps, size, **mutation)
        assert np.abs(other.astype(int) - expected.astype(int)).max() > 2, mutation


def test_distilled_requests_denoise_together_as_alone(runtime: Any, run_dit: Any) -> None:
    """Requests of other guidance scales and step counts, and an edit, share forwards (each row its own
    <guidance> and <timestep_r>) and draw what each draws alone; the checkpoint's 8 steps by default."""
    from PIL import Image

    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    requests = {
        "edit": ({"prompt": "Make the sky purple", "images": [photo]}, {"seed": 3, "num_inference_steps": 2, "size": (64, 64)}),
        "g2.5": ({"prompt": PROMPT}, {"seed": 1, "num_inference_steps": 2, "size": (64, 64)}),
        "g4": ({"prompt": PROMPT}, {"seed": 1, "num_inference_steps": 2, "size": (64, 64), "guidance_scale": 4.0}),
        "steps3": ({"prompt": "A watercolor of mountains"}, {"seed": 2, "num_inference_steps": 3, "size": (64, 64)}),
    }
    together = run_dit(runtime, requests)
    for name, request in requests.items():
        alone = run_dit(runtime, {name: request})[name]
        assert np.abs(together[name]["image"].astype(int) - alone["image"].astype(int)).max() <= 1, name
    assert np.abs(together["g2.5"]["image"].astype(int) - together["g4"]["image"].astype(int)).max() > 8
    sample = runtime.model.prepare("d", {"prompt": PROMPT}, {"seed": 1, "size": (64, 64)})[0]
    assert sample.total_steps == 8 and sample.state.prefix.ids.shape[0] == 1  # no uncond row
    edit = runtime.model.prepare("e", requests["edit"][0], requests["edit"][1])[0]
    assert edit.state.prefix.ids.shape[0] == 1


@pytest.fixture(scope="module")
def omni(distil: Path, inline_omni: Any) -> Any:
    with inline_omni(distil) as engine:
        yield engine


@pytest.mark.vllm
def test_think_recaption_then_draw_on_a_distilled_checkpoint(omni: Any, parts: Any) -> None:
    """The checkpoint's default for text + image (its bot_task, think_recaption): the ar stage (vLLM,
    which skips the distilled embedders' weights) reasons and picks the ratio; the dit, on the ar's
    modules and starting from its keys/values, draws after prompt and reasoning without CFG, equal to
    the whole sequence."""
    from omni_hunyuan.resolution import ratio_sizes

    _, _, _, tokens, config = parts
    request = OmniRequest(prompt=PROMPT, params={"ar": {"max_tokens": 12}, "dit": {"num_inference_steps": 2}}, extra={"seed": 5})
    result = omni.generate(request)[0]
    assert request.task == "think_recaption_t2i" and len(result.images) == 1 and result.text is not None
    generated = list(result.token_ids)
    assert generated[-4:-1] == [tokens.answer, tokens.boi, tokens.size] and tokens.end_recaption in generated
    size = ratio_sizes(config.image_base_size, len(tokens.ratios))[tokens.ratios.index(generated[-1])]
    expected = _reference(parts, [*result.prompt_token_ids, *generated], 5, 2, size, guidance_value=2496.0)
    image = np.asarray(result.images[0])
    assert image.shape == expected.shape == (size[1], size[0], 3)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1


@pytest.fixture(scope="module")
def dropping(distil: Path, tmp_path_factory: pytest.TempPathFactory, inline_omni: Any) -> Any:
    """The distilled checkpoint with generation_config's ``drop_think`` on, served."""
    directory = tmp_path_factory.mktemp("hunyuan-distil-drop-think")
    for item in distil.iterdir():
        if item.name != "generation_config.json":
            (directory / item.name).symlink_to(item, target_is_directory=item.is_dir())
    generation = json.loads((distil / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "drop_think": True}))
    with inline_omni(directory) as engine:
        yield engine


@pytest.mark.vllm
def test_drop_think_leaves_the_think_section_out_of_the_image_pass(dropping: Any, parts: Any) -> None:
    """generation_config's ``drop_think``: the ar stage thinks and recaptions as before (the ratio
    picked with the think section in view), the image is drawn after the prompt and the recaption
    only (``<think>`` ... ``</think>`` left out, tags included), as the release's image pass does."""
    from omni_hunyuan.resolution import ratio_sizes

    _, _, _, tokens, config = parts
    request = OmniRequest(prompt=PROMPT, params={"ar": {"max_tokens": 12}, "dit": {"num_inference_steps": 2}}, extra={"seed": 5})
    result = dropping.generate(request)[0]
    prompt, generated = list(result.prompt_token_ids), list(result.token_ids)
    assert prompt[-1] == tokens.think and tokens.end_think in generated and generated[-4:-1] == [tokens.answer, tokens.boi, tokens.size]
    kept = generated[generated.index(tokens.end_think) + 1 :]
    assert kept[0] == tokens.recaption
    size = ratio_sizes(config.image_base_size, len(tokens.ratios))[tokens.ratios.index(generated[-1])]
    expected = _reference(parts, [*prompt[:-1], *kept], 5, 2, size, guidance_value=2496.0)
    image = np.asarray(result.images[0])
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    whole = _reference(parts, [*prompt, *generated], 5, 2, size, guidance_value=2496.0)
    assert np.abs(whole.astype(int) - expected.astype(int)).max() > 2  # (keeping the think section draws another)

