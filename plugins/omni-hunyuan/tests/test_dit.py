"""The `dit` stage on the core diffusion runtime: what the stand-alone sampler (checked against
nemo-automodel in test_image.py) gives, for one request and for requests batched at different steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omni_hunyuan.config import HunyuanConfig, generation_defaults
from omni_hunyuan.prompt import t2i_rows
from omni_hunyuan.resolution import ratio_sizes
from omni_hunyuan.sampler import initial_noise, sample_t2i
from omni_hunyuan.vae import decode_latents

from omni_core.config import resolve
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.stages.diffusion import DiffusionStageRuntime


@pytest.fixture(scope="module")
def runtime(checkpoint: Path, inline_dit: Any) -> Any:
    runtime = inline_dit(checkpoint)
    yield runtime
    runtime.close()


def _finals(runtime: Any, requests: dict[str, tuple[str, dict[str, Any]]], stagger: bool = False) -> dict[str, dict[str, Any]]:
    """Run requests to completion, their final chunks' data; with `stagger` the second joins after
    the first's first step."""
    finals: dict[str, dict[str, Any]] = {}
    items = list(requests.items())
    runtime.add_request(items[0][0], StageInput(data={"prompt": items[0][1][0]}, params=items[0][1][1]))
    if stagger:
        for chunk in runtime.step():
            if chunk.final:
                finals[chunk.request_id] = chunk.data
    for request_id, (prompt, params) in items[1:]:
        runtime.add_request(request_id, StageInput(data={"prompt": prompt}, params=params))
    while runtime.has_unfinished():
        for chunk in runtime.step():
            if chunk.final:
                finals[chunk.request_id] = chunk.data
    return finals


def _run(runtime: Any, requests: dict[str, tuple[str, dict[str, Any]]], stagger: bool = False) -> dict[str, np.ndarray]:
    return {name: data["image"] for name, data in _finals(runtime, requests, stagger).items()}


def _reference(checkpoint: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any, prompt: str, seed: int, steps: int) -> np.ndarray:
    config = HunyuanConfig.from_pretrained(checkpoint)
    defaults = generation_defaults(checkpoint)
    side = config.image_base_size // config.vae_downsample
    square = ratio_sizes(config.image_base_size, len(tokens.ratios)).index((config.image_base_size,) * 2)
    rows = t2i_rows(tokenizer, tokens, prompt, square, side, side, cfg=True)
    latents = sample_t2i(
        model, rows.prefix, initial_noise(seed, config.latent_channels, side, side), steps,
        float(defaults["diff_guidance_scale"]), float(defaults["flow_shift"]),
    )
    return decode_latents(decoder, latents, config.vae)[0].numpy()


def test_one_request_equals_the_sampler(runtime: Any, checkpoint: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any) -> None:
    images = _run(runtime, {"a": ("A red apple on a wooden table", {"seed": 42, "num_inference_steps": 2, "size": (64, 64)})})
    expected = _reference(checkpoint, model, decoder, tokenizer, tokens, "A red apple on a wooden table", 42, 2)
    assert images["a"].shape == expected.shape == (64, 64, 3)
    np.testing.assert_array_equal(images["a"], expected)


def test_requests_at_different_steps_with_different_prompt_lengths_share_forwards(
    runtime: Any, checkpoint: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any
) -> None:
    prompts = {"long": "Draw a lighthouse at night with waves crashing against the rocks", "short": "A cat"}
    images = _run(
        runtime,
        {name: (prompt, {"seed": 7, "num_inference_steps": 3, "size": (64, 64)}) for name, prompt in prompts.items()},
        stagger=True,
    )
    for name, prompt in prompts.items():
        expected = _reference(checkpoint, model, decoder, tokenizer, tokens, prompt, 7, 3)
        assert np.abs(images[name].astype(int) - expected.astype(int)).max() <= 1, name
    assert not np.array_equal(images["long"], images["short"])


