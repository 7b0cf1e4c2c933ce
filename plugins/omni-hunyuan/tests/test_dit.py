"""The `dit` stage on the core diffusion runtime: what the stand-alone sampler (checked against
nemo-automodel in test_image.py) gives, for one request and for requests batched at different steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omni_hunyuan.config import HunyuanConfig, generation_defaults
from omni_hunyuan.dit import square_ratio_index
from omni_hunyuan.prompt import t2i_rows
from omni_hunyuan.sampler import initial_noise, sample_t2i
from omni_hunyuan.vae import decode_latents

from omni_core.config import resolve
from omni_core.outputs import StageInput
from omni_core.stages.diffusion import DiffusionStageRuntime


@pytest.fixture(scope="module")
def runtime(checkpoint: Path) -> Any:
    import attrs

    pipeline = resolve(str(checkpoint), overrides=("dit.placement=inline",))
    stage = pipeline.stage("dit")
    runtime = DiffusionStageRuntime(pipeline, attrs.evolve(stage, options={**stage.options, "admission_window_ms": 0.0}))
    runtime.load()
    yield runtime
    runtime.close()


def _run(runtime: Any, requests: dict[str, tuple[str, dict[str, Any]]], stagger: bool = False) -> dict[str, np.ndarray]:
    """Run requests to completion; with `stagger` the second joins after the first's first step."""
    images: dict[str, np.ndarray] = {}
    items = list(requests.items())
    runtime.add_request(items[0][0], StageInput(data={"prompt": items[0][1][0]}, params=items[0][1][1]))
    if stagger:
        for chunk in runtime.step():
            if chunk.final:
                images[chunk.request_id] = chunk.data["image"]
    for request_id, (prompt, params) in items[1:]:
        runtime.add_request(request_id, StageInput(data={"prompt": prompt}, params=params))
    while runtime.has_unfinished():
        for chunk in runtime.step():
            if chunk.final:
                images[chunk.request_id] = chunk.data["image"]
    return images


def _reference(checkpoint: Path, model: Any, vae: Any, tokenizer: Any, tokens: Any, prompt: str, seed: int, steps: int) -> np.ndarray:
    config = HunyuanConfig.from_pretrained(checkpoint)
    defaults = generation_defaults(checkpoint)
    side = config.image_base_size // config.vae_downsample
    rows = t2i_rows(tokenizer, tokens, prompt, square_ratio_index(), side, side, cfg=True)
    latents = sample_t2i(
        model, rows.prefix, initial_noise(seed, config.latent_channels, side, side), steps,
        float(defaults["diff_guidance_scale"]), float(defaults["flow_shift"]),
    )
    return decode_latents(vae, latents, config.vae)[0].numpy()


def test_one_request_equals_the_sampler(runtime: Any, checkpoint: Path, model: Any, vae: Any, tokenizer: Any, tokens: Any) -> None:
    images = _run(runtime, {"a": ("A red apple on a wooden table", {"seed": 42, "num_inference_steps": 2})})
    expected = _reference(checkpoint, model, vae, tokenizer, tokens, "A red apple on a wooden table", 42, 2)
    assert images["a"].shape == expected.shape == (64, 64, 3)
    np.testing.assert_array_equal(images["a"], expected)


def test_requests_at_different_steps_with_different_prompt_lengths_share_forwards(
    runtime: Any, checkpoint: Path, model: Any, vae: Any, tokenizer: Any, tokens: Any
) -> None:
    prompts = {"long": "Draw a lighthouse at night with waves crashing against the rocks", "short": "A cat"}
    images = _run(
        runtime,
        {name: (prompt, {"seed": 7, "num_inference_steps": 3}) for name, prompt in prompts.items()},
        stagger=True,
    )
    for name, prompt in prompts.items():
        expected = _reference(checkpoint, model, vae, tokenizer, tokens, prompt, 7, 3)
        assert np.abs(images[name].astype(int) - expected.astype(int)).max() <= 1, name
    assert not np.array_equal(images["long"], images["short"])
