"""Image editing (``it2i``) and the ``instruct`` template's rows, on an Instruct copy of the tiny checkpoint.

The reference here is the release's whole sequence run at every step (`_whole_sequence_velocity`):
``<bos> "User: " <input image block> prompt "\\n\\n" "Assistant: " <answer> <boi> <img_size> <img_ratio>
<timestep> <img>*(h*w) <eoi>``, one causal forward in which the input image's block and the drawn image
each attend both ways, with 2-D positions, and the uncond row blanking only the prompt. The ``dit``
stage instead encodes the prefix once and runs the drawn image over its keys/values; both must give the
same image. The input image's VAE latent and then the starting noise come from one generator seeded
with the request's seed, as the release draws them.

Also: reasoning over an image before editing it (the ar stage on vLLM), the edit through
``/v1/images/edits``, chat and ``omni generate``, the routing of images by modality, the refusals, and
the checkpoint's own system prompt.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_core.config import resolve
from omni_core.engine.request import OmniRequest
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput

PROMPT = "Make the sky purple"


@pytest.fixture(scope="module")
def instruct(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with ``sequence_template: instruct`` (the weights linked, not copied)."""
    directory = tmp_path_factory.mktemp("hunyuan-instruct")
    for item in checkpoint.iterdir():
        (directory / item.name).symlink_to(item, target_is_directory=item.is_dir())
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (directory / "generation_config.json").unlink()
    (directory / "generation_config.json").write_text(json.dumps({**config, "sequence_template": "instruct"}))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def runtime(instruct: Path, inline_dit: Any) -> Any:
    runtime = inline_dit(instruct)
    yield runtime
    runtime.close()


def _photo(seed: int, size: tuple[int, int] = (96, 64)) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _data_url(image: Any) -> str:
    """A PNG data URL of a PIL image (what a chat message's ``image_url`` part carries)."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _whole_sequence_velocity(
    model: Any, prefix_embeds: torch.Tensor, prefix_positions: torch.Tensor, spans: tuple[tuple[int, int], ...],
    latents: torch.Tensor, t: torch.Tensor, eoi: torch.Tensor,
) -> torch.Tensor:
    """Velocity ``[rows, C, h, w]`` from one forward over each row's whole sequence (no cache)."""
    from omni_hunyuan.rope import image_positions, text_positions

    rows, length, _ = prefix_embeds.shape
    _, _, h, w = latents.shape
    step = model.timestep_emb(t)[:, None].expand(rows, 1, -1)
    image = model.patch_embed(latents, model.time_embed(t)).expand(rows, -1, -1)
    embeds = torch.cat([prefix_embeds, step, image, eoi[None, None].expand(rows, 1, -1)], dim=1)
    positions = torch.cat([prefix_positions, text_positions(length, 1), image_positions(length + 1, h, w), text_positions(length + 1 + h * w, 1)])
    seq = embeds.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    for start, end in (*spans, (length + 1, length + 1 + h * w)):
        mask[start:end, start:end] = True
    hidden, _ = model._run(embeds, positions[None], mask[None, None], None)
    return model.final_layer(hidden[:, length + 1 : length + 1 + h * w], model.time_embed_2(t), h, w)