def test_compiled_stage_equals_eager(checkpoint: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any) -> None:
    """``compile: true`` (the layers' pieces around attention and the experts under torch.compile)
    draws the sampler's images, with first-block caching on one row and the batch growing mid-run
    (a new shape compiles)."""
    import attrs
    from omni_hunyuan.layers import EAGER

    pipeline = resolve(str(checkpoint), overrides=("dit.placement=inline", "dit.share_model_with=", "dit.compile=true"))
    stage = pipeline.stage("dit")
    runtime = DiffusionStageRuntime(pipeline, attrs.evolve(stage, options={**stage.options, "admission_window_ms": 0.0}))
    runtime.load()
    try:
        assert runtime.model.transformer.kernels != EAGER
        prompts = {"long": "Draw a lighthouse at night with waves crashing against the rocks", "short": "A cat"}
        params = {"seed": 7, "num_inference_steps": 3, "size": (64, 64)}
        finals = _finals(
            runtime,
            {"long": (prompts["long"], params), "short": (prompts["short"], {**params, "cache": {"mode": "first_block", "threshold": 0.0}})},
            stagger=True,
        )
    finally:
        runtime.close()
    for name, prompt in prompts.items():
        expected = _reference(checkpoint, model, decoder, tokenizer, tokens, prompt, 7, 3)
        assert np.abs(finals[name]["image"].astype(int) - expected.astype(int)).max() <= 1, name
    assert finals["short"]["cache"] == {"computed_steps": 3, "skipped_steps": 0}


def test_n_images_of_one_prompt_are_those_of_seeds_seed_to_seed_plus_n(
    runtime: Any, checkpoint: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any
) -> None:
    """``n``: one request, `n` images (its text prefix encoded once), the i-th the sampler's at
    ``seed + i``; a bad ``n`` or seed is refused before any work."""
    prompt = "A red apple on a wooden table"
    finals = _finals(runtime, {"three": (prompt, {"seed": 11, "n": 3, "num_inference_steps": 2, "size": (64, 64)})})
    images = finals["three"]["image"]
    assert isinstance(images, list) and len(images) == 3
    for index, image in enumerate(images):
        expected = _reference(checkpoint, model, decoder, tokenizer, tokens, prompt, 11 + index, 2)
        assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1, index
    assert not np.array_equal(images[0], images[1])
    refused = (
        ({"n": 0}, "n must be"), ({"n": 9}, "n must be"), ({"seed": -1}, "seed must be"),
        ({"num_inference_steps": 2.5}, "num_inference_steps must be an integer"),
        ({"guidance_scale": "high"}, "guidance_scale must be a finite number"),
    )
    for bad, match in refused:
        with pytest.raises(InvalidRequestError, match=match):
            runtime.add_request("bad", StageInput(data={"prompt": prompt}, params={"num_inference_steps": 2, **bad}))
    assert not runtime.has_unfinished()


def test_a_sample_counts_the_positions_its_forward_carries(runtime: Any) -> None:
    """`DiffusionSample.tokens` (what the stage's ``max_batch_tokens`` adds up) is what the layers run
    for the sample each step: every CFG branch's ``<timestep>`` and image tokens (the prefix is cached)."""
    part = runtime.model
    layer = part.transformer.model.layers[0]
    for params in ({"guidance_scale": 5.0, "size": (64, 64), "n": 2}, {"guidance_scale": 1.0}):
        samples = part.prepare("count", {"prompt": "A red apple on a wooden table"}, {"num_inference_steps": 2, "seed": 1, **params})
        part.start(samples)
        seen: list[int] = []
        handle = layer.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0] * args[0].shape[1]))
        try:
            part.denoise(samples)
        finally:
            handle.remove()
        assert seen == [sum(sample.tokens for sample in samples)], params


