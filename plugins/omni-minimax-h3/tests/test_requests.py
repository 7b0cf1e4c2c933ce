"""Validation before any model work: the rules diffusers enforces, each refusal naming the rule and the nearest valid value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_minimax_h3.reference import request, run_dit, stage_inputs
from omni_minimax_h3.requests import Geometry, parse_request


@pytest.fixture(scope="module")
def geometry(pipeline) -> Geometry:
    return Geometry.from_checkpoint(pipeline.model_path)


@pytest.mark.parametrize(("frames", "aligned"), [(1, 124), (120, 124), (123, 124), (124, 124), (125, 141), (330, 345), (345, 345)])
def test_frame_counts_snap_up_like_diffusers(geometry, frames: int, aligned: int) -> None:
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import align_num_frames

    assert geometry.align(frames) == align_num_frames(frames, 17, 5)
    if frames >= 120:  # at least 5 s once aligned
        assert parse_request({"num_frames": frames, "size": [32, 32]}, geometry).num_frames == aligned


def test_seconds_become_frames(geometry) -> None:
    assert parse_request({"seconds": 5, "size": [32, 32]}, geometry).num_frames == 124
    assert parse_request({"seconds": "10", "size": [32, 32]}, geometry).num_frames == 243  # 240 -> 17 * 14 + 5
    assert parse_request({"size": [32, 32]}, geometry).num_frames == 124  # the default: the shortest


@pytest.mark.parametrize(
    ("params", "param", "says"),
    [
        ({"num_frames": 346}, "num_frames", "rounded up to 362"),  # 14.4 s asked, 15.08 s once aligned
        ({"num_frames": 346}, "num_frames", "nearest valid: 345 frames"),
        ({"num_frames": 100}, "num_frames", "nearest valid: 124 frames"),
        ({"seconds": 16}, "seconds", "nearest valid: 345 frames"),
        ({"seconds": 2.5}, "seconds", "nearest valid: 124 frames"),
        ({"seconds": 5, "num_frames": 124}, "num_frames", "not both"),
        ({"size": [48, 32]}, "size", "multiples of 32"),
        ({"size": [48, 32]}, "size", "nearest valid: 64x32"),
        ({"size": [33, 100]}, "size", "nearest valid: 32x96"),
        ({"size": [160, 32]}, "size", "nearest valid: 160x64"),  # 5:1
        ({"size": [32, 160]}, "size", "nearest valid: 64x160"),  # 1:5
        ({"size": "big"}, "size", "[width, height]"),
        # pixels x frames: at most the canvas area (tiny: 832x480) for the longest clip (345 frames)
        ({"size": [2048, 2048]}, "size", "at most 137,779,200 pixels x frames"),
        ({"size": [2048, 2048]}, "size", "nearest valid: 1024x1024 for 124 frames"),
        ({"size": [832, 832], "num_frames": 345}, "size", "or 832x832 for 192 frames (8.000 s)"),
        ({"num_inference_steps": 1}, "num_inference_steps", "between 2"),
        ({"num_inference_steps": 1.5}, "num_inference_steps", "integer"),
        ({"seed": -1}, "seed", "non-negative"),
    ],
)
def test_out_of_range_requests_name_the_rule_and_the_nearest_valid_value(geometry, params: dict, param: str, says: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request({"size": [32, 32], **params}, geometry)
    assert info.value.param == param and says in str(info.value), str(info.value)


def test_diffusers_rejects_what_we_reject(reference) -> None:
    """The same 346 frames and the same off-multiple size fail in the library too (so the 400 is not ours alone)."""
    with pytest.raises(ValueError, match="rounded up to 362"):
        reference(prompt="x", num_frames=346, height=32, width=32, num_inference_steps=2, output="videos")
    with pytest.raises(ValueError, match="multiples of 32"):
        reference(prompt="x", num_frames=124, height=32, width=48, num_inference_steps=2, output="videos")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"size": (48, 32)}, "size"),
        ({"seconds": 30}, "seconds"),
        ({"image": "/etc/passwd"}, "image"),
        ({"last_image": "https://example.com/a.png"}, "last_image"),
        ({"image": np.zeros((4, 4), np.uint8)}, "image"),
        ({"image": "data:application/octet-stream;base64,aGVsbG8="}, "image"),  # ("hello": decoded, not an image)
        ({"voice": "Ethan"}, "voice"),
    ],
)
def test_the_input_processor_refuses_before_any_model_work(processor, extra: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        processor.process(request("a cat", **{"num_frames": None, **extra}))
    assert info.value.param == param


@pytest.mark.parametrize(("params", "param"), [({"cache": "sometimes"}, "cache"), ({"num_inference_steps": 1}, "num_inference_steps")])
def test_the_input_processor_refuses_bad_dit_parameters(processor, params: dict, param: str) -> None:
    item = request("a cat")
    item.params["dit"].update(params)
    with pytest.raises(InvalidRequestError) as info:
        processor.process(item)
    assert info.value.param == param


def test_the_dit_refuses_bad_parameters_before_work(dit, processor, encoder) -> None:
    item = stage_inputs(processor, encoder, {"bad": request("a cat")})["bad"]
    for params, param in (({"num_frames": 400}, "num_frames"), ({"temperature": 0.5}, "temperature"), ({"cache": "sometimes"}, "cache")):
        with pytest.raises(InvalidRequestError) as info:
            dit.add_request("bad", StageInput(data=item.data, params={**item.params, **params}))
        assert info.value.param == param
    assert not dit.has_unfinished()


def test_first_block_cache_skips_steps_and_stays_close(dit, processor, encoder) -> None:
    """``cache`` per request: threshold 0 never skips (exact); a loose one skips steps and stays close."""
    exact = run_dit(dit, stage_inputs(processor, encoder, {"off": request("a cat sleeps", seed=3, steps=8)}))["off"]
    zero_item = request("a cat sleeps", seed=3, steps=8)
    zero_item.params["dit"]["cache"] = 0.0
    zero = run_dit(dit, stage_inputs(processor, encoder, {"zero": zero_item}))["zero"]
    np.testing.assert_array_equal(zero["video"], exact["video"])
    loose_item = request("a cat sleeps", seed=3, steps=8)
    loose_item.params["dit"]["cache"] = {"mode": "first_block", "threshold": 0.5}
    loose = run_dit(dit, stage_inputs(processor, encoder, {"loose": loose_item}))["loose"]
    assert loose["cache"]["skipped_steps"] > 0
    mse = float(np.mean((loose["video"].astype(np.float64) - exact["video"].astype(np.float64)) ** 2))
    assert mse == 0 or 10 * np.log10(255.0**2 / mse) >= 25.0


def test_private_diffusers_names_still_behave() -> None:
    """`omni_minimax_h3.diffusers_private`: each wrapped private name exists and does what the plugin relies on."""
    from diffusers.models.transformers import transformer_minimax_h3

    from omni_minimax_h3 import diffusers_private

    assert hasattr(transformer_minimax_h3, "_apply_rotary_emb")
    x = torch.randn(1, 5, 2, 16)
    angles = torch.randn(5, 6)
    cos, sin = angles.cos(), angles.sin()
    rotated = diffusers_private.apply_rotary_emb(x, cos, sin)
    torch.testing.assert_close(rotated[..., 6:], x[..., 6:])  # channels past the rotary ones pass through
    first, second = x[..., :3], x[..., 3:6]
    c, s = cos[None, :, None], sin[None, :, None]
    torch.testing.assert_close(rotated[..., :3], first * c[..., :3] - second * s[..., :3])
    torch.testing.assert_close(rotated[..., 3:6], second * c[..., 3:6] + first * s[..., 3:6])


def test_a_sample_counts_the_rows_of_its_forward(dit, processor, encoder) -> None:
    """`DiffusionSample.tokens` (what the stage's ``max_batch_tokens`` budgets) is the packed layout's
    row count: text, references (an image at its own size, a soundtrack of any length), keyframes,
    video patches and both audio channels."""
    from PIL import Image

    rng = np.random.default_rng(0)
    frame = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (96, 40, 3), dtype=np.uint8))
    sound = (rng.random((2, 8000), dtype=np.float32) - 0.5) * 0.6
    requests = {
        "t2va": request("a cat sleeps on a sofa"),
        "first": request("a cat", image=frame, size=(64, 32)),
        "both": request("a cat", image=frame, last_image=frame, num_frames=141),
        # An image reference is encoded at its own size; a soundtrack's length need not fill the encoder's hop.
        "references": request("a cat", references=[
            {"type": "image", "image": frame}, {"type": "audio", "audio": sound[:, :5601], "sample_rate": 8000},
            {"type": "image", "image": tall}, {"type": "audio", "audio": sound[0, :3000], "sample_rate": 8000},
        ]),
    }
    model = dit.model
    for rid, item in stage_inputs(processor, encoder, requests).items():
        samples = model.prepare(rid, dict(item.data), dict(item.params))
        model.start(samples)
        values = samples[0].state.values
        rows = sum(int(values[k].shape[0]) for k in ("video_indices", "audio_indices", "text_indices"))
        assert samples[0].tokens == rows, rid


def test_a_token_budget_of_one_request_runs_them_one_after_another(pipeline, dit, processor, encoder) -> None:
    """``max_batch_tokens`` at one request's rows: three requests in arrival order, each alone in its
    steps, each the video it is when the three share every step (the samples' real row counts)."""
    import attrs

    from omni_core.stages.diffusion import DiffusionStageRuntime

    requests = {f"r{i}": request(prompt, seed=i) for i, prompt in enumerate(("a cat sleeps", "waves on rocks", "a dog runs"))}
    inputs = stage_inputs(processor, encoder, requests)
    together = run_dit(dit, inputs)
    tokens = dit.model.prepare("probe", dict(inputs["r0"].data), dict(inputs["r0"].params))[0].tokens
    stage = pipeline.stage("dit")
    options = {**stage.options, "admission_window_ms": 0.0, "max_batch_tokens": tokens}
    budgeted = DiffusionStageRuntime(pipeline, attrs.evolve(stage, options=options))
    budgeted.model = dit.model  # the same loaded model part (as `load()` would attach it)
    alone = run_dit(budgeted, inputs)
    assert budgeted.batch_sizes and set(budgeted.batch_sizes) == {1} and max(dit.batch_sizes[-3:]) == 3
    for rid in requests:  # (a batched forward rounds differently: within one 8-bit level, as in test_equality)
        assert np.abs(alone[rid]["video"].astype(int) - together[rid]["video"].astype(int)).max() <= 1, rid
        np.testing.assert_allclose(alone[rid]["audio"], together[rid]["audio"], rtol=1e-4, atol=1e-5, err_msg=rid)


def test_the_default_deploy_budget_runs_480p_requests_alone_and_batches_small_ones(pipeline, dit, processor, encoder) -> None:
    """The default deploy's ``max_batch_tokens``: one 832x480, 5 s t2va request fits it and two do not
    (they run one after another, as the test above shows a budget does); four requests at the tiny
    checkpoint's default size fit together."""
    budget = pipeline.stage("dit").options["max_batch_tokens"]
    inputs = stage_inputs(processor, encoder, {"wide": request("waves at dusk", size=(832, 480)), "small": request("a cat")})
    tokens = {rid: dit.model.prepare(rid, dict(item.data), dict(item.params))[0].tokens for rid, item in inputs.items()}
    assert tokens["wide"] - 414 - 14430 < 64  # (14,430 video and 414 audio rows, the rest the prompt's)
    assert tokens["wide"] <= budget < 2 * tokens["wide"]
    assert 4 * tokens["small"] <= budget