def _reference(
    instruct: Path, model: Any, decoder: Any, tokens: Any, cond_ids: list[int], uncond_ids: list[int], photos: list[Any],
    seed: int, steps: int, size: tuple[int, int], stretch: bool = False,
) -> np.ndarray:
    """The release's sampler over whole sequences: one generator seeded with `seed` draws the input
    images' VAE latents, then the noise; both rows hold the same input images (`stretch`: their VAE
    branch stretched to the bucket, ``infer_align_image_size``)."""
    from omni_hunyuan.config import HunyuanConfig, generation_defaults
    from omni_hunyuan.sampler import flow_sigmas
    from omni_hunyuan.understanding import ImageEncoder, layout, preprocess
    from omni_hunyuan.vae import decode_latents

    config = HunyuanConfig.from_pretrained(instruct)
    defaults = generation_defaults(instruct)
    encoder = ImageEncoder.from_pretrained(instruct)
    conds = [preprocess(photo, config, len(tokens.ratios), stretch=stretch) for photo in photos]
    generator = torch.Generator().manual_seed(seed)
    h, w = size[1] // config.vae_downsample, size[0] // config.vae_downsample
    with torch.no_grad():
        cond = layout(cond_ids, conds, tokens, model.model.wte, encoder, generator)  # (draws the VAE latents)
        latents = torch.randn((1, config.latent_channels, h, w), generator=generator, dtype=torch.bfloat16).float()
        uncond = layout(uncond_ids, conds, tokens, model.model.wte, encoder, torch.Generator().manual_seed(seed))
        assert cond.spans == uncond.spans and torch.equal(cond.positions, uncond.positions)
        embeds = torch.cat([cond.embeds[None], uncond.embeds[None]])
        eoi = model.model.wte(torch.tensor(tokens.eoi))
        sigmas = flow_sigmas(steps, float(defaults["flow_shift"]))
        guidance = float(defaults["diff_guidance_scale"])
        for step in range(steps):
            t = sigmas[step][None] * 1000
            v_cond, v_uncond = _whole_sequence_velocity(model, embeds, cond.positions, cond.spans, latents, t, eoi).chunk(2)
            latents = latents + (v_uncond + guidance * (v_cond - v_uncond)) * (sigmas[step + 1] - sigmas[step])
    return decode_latents(decoder, latents, config.vae)[0].numpy()


def test_an_edit_equals_the_release_sequence_run_whole(runtime: Any, instruct: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any, run_dit: Any) -> None:
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.resolution import ratio_sizes

    config = HunyuanConfig.from_pretrained(instruct)
    photo, seed, steps = _photo(1), 11, 2
    image = run_dit(runtime, {"edit": ({"prompt": PROMPT, "images": [photo]}, {"seed": seed, "num_inference_steps": steps, "size": (64, 64)})})["edit"]["image"]

    ratio = ratio_sizes(config.image_base_size, len(tokens.ratios)).index((64, 64))

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt = enc(PROMPT)
    head = [tokens.bos, *enc("User: "), tokens.image]  # the block replaces <img>
    tail = [*enc("\n\n"), *enc("Assistant: "), tokens.answer, tokens.boi, tokens.size, tokens.ratios[ratio]]
    cond_ids = head + prompt + tail
    uncond_ids = head + [tokens.cfg] * len(prompt) + tail  # the prompt blanked; the scaffolding and the image kept
    expected = _reference(instruct, model, decoder, tokens, cond_ids, uncond_ids, [photo], seed, steps, (64, 64))
    assert image.shape == expected.shape == (64, 64, 3)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1


def test_the_input_image_and_its_place_matter(runtime: Any, run_dit: Any) -> None:
    """Another input image, or none (t2i in the instruct template), draws another image; the same
    request twice draws the same; the model picks a ratio when no size is given."""
    params = {"seed": 3, "num_inference_steps": 2, "size": (64, 64)}
    finals = run_dit(runtime, {
        "a": ({"prompt": PROMPT, "images": [_photo(1)]}, params),
        "a again": ({"prompt": PROMPT, "images": [_photo(1)]}, params),
        "b": ({"prompt": PROMPT, "images": [_photo(2)]}, params),
        "none": ({"prompt": PROMPT}, params),
        "two": ({"prompt": PROMPT, "images": [_photo(1), _photo(2, (64, 96))]}, params),
        "auto": ({"prompt": PROMPT, "images": [_photo(1)]}, {"seed": 3, "num_inference_steps": 2}),
    })
    images = {name: data["image"].astype(int) for name, data in finals.items()}
    # (requests with prefixes of other lengths share a forward: float rounding, at most one 8-bit level)
    assert np.abs(images["a"] - images["a again"]).max() <= 1
    for other in ("b", "none", "two"):
        assert np.abs(images["a"] - images[other]).max() > 8, other
    assert images["auto"].ndim == 3 and images["auto"].shape[2] == 3
    # usage: the input image's block counts among the prompt's tokens
    assert len(finals["a"]["prompt_token_ids"]) > len(finals["none"]["prompt_token_ids"]) + 64 // 16 * 96 // 16