def test_first_block_caching_skips_steps_per_request_and_threshold_zero_changes_nothing(
    runtime: Any, checkpoint: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any
) -> None:
    """The core's ``cache`` parameter: threshold 0 computes every step (the exact image); a loose
    threshold skips steps and stays near the exact image; a request without it, denoised in the same
    forwards, is untouched."""
    prompt = "A red apple on a wooden table"
    base = {"seed": 5, "num_inference_steps": 8, "size": (64, 64)}
    finals = _finals(
        runtime,
        {
            "exact": (prompt, base),
            "zero": (prompt, {**base, "cache": {"mode": "first_block", "threshold": 0.0}}),
            "loose": (prompt, {**base, "cache": {"mode": "first_block", "threshold": 1.0, "warmup_steps": 1}}),
        },
    )
    expected = _reference(checkpoint, model, decoder, tokenizer, tokens, prompt, 5, 8)
    assert np.abs(finals["exact"]["image"].astype(int) - expected.astype(int)).max() <= 1
    assert "cache" not in finals["exact"]
    assert finals["zero"]["cache"] == {"computed_steps": 8, "skipped_steps": 0}
    # Every step computed, as without the cache. (The two are different rows of one batched forward,
    # which some CPUs' matmul kernels round differently: bit-equal on one machine, a level at one
    # pixel of 12288 on another.)
    levels = np.abs(finals["zero"]["image"].astype(int) - finals["exact"]["image"].astype(int))
    assert levels.max() <= 1 and (levels > 0).mean() < 1e-3, (levels.max(), (levels > 0).sum())
    loose = finals["loose"]
    assert loose["cache"]["skipped_steps"] > 0 and loose["cache"]["computed_steps"] + loose["cache"]["skipped_steps"] == 8
    error = np.mean((loose["image"].astype(float) - finals["exact"]["image"].astype(float)) ** 2)
    psnr = 10 * np.log10(255.0**2 / max(error, 1e-12))
    assert 20.0 <= psnr < 100.0, psnr  # skipping changed the image, not into another (tiny random weights: ~27 dB)
    with pytest.raises(Exception, match="cache"):
        runtime.add_request("bad", StageInput(data={"prompt": prompt}, params={**base, "cache": {"mode": "sometimes"}}))


def test_the_resolution_table() -> None:
    """The release's 33 ratios at image_base_size 1024 (and the Instruct four after them)."""
    sizes = ratio_sizes(1024, 37)
    assert len(sizes) == 37 and len(set(sizes)) == 37
    assert sizes[16] == (1024, 1024) and sizes[0] == (2048, 512) and sizes[32] == (512, 2048)
    assert sizes[8] == (1536, 512) and sizes[17] == (960, 1088)  # width x height
    assert sizes[33:] == ((768, 1024), (720, 1280), (1024, 768), (1280, 720))
    heights_over_widths = [h / w for w, h in sizes[:33]]
    assert heights_over_widths == sorted(heights_over_widths)


def test_without_a_size_the_model_picks_the_ratio_transformers_ranks_first(
    runtime: Any, checkpoint: Path, tokenizer: Any, tokens: Any
) -> None:
    """The ratio step: `HunYuanMoEV1ForCausalLM` (remapped weights) logits after
    ``<bos> prompt <boi> <img_size>``, limited to the ratio tokens of drawable sizes, pick the size."""
    import torch
    from omni_hunyuan.reference import hunyuan_v1_model
    from omni_hunyuan.resolution import drawable

    reference = hunyuan_v1_model(checkpoint)
    config = HunyuanConfig.from_pretrained(checkpoint)
    allowed = drawable(config.image_base_size, len(tokens.ratios), config.vae_downsample)
    prompts = {f"p{i}": p for i, p in enumerate(("A cat", "Draw a lighthouse at night", "A tall tree", "Wide sea, sunset"))}
    images = _run(runtime, {name: (prompt, {"seed": 1, "num_inference_steps": 1}) for name, prompt in prompts.items()})
    for name, prompt in prompts.items():
        ids = torch.tensor([[tokens.bos, *tokenizer.encode(prompt, add_special_tokens=False), tokens.boi, tokens.size]])
        with torch.no_grad():
            logits = reference(ids).logits[0, -1]
        pick = allowed[int(logits[[tokens.ratios[i] for i in allowed]].argmax())]
        width, height = ratio_sizes(config.image_base_size, len(tokens.ratios))[pick]
        assert images[name].shape == (height, width, 3), (name, pick)