def test_align_image_size_stretches_the_input_and_resizes_the_output(runtime: Any, instruct: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any, run_dit: Any) -> None:
    """The release's ``infer_align_image_size``: the input image's VAE branch stretched to its bucket
    (not cropped), and the image drawn at that bucket resized (Lanczos) to the input's aspect ratio at
    about base^2 pixels: a 96x64 photo (bucket 80x48, 0.07 off its ratio) gives a 78x52 image; a
    square photo's bucket matches it, so nothing is resized."""
    from PIL import Image

    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.resolution import ratio_sizes

    config = HunyuanConfig.from_pretrained(instruct)
    photo, seed, size = _photo(1), 11, (80, 48)
    params = {"seed": seed, "num_inference_steps": 2, "size": size}
    finals = run_dit(runtime, {
        "aligned": ({"prompt": PROMPT, "images": [photo]}, {**params, "align_image_size": True}),
        "plain": ({"prompt": PROMPT, "images": [photo]}, params),
        "square": ({"prompt": PROMPT, "images": [_photo(2, (64, 64))]}, {**params, "size": (64, 64), "align_image_size": True}),
    })
    assert finals["aligned"]["image"].shape == (52, 78, 3) and finals["plain"]["image"].shape == (48, 80, 3)
    assert finals["square"]["image"].shape == (64, 64, 3)

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ratio = ratio_sizes(config.image_base_size, len(tokens.ratios)).index(size)
    head, prompt = [tokens.bos, *enc("User: "), tokens.image], enc(PROMPT)
    tail = [*enc("\n\n"), *enc("Assistant: "), tokens.answer, tokens.boi, tokens.size, tokens.ratios[ratio]]
    args = (instruct, model, decoder, tokens, head + prompt + tail, head + [tokens.cfg] * len(prompt) + tail, [photo], seed, 2, size)
    stretched = _reference(*args, stretch=True)
    expected = np.asarray(Image.fromarray(stretched).resize((78, 52), Image.Resampling.LANCZOS))
    assert np.abs(finals["aligned"]["image"].astype(int) - expected.astype(int)).max() <= 1
    cropped = _reference(*args)
    assert np.abs(finals["plain"]["image"].astype(int) - cropped.astype(int)).max() <= 1
    assert np.abs(stretched.astype(int) - cropped.astype(int)).max() > 8  # (the two preprocessings differ)


def test_instruct_t2i_rows_blank_only_the_prompt(runtime: Any, instruct: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any, run_dit: Any) -> None:
    """t2i on an Instruct checkpoint: the release's chat template, its uncond row keeping the scaffolding."""
    from omni_hunyuan.config import HunyuanConfig, generation_defaults
    from omni_hunyuan.prompt import image_rows
    from omni_hunyuan.resolution import ratio_sizes
    from omni_hunyuan.sampler import initial_noise, sample_t2i
    from omni_hunyuan.vae import decode_latents

    config = HunyuanConfig.from_pretrained(instruct)
    defaults = generation_defaults(instruct)
    image = run_dit(runtime, {"t2i": ({"prompt": PROMPT, "system": "Be vivid."}, {"seed": 4, "num_inference_steps": 2, "size": (64, 64)})})["t2i"]["image"]

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    system, prompt = [tokens.bos, *enc("Be vivid."), *enc("\n\n"), *enc("User: ")], enc(PROMPT)
    tail = [*enc("\n\n"), *enc("Assistant: "), tokens.answer]
    blank = [False] * len(system) + [True] * len(prompt) + [False] * len(tail)
    ratio = ratio_sizes(config.image_base_size, len(tokens.ratios)).index((64, 64))
    rows = image_rows(tokens, system + prompt + tail, ratio, 4, 4, cfg=True, blank=blank)
    assert rows.prefix[1].tolist() == [*system, *[tokens.cfg] * len(prompt), *tail, tokens.boi, tokens.size, tokens.ratios[ratio]]
    latents = sample_t2i(model, rows.prefix, initial_noise(4, config.latent_channels, 4, 4), 2, float(defaults["diff_guidance_scale"]), float(defaults["flow_shift"]))
    expected = decode_latents(decoder, latents, config.vae)[0].numpy()
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1


def test_edits_are_refused_where_they_cannot_run(checkpoint: Path, runtime: Any, inline_dit: Any) -> None:
    """A base (``pretrain``) checkpoint has no template for an input image; ``<img>`` typed in a prompt
    would be taken for an image's place."""
    base = inline_dit(checkpoint)
    try:
        with pytest.raises(InvalidRequestError, match="Instruct checkpoint"):
            base.add_request("x", StageInput(data={"prompt": PROMPT, "images": [_photo(1)]}, params={"seed": 1}))
    finally:
        base.close()
    with pytest.raises(InvalidRequestError, match="<img>"):
        runtime.add_request("y", StageInput(data={"prompt": "put <img> here", "images": [_photo(1)]}, params={"seed": 1}))


def test_the_input_processor_routes_images_by_modality(instruct: Path) -> None:
    """``modalities: ["image"]`` with an image in the message edits it (it2i, the dit alone); with
    ``["text"]`` it is read (i2t); with both the ar stage reasons over it first, and the dit gets it too."""
    from omni_hunyuan.pipeline import HunyuanInputProcessor

    from omni_core.parts import PartContext

    url = _data_url(_photo(1))
    messages = [
        {"role": "system", "content": "Be vivid."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]},
    ]
    processor = HunyuanInputProcessor(PartContext(resolve(str(instruct))))
    processor.load()
    edit = processor.process(OmniRequest(messages=messages, task="t2i", params={}, extra={"seed": 2}))
    assert list(edit) == ["dit"]
    data = edit["dit"].data
    assert data["prompt"] == PROMPT and data["system"] == "Be vivid." and len(data["images"]) == 1 and data["seed"] == 2
    read = processor.process(OmniRequest(messages=messages, task="i2t", params={}))
    assert list(read) == ["ar"] and len(read["ar"].data["images"]) == 1
    think = processor.process(OmniRequest(messages=messages, task="think_t2i", params={}))
    assert len(think["ar"].data["images"]) == 1 and len(think["dit"].params["edit_images"]) == 1
    assert "prefix_kv" not in think["ar"].params  # (the image pass draws the images' latents anew)
    with pytest.raises(InvalidRequestError, match="needs an image"):
        processor.process(OmniRequest(prompt=PROMPT, task="it2i", params={}))
    # align_image_size: vLLM's mm_processor_kwargs reach both stages (the ar stage's vLLM processor too)
    aligned = processor.process(OmniRequest(messages=messages, task="think_t2i", params={}, extra={"mm_processor_kwargs": {"align_image_size": True}}))
    assert aligned["ar"].data["mm_processor_kwargs"] == {"align_image_size": True} and aligned["dit"].params["align_image_size"] is True
    assert processor.process(OmniRequest(messages=messages, task="t2i", params={"dit": {"align_image_size": True}}))["dit"].data["align_image_size"]
    for kwargs, match in (({"do_resize": False}, "takes only 'align_image_size'"), ({"align_image_size": "yes"}, "must be true or false")):
        with pytest.raises(InvalidRequestError, match=match):
            processor.process(OmniRequest(messages=messages, task="i2t", params={}, extra={"mm_processor_kwargs": kwargs}))


@pytest.fixture(scope="module")
def omni(instruct: Path, inline_omni: Any) -> Any:
    with inline_omni(instruct) as engine:
        yield engine