def _loaded(checkpoint: Path, *overrides: str) -> Any:
    import attrs

    pipeline = resolve(str(checkpoint), overrides=("dit.placement=inline", "dit.share_model_with=", *overrides))
    stage = pipeline.stage("dit")
    runtime = DiffusionStageRuntime(pipeline, attrs.evolve(stage, options={**stage.options, "admission_window_ms": 0.0}))
    runtime.load()
    return runtime


def test_quantization_swaps_the_layers_linears_and_fp8_needs_a_gpu(runtime: Any, checkpoint: Path) -> None:
    """``quantization: int8`` on the dit: the decoder layers' linears become the core's int8 ones (the
    fp32 router stays), and the image stays close to the unquantized one; ``fp8`` on CPU is a
    ConfigError naming the option (no FP8 kernels here)."""
    import torch
    from omni_core.errors import ConfigError

    quantized = _loaded(checkpoint, "dit.dtype=float32", "dit.quantization=int8")
    try:
        layer = quantized.model.transformer.model.layers[0]
        assert type(layer.self_attn.qkv_proj).__name__ == type(layer.self_attn.o_proj).__name__ == "Int8WeightOnlyLinear"
        assert type(layer.mlp.gate.wg) is torch.nn.Linear and layer.mlp.gate.wg.weight.dtype == torch.float32
        params = {"seed": 3, "num_inference_steps": 2, "size": (64, 64)}
        got = _run(quantized, {"q": ("A red apple on a table", params)})["q"]
    finally:
        quantized.close()
    want = _run(runtime, {"full": ("A red apple on a table", params)})["full"]
    error = np.abs(got.astype(float) - want.astype(float))
    print(f"int8 dit vs fp32: mean abs {error.mean():.2f}, max {error.max():.0f} (8-bit)")
    assert 0 < error.mean() <= 2.0
    with pytest.raises(ConfigError, match="fp8 linears need a CUDA GPU") as fp8:
        _loaded(checkpoint, "dit.dtype=float32", "dit.quantization=fp8")
    assert fp8.value.key == "quantization"


def test_quantization_is_refused_where_it_would_not_apply(checkpoint: Path) -> None:
    """Before anything loads: the ``ar`` stage's vLLM model class keeps plain torch modules (vLLM's
    quantization config would not reach them), and a ``dit`` on the ``ar`` stage's weights (the default
    deploy's ``share_model_with``) cannot quantize them; both name the key. The dit's CUDA graphs and
    VAE tiling (not implemented) are refused too."""
    from omni_core.errors import ConfigError

    with pytest.raises(ConfigError, match="does not implement quantization") as ar:
        resolve(str(checkpoint), overrides=("ar.quantization=fp8",))
    assert ar.value.key == "stages.ar.options.quantization"
    with pytest.raises(ConfigError, match="runs on stage 'ar''s weights, so it cannot quantize them") as shared:
        resolve(str(checkpoint), overrides=("dit.quantization=int8",))
    assert shared.value.key == "stages.dit.options.quantization"
    # (the way out it names is the one that works here: the host, ar, applies no quantization)
    assert "'ar''s model part does not apply quantization either: give 'dit' its own copy" in str(shared.value)
    assert resolve(str(checkpoint), overrides=("dit.quantization=int8", "dit.share_model_with=")).stage("dit").quantization
    for option in ("cuda_graphs", "vae_tiling"):  # not implemented by this dit: refused, not ignored
        with pytest.raises(ConfigError, match=f"does not implement {option}"):
            resolve(str(checkpoint), overrides=(f"dit.{option}=true",))