@pytest.mark.vllm
def test_reasoning_over_an_image_then_editing_it(omni: Any, instruct: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any) -> None:
    """An Instruct checkpoint's default (``text`` + ``image``) with an image in the message: the ar
    stage (vLLM) thinks with the image's block in its prompt, then its ratio step; the dit draws after
    the prompt, image and reasoning at that ratio, equal to the release's whole sequences (the uncond
    row blanking the prompt and the reasoning, keeping the image and the tags)."""
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.prompt import instruct_prompt_ids
    from omni_hunyuan.resolution import drawable, ratio_sizes
    from omni_hunyuan.understanding import ImageEncoder, layout, preprocess

    photo = _photo(5)
    messages = [{"role": "user", "content": [{"type": "image", "image": photo}, {"type": "text", "text": PROMPT}]}]
    request = OmniRequest(messages=messages, params={"ar": {"max_tokens": 4}, "dit": {"num_inference_steps": 2}}, extra={"seed": 6})
    result = omni.generate(request)[0]
    assert request.task == "think_t2i" and len(result.images) == 1 and result.text is not None
    # One copy of the weights: the dit stage encodes the input image with the ar stage's encoder.
    groups = omni._omni.engine.groups
    text_model = groups["ar"].replicas[0].worker.runtime.engine.collective_rpc(lambda worker: worker.model_runner.get_model())[0]
    assert groups["dit"].replicas[0].worker.runtime.model._image_encoder is text_model.encoder

    config = HunyuanConfig.from_pretrained(instruct)
    encoder = ImageEncoder.from_pretrained(instruct)
    prompt_ids = instruct_prompt_ids(tokenizer, tokens, PROMPT, "think", images=1)
    laid = layout(prompt_ids, [preprocess(photo, config, len(tokens.ratios))], tokens, model.model.wte, encoder)
    assert result.prompt_token_ids == laid.ids
    # The reasoning: greedy over that layout (ratio tokens end the ratio step only), closed at the budget.
    allowed = drawable(config.image_base_size, len(tokens.ratios), config.vae_downsample)
    generated: list[int] = []
    with torch.no_grad():
        logits, cache = model.prompt_forward(laid.embeds[None], laid.positions[None], laid.spans)
        while len(generated) < 4 and tokens.end_think not in generated:
            row = logits[0, -1].clone()
            row[[tokens.ratios[i] for i in allowed]] = float("-inf")
            generated.append(int(row.argmax()))
            logits, cache = model.text_forward(torch.tensor([generated[-1:]]), cache)
    reasoning = [t for t in generated if t != tokens.end_think]
    assert result.token_ids[: len(reasoning) + 4] == [*reasoning, tokens.end_think, tokens.answer, tokens.boi, tokens.size]
    ratio = tokens.ratios.index(result.token_ids[-1])
    size = ratio_sizes(config.image_base_size, len(tokens.ratios))[ratio]

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    head, prompt = [tokens.bos, *enc("User: "), tokens.image], enc(PROMPT)
    middle = [*enc("\n\n"), *enc("Assistant: "), tokens.think]
    tail = [tokens.end_think, tokens.answer, tokens.boi, tokens.size, tokens.ratios[ratio]]
    cond_ids = head + prompt + middle + reasoning + tail
    uncond_ids = head + [tokens.cfg] * len(prompt) + middle + [tokens.cfg] * len(reasoning) + tail
    expected = _reference(instruct, model, decoder, tokens, cond_ids, uncond_ids, [photo], 6, 2, size)
    image = np.asarray(result.images[0])
    assert image.shape == expected.shape == (size[1], size[0], 3)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1


@pytest.mark.vllm
def test_the_ar_stage_reads_images_aligned_when_asked(omni: Any, instruct: Path, model: Any, tokenizer: Any, tokens: Any) -> None:
    """``mm_processor_kwargs: {"align_image_size": true}`` reaches the ar stage's vLLM processor: its
    greedy answer about an image equals our torch greedy over the stretched block, and differs from
    the one over the cropped block (the default)."""
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.understanding import ImageEncoder, i2t_prompt_ids, layout, preprocess

    config = HunyuanConfig.from_pretrained(instruct)
    encoder = ImageEncoder.from_pretrained(instruct)
    photo = _photo(0)
    ids = i2t_prompt_ids(tokenizer, tokens, "What is in the image?", 1)
    messages = [{"role": "user", "content": [{"type": "image", "image": photo}, {"type": "text", "text": "What is in the image?"}]}]
    expected = {}
    for stretch in (False, True):
        laid = layout(ids, [preprocess(photo, config, len(tokens.ratios), stretch=stretch)], tokens, model.model.wte, encoder)
        expected[stretch] = model.greedy(torch.tensor([laid.ids]), 6, prompt=(laid.embeds[None], laid.positions[None], laid.spans))
    assert expected[True] != expected[False]
    for stretch in (False, True):
        extra = {"mm_processor_kwargs": {"align_image_size": True}} if stretch else {}
        result = omni.generate(OmniRequest(messages=messages, task="i2t", params={"ar": {"max_tokens": 6}}, extra=extra))[0]
        assert list(result.token_ids) == expected[stretch], stretch


def test_image_requests_get_the_checkpoints_system_prompt(instruct: Path, tmp_path: Path) -> None:
    """generation_config's ``use_system_prompt`` names a text in the checkpoint's ``system_prompt.py``
    (read, never run: the file's own code would exit); ``dynamic`` picks one per task; a request's
    system message wins; text tasks get none; under ``drop_think`` the image pass after
    think-and-recaption takes the recaption text, as the release swaps it."""
    from omni_hunyuan.pipeline import HunyuanInputProcessor

    from omni_core.parts import PartContext

    for item in instruct.iterdir():
        if item.name != "generation_config.json":
            (tmp_path / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
    config = json.loads((instruct / "generation_config.json").read_text())
    (tmp_path / "system_prompt.py").write_text(
        'raise SystemExit("never run")\n'
        't2i_system_prompt_en_vanilla = """\nDraw well.\n"""\n'
        't2i_system_prompt_en_think_recaption = """\nThink, then draw.\n"""\n'
    )

    def processor(kind: str) -> HunyuanInputProcessor:
        (tmp_path / "generation_config.json").write_text(json.dumps({**config, "use_system_prompt": kind}))
        part = HunyuanInputProcessor(PartContext(resolve(str(tmp_path))))
        part.load()
        return part

    dynamic = processor("dynamic")
    assert dynamic.process(OmniRequest(prompt=PROMPT, task="t2i", params={}))["dit"].data["system"] == "Draw well."
    think = dynamic.process(OmniRequest(prompt=PROMPT, task="think_t2i", params={}))
    assert think["ar"].data["system"] == "Think, then draw."
    blank = think["dit"].params["reasoning_prompt"]["blank"]
    assert len(blank) > len(dynamic.tokenizer.encode("Think, then draw.", add_special_tokens=False)) and not any(blank[:4])
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": PROMPT}]
    assert dynamic.process(OmniRequest(messages=own, task="t2i", params={}))["dit"].data["system"] == "Mine."
    assert "system" not in dynamic.process(OmniRequest(prompt=PROMPT, task="t2t", params={}))["ar"].data
    # (the recaption text is not in the file: logged, and none used)
    assert dynamic.process(OmniRequest(prompt=PROMPT, task="recaption_t2i", params={}))["ar"].data["system"] is None
    assert processor("None").process(OmniRequest(prompt=PROMPT, task="t2i", params={}))["dit"].data["system"] is None
    # drop_think: after think-and-recaption the image pass's system text is the checkpoint's recaption one,
    # unstripped (the release swaps it in after its one strip: its newlines stay)
    (tmp_path / "system_prompt.py").write_text('t2i_system_prompt_en_recaption = """\nRecaption, then draw.\n"""\nunified_system_prompt_en = "All."\n')
    config = {**config, "drop_think": True}
    dropping = processor("en_unified")
    both = dropping.process(OmniRequest(prompt=PROMPT, task="think_recaption_t2i", params={}))
    assert both["ar"].data["system"] == "All."
    encode = functools.partial(dropping.tokenizer.encode, add_special_tokens=False)
    recaption = encode("\nRecaption, then draw.\n") + encode("\n\n")
    assert both["dit"].params["reasoning_prompt"]["ids"][1 : 1 + len(recaption)] == recaption
    think = dropping.process(OmniRequest(prompt=PROMPT, task="think_t2i", params={}))  # (think alone: the system text stays)
    unified = dropping.tokenizer.encode("All.", add_special_tokens=False)
    assert think["dit"].params["reasoning_prompt"]["ids"][1 : 1 + len(unified)] == unified


def test_images_are_refused_where_the_checkpoint_asks_for_another_block(instruct: Path, tmp_path: Path) -> None:
    """config.json's ``cond_token_attn_type`` other than ``joint_full`` (or absent: the release's code then
    takes ``full``, two separate two-way spans) is a layout we do not build: a request with an image gets a
    400 naming both, before any model work; text requests still run."""
    from PIL import Image

    from omni_hunyuan.pipeline import HunyuanInputProcessor

    from omni_core.parts import PartContext

    for item in instruct.iterdir():
        if item.name != "config.json":
            (tmp_path / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
    config = json.loads((instruct / "config.json").read_text())
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(Image.new("RGB", (32, 32)))}}, {"type": "text", "text": PROMPT}]}]
    for kinds in ({"cond_token_attn_type": "full"}, {"cond_token_attn_type": None}):
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in {**config, **kinds}.items() if v is not None}))
        part = HunyuanInputProcessor(PartContext(resolve(str(tmp_path))))
        part.load()
        for task in ("i2t", "it2i"):
            with pytest.raises(InvalidRequestError, match="cond_token_attn_type 'full'.*'joint_full'"):
                part.process(OmniRequest(messages=image, task=task, params={}))
        assert part.process(OmniRequest(prompt=PROMPT, task="t2t", params={}))["ar"].data == {"prompt": PROMPT}


def test_images_edits_and_chat_over_http(instruct: Path, runtime: Any, run_dit: Any) -> None:
    """``/v1/images/edits`` as OpenAI's client sends it (the image a file upload) and a chat request
    with the image and ``modalities: ["image"]``: the dit stage's edit of that image, as run directly."""
    import base64
    import io

    import openai
    from PIL import Image

    from omni_core.testing.live_server import LiveServer

    photo = _photo(7)
    buffer = io.BytesIO()
    photo.save(buffer, format="PNG")
    params = {"seed": 9, "num_inference_steps": 2}
    expected = run_dit(runtime, {"direct": ({"prompt": PROMPT, "images": [photo], "system": None}, {**params, "size": (64, 64)})})["direct"]["image"]
    live = LiveServer.start(str(instruct), args=["--set", "ar.options.max_model_len=256"])
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
        edited = client.images.edit(
            model=str(instruct), image=("photo.png", buffer.getvalue(), "image/png"), prompt=PROMPT, size="64x64",  # type: ignore[arg-type]
            extra_body={"stage_params": {"dit": params}},
        )
        assert edited.size == "64x64"
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json))))
        assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
        url = _data_url(photo)
        answer = client.chat.completions.create(
            model=str(instruct), modalities=["image"],  # type: ignore[arg-type]
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}],
            extra_body={"stage_params": {"dit": {**params, "size": [64, 64]}}},
        )
        part = answer.choices[0].message.content[-1]  # type: ignore[index]
        chat_image = np.asarray(Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))))
        assert np.abs(chat_image.astype(int) - expected.astype(int)).max() <= 1
        with pytest.raises(openai.BadRequestError, match="mask"):
            client.images.edit(model=str(instruct), image=("photo.png", buffer.getvalue(), "image/png"), mask=("m.png", buffer.getvalue(), "image/png"), prompt=PROMPT)  # type: ignore[arg-type]
    finally:
        live.close()


def test_omni_generate_edits_an_image_file(instruct: Path, runtime: Any, tmp_path: Path, run_dit: Any) -> None:
    """``omni generate MODEL --image F --prompt P --modalities image``: the edit, as a PNG, equal to the
    dit stage's edit of that file run directly."""
    from click.testing import CliRunner
    from PIL import Image

    from omni_cli.main import cli

    photo = tmp_path / "photo"  # (no extension: read by its bytes)
    _photo(8).save(photo, format="PNG")
    params = {"seed": 4, "num_inference_steps": 2, "size": [64, 64]}
    expected = run_dit(runtime, {"direct": ({"prompt": PROMPT, "images": [Image.open(photo)], "system": None}, params)})["direct"]["image"]
    inline = ["--set", "ar.placement=inline", "--set", "dit.placement=inline", "--set", "ar.options.max_model_len=256"]
    args = ["generate", str(instruct), "--image", str(photo), "--prompt", PROMPT, "--modalities", "image", "--out", str(tmp_path / "out"), "--json"]
    result = CliRunner().invoke(cli, [*args, "--stage-params", json.dumps({"dit": params}), *inline])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout[result.stdout.index("{") :])
    image = np.asarray(Image.open(body["images"][0]["path"]))
    assert image.shape == expected.shape == (64, 64, 3) and np.abs(image.astype(int) - expected.astype(int)).max() <= 1
