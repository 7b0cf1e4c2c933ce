"""Cosmos3 on the diffusion runtime, against diffusers' `Cosmos3OmniPipeline` on the same tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_core.config import resolve
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.stages.diffusion import DiffusionStageRuntime

MODEL = "omni-tiny/cosmos3"
INLINE = ("generator.placement=inline",)


@pytest.fixture(scope="module")
def pipeline():
    return resolve(MODEL, overrides=INLINE)


@pytest.fixture(scope="module")
def reference(pipeline):
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(pipeline.model_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_runtime(pipeline, **options: Any) -> DiffusionStageRuntime:
    import attrs

    stage = pipeline.stage("generator")
    stage = attrs.evolve(stage, options={**stage.options, **options})
    runtime = DiffusionStageRuntime(pipeline, stage)
    runtime.load()
    return runtime


def request(prompt: str, seed: int, size=(32, 48), steps=4, guidance=4.0, task="t2i", **params: Any) -> StageInput:
    data = {"prompt": prompt, "seed": seed, "size": size, "task": task}
    return StageInput(data=data, params={"num_inference_steps": steps, "guidance_scale": guidance, **params})


def run(runtime: DiffusionStageRuntime, requests: dict[str, StageInput], joins: dict[int, dict[str, StageInput]] | None = None) -> dict[str, dict]:
    """Add `requests`, step until done (adding `joins[k]` before step k), return final payloads."""
    for rid, item in requests.items():
        runtime.add_request(rid, item)
    outputs: dict[str, dict] = {}
    step = 0
    while runtime.has_unfinished() or (joins and any(k >= step for k in joins)):
        for rid, item in (joins or {}).get(step, {}).items():
            runtime.add_request(rid, item)
        for chunk in runtime.step():
            assert chunk.error is None
            if chunk.final:
                outputs[chunk.request_id] = chunk.data
        step += 1
    return outputs


def diffusers_output(pipe, item: StageInput) -> dict[str, np.ndarray]:
    data, params = item.data, item.params
    width, height = data["size"]
    video = data["task"] != "t2i"
    result = pipe(
        data["prompt"],
        num_frames=params.get("num_frames", 1) if video else 1,
        width=width,
        height=height,
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params["guidance_scale"],
        negative_prompt=params.get("negative_prompt"),
        enable_sound=data["task"] == "t2va",
        generator=torch.Generator().manual_seed(data["seed"]),
        output_type="np",
    )
    out = {"pixels": np.clip(np.round(result.video * 255), 0, 255).astype(np.uint8)}
    if result.sound is not None:
        out["audio"] = result.sound.float().mean(0).numpy()
    return out


def pixels(payload: dict) -> np.ndarray:
    return payload["image"][None] if "image" in payload else payload["video"]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


REQUESTS = {
    "apple": request("a red apple on a table", seed=7, size=(32, 48), steps=4, guidance=4.0),
    "cat": request("a cat sleeps on a sofa", seed=3, size=(48, 32), steps=3, guidance=1.0),
    "waves": request("waves crash on the rocks", seed=5, size=(32, 48), steps=5, guidance=6.0, negative_prompt="blurry"),
    "dog": request("a dog runs on the beach", seed=1, size=(32, 32), steps=3, task="t2va", num_frames=5),
}


@pytest.fixture(scope="module")
def batched(pipeline):
    runtime = make_runtime(pipeline, max_num_seqs=8, admission_window_ms=0.0)
    outputs = run(runtime, REQUESTS)
    return runtime, outputs


def test_batched_requests_equal_the_pipeline_run_alone(batched, reference):
    runtime, outputs = batched
    assert max(runtime.batch_sizes) >= 2, "requests of the same shape must share a forward"
    for rid, item in REQUESTS.items():
        expected = diffusers_output(reference, item)
        got = pixels(outputs[rid])
        assert got.shape == expected["pixels"].shape
        assert np.abs(got.astype(int) - expected["pixels"].astype(int)).max() <= 1, rid
        if "audio" in expected:
            assert outputs[rid]["sample_rate"] == reference.sound_tokenizer.config.sampling_rate
            np.testing.assert_allclose(outputs[rid]["audio"], expected["audio"], atol=1e-4)
    assert outputs["dog"]["fps"] == 24.0 and outputs["dog"]["video"].shape[0] == 5


def test_samples_admitted_together_share_a_scheduler_and_stay_exact(pipeline, reference):
    """Same shape and step count: one batched scheduler step; a member aborted midway leaves the others exact."""
    items = {
        "a": request("a red apple on a table", seed=7, size=(32, 32), steps=4),
        "b": request("a blue car in the snow", seed=9, size=(32, 32), steps=4, guidance=2.0),
        "c": request("a green field", seed=4, size=(32, 32), steps=4),
    }
    runtime = make_runtime(pipeline, max_num_seqs=8, admission_window_ms=0.0)
    for rid, item in items.items():
        runtime.add_request(rid, item)
    runtime.step()
    runtime.step()
    groups = {id(sample.state.group) for sample in runtime._running if sample.state.group is not None}
    assert len(groups) == 1 and len(runtime._running) == 3
    runtime.abort_request("c")
    outputs = run(runtime, {})
    assert set(outputs) == {"a", "b"}
    for rid in ("a", "b"):
        expected = diffusers_output(reference, items[rid])["pixels"]
        assert np.abs(pixels(outputs[rid]).astype(int) - expected.astype(int)).max() <= 1, rid


def test_a_sample_counts_the_positions_its_forward_carries(pipeline):
    """`DiffusionSample.tokens` (what the stage's ``max_batch_tokens`` adds up) is what the generator
    tower runs for the sample each step: every guidance branch's vision and sound tokens."""
    runtime = make_runtime(pipeline, admission_window_ms=0.0)
    try:
        part = runtime.model
        for name, item in REQUESTS.items():
            samples = part.prepare(name, item.data, item.params)
            part.start(samples)
            seen: list[int] = []
            handle = part.transformer.norm_moe_gen.register_forward_hook(
                lambda module, args, output: seen.append(args[0].shape[0] * args[0].shape[1])
            )
            try:
                part.denoise(samples)
            finally:
                handle.remove()
            assert seen == [sum(sample.tokens for sample in samples)], name
    finally:
        runtime.close()


def test_step_batching_gives_the_same_outputs_as_request_batching(pipeline, batched):
    _, together = batched
    runtime = make_runtime(pipeline, max_num_seqs=8, admission_window_ms=0.0)
    first = {"waves": REQUESTS["waves"]}
    later = {k: v for k, v in REQUESTS.items() if k != "waves"}
    outputs = run(runtime, first, joins={2: later})  # they join while "waves" is at step 2
    for rid in REQUESTS:
        np.testing.assert_array_equal(pixels(outputs[rid]), pixels(together[rid]))
    # "waves" and "apple" share a shape: at least one forward ran them at different steps together
    assert 2 in runtime.batch_sizes


def test_cache_stays_close_to_uncached(pipeline, reference):
    item = request("a robot arm picks up a blue cube", seed=11, size=(32, 32), steps=12, guidance=4.0)
    runtime = make_runtime(pipeline, admission_window_ms=0.0)
    exact = run(runtime, {"off": item})["off"]
    zero = run(runtime, {"zero": request("a robot arm picks up a blue cube", seed=11, size=(32, 32), steps=12, guidance=4.0, cache=0.0)})["zero"]
    np.testing.assert_array_equal(pixels(zero), pixels(exact))  # threshold 0 never skips
    cached_item = request("a robot arm picks up a blue cube", seed=11, size=(32, 32), steps=12, guidance=4.0, cache={"mode": "first_block", "threshold": 0.3})
    cached = run(runtime, {"on": cached_item})["on"]
    assert cached["cache"]["skipped_steps"] > 0
    assert psnr(pixels(cached), pixels(exact)) >= 40.0  # the stated bound for this setting (measured ~59 dB)


def test_cancel_mid_denoise_frees_the_slot(pipeline):
    runtime = make_runtime(pipeline, max_num_seqs=1, admission_window_ms=0.0)
    runtime.add_request("a", request("first", seed=1, steps=20))
    runtime.add_request("b", request("second", seed=2, steps=2))
    runtime.step()
    runtime.step()
    assert runtime.num_running == 1  # "b" waits for the slot
    runtime.abort_request("a")
    assert runtime.num_running == 0
    finals = [c for _ in range(3) for c in runtime.step() if c.final]
    assert [c.request_id for c in finals] == ["b"] and not runtime.has_unfinished()


@pytest.mark.parametrize(
    ("data", "params", "param"),
    [
        ({"size": (33, 32)}, {}, "size"),
        ({}, {"num_inference_steps": 0}, "num_inference_steps"),
        ({}, {"num_inference_steps": 5000}, "num_inference_steps"),
        ({"task": "image-to-song"}, {}, "task"),
        ({}, {"guidance_scale": "high"}, "guidance_scale"),
        ({"task": "t2v"}, {"num_frames": 4}, "num_frames"),
        ({}, {"cache": "sometimes"}, "cache"),
        ({}, {"temperature": 0.5}, "temperature"),
    ],
)
def test_bad_parameters_are_rejected_before_work(pipeline, data, params, param):
    runtime = make_runtime(pipeline)
    item = StageInput(data={"prompt": "x", "seed": 0, **data}, params=params)
    with pytest.raises(InvalidRequestError) as info:
        runtime.add_request("bad", item)
    assert info.value.param == param
    assert not runtime.has_unfinished() and runtime.batch_sizes == []


def test_int8_quantization_stays_close(pipeline):
    item = request("a red apple on a table", seed=7, steps=4)
    plain = run(make_runtime(pipeline, admission_window_ms=0.0), {"r": item})["r"]
    quantized_pipeline = resolve(MODEL, overrides=[*INLINE, "generator.quantization=int8"])
    assert quantized_pipeline.stage("generator").quantization == {"method": "int8_weight_only", "min_features": 64}
    runtime = make_runtime(quantized_pipeline, admission_window_ms=0.0)
    quantized = run(runtime, {"r": item})["r"]
    names = {type(m).__name__ for m in runtime.model.transformer.layers.modules()}
    assert "Int8WeightOnlyLinear" in names
    assert not np.array_equal(pixels(quantized), pixels(plain))
    assert psnr(pixels(quantized), pixels(plain)) >= 40.0  # measured ~62 dB


def test_compiled_stage_equals_eager(pipeline, batched):
    """`compile=true` (torch.compile around the attention) gives the eager outputs, batch shapes changing."""
    _, eager = batched
    runtime = make_runtime(pipeline, max_num_seqs=8, admission_window_ms=0.0, compile=True)
    from omni_cosmos3.layers import EAGER

    assert runtime.model.kernels != EAGER
    first = {"waves": REQUESTS["waves"]}
    later = {k: v for k, v in REQUESTS.items() if k != "waves"}
    outputs = run(runtime, first, joins={2: later})  # the batch grows mid-run: a new shape compiles
    for rid in REQUESTS:
        assert np.abs(pixels(outputs[rid]).astype(int) - pixels(eager[rid]).astype(int)).max() <= 1, rid


def test_cuda_graphs_option_is_ignored_off_cuda(pipeline, batched):
    """`cuda_graphs=true` is a CUDA feature: on CPU the stage runs eagerly and gives the same outputs."""
    _, eager = batched
    runtime = make_runtime(pipeline, max_num_seqs=8, admission_window_ms=0.0, cuda_graphs=True)
    assert runtime.model.graphs is None
    outputs = run(runtime, REQUESTS)
    for rid in REQUESTS:
        np.testing.assert_array_equal(pixels(outputs[rid]), pixels(eager[rid]))


def test_vae_tiling_decodes_close_to_untiled(pipeline):
    item = request("a wide landscape", seed=2, size=(64, 48), steps=2)
    plain = run(make_runtime(pipeline, admission_window_ms=0.0), {"r": item})["r"]
    tiled = run(make_runtime(pipeline, admission_window_ms=0.0, vae_tiling=True, vae_tile=32), {"r": item})["r"]
    assert pixels(tiled).shape == pixels(plain).shape
    assert psnr(pixels(tiled), pixels(plain)) >= 20.0


def test_offline_api_saves_png_and_mp4_with_audio(tmp_path: Path):
    import av
    from PIL import Image

    from omni_core import Omni
    from omni_core.engine.request import OmniRequest

    with Omni(MODEL, overrides=INLINE) as omni:
        image_request = OmniRequest(prompt="a red apple", modalities=("image",), params={"generator": {"num_inference_steps": 2}}, extra={"size": (32, 32), "seed": 1, "n": 2})
        video_request = OmniRequest(prompt="a dog", modalities=("video", "audio"), params={"generator": {"num_inference_steps": 2, "num_frames": 5}}, extra={"size": (32, 32), "seed": 1})
        image, video = omni.generate([image_request, video_request])
    assert len(image.images) == 2 and not np.array_equal(image.images[0], image.images[1])  # seeds 1 and 2
    paths = image.save(tmp_path)
    assert Image.open(paths["image"]).size == (32, 32)
    paths = video.save(tmp_path)
    with av.open(paths["video"]) as container:
        kinds = sorted(s.type for s in container.streams)
        frames = sum(1 for _ in container.decode(video=0))
    assert kinds == ["audio", "video"] and frames == 5
    assert video.sample_rate and video.audio.dtype == np.float32


def test_cli_generate_writes_files(tmp_path: Path):
    from click.testing import CliRunner

    from omni_cli.main import cli

    params = json.dumps({"generator": {"num_inference_steps": 2}})
    result = CliRunner().invoke(cli, ["generate", MODEL, "--prompt", "a cat", "--modalities", "image", "--stage-params", params, "--out", str(tmp_path), "--json", "--set", "generator.placement=inline"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout[result.stdout.index("{"):])
    assert Path(body["images"][0]["path"]).exists() and body["images"][0]["shape"] == [256, 256, 3]
    # Progress names the steps and what came (an image, though the stage's declared output is video).
    assert "[generator] step 1/2" in result.stderr and "[generator] image chunk 1 (final)" in result.stderr, result.stderr
    assert "video" not in result.stderr, result.stderr


def test_per_row_attention_equals_the_masked_batch() -> None:
    """The CUDA path (one unmasked attention per row over its real keys) equals the masked batch."""
    import torch

    from omni_cosmos3.layers import Context, attention, attention_per_row

    torch.manual_seed(0)
    rows, gen_tokens, heads, kv_heads, dim = 4, 16, 8, 2, 32
    lengths = [5, 9, 3, 9]
    n_max = max(lengths)
    keys, values = [torch.randn(rows, n_max, kv_heads, dim)], [torch.randn(rows, n_max, kv_heads, dim)]
    mask = torch.ones(rows, n_max + gen_tokens, dtype=torch.bool)
    for i, length in enumerate(lengths):
        mask[i, : n_max - length] = False  # right-aligned: the padding comes first
    context = Context(keys, values, mask[:, None, None, :], torch.empty(0), torch.empty(0), lengths)
    q = torch.randn(rows, gen_tokens, heads, dim)
    k, v = torch.randn(rows, gen_tokens, kv_heads, dim), torch.randn(rows, gen_tokens, kv_heads, dim)
    all_keys, all_values = torch.cat([keys[0], k], 1), torch.cat([values[0], v], 1)
    batched = attention(q, all_keys, all_values, mask=context.mask)
    torch.testing.assert_close(attention_per_row(q, all_keys, all_values, context), batched, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0},  # Cosmos3's
        {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0, "solver_order": 3},
        {"solver_order": 3, "solver_type": "bh1", "disable_corrector": [1], "final_sigmas_type": "sigma_min",
         "prediction_type": "v_prediction"},
    ],
)
def test_scheduler_step_equals_diffusers_unipc(config: dict) -> None:
    """`scheduler_step` (its scalars on the host, no device waits) is diffusers' UniPC step, bit for bit."""
    import copy

    from diffusers import UniPCMultistepScheduler

    from omni_cosmos3.scheduling import scheduler_step

    torch.manual_seed(0)
    theirs = UniPCMultistepScheduler(num_train_timesteps=1000, **config)
    theirs.set_timesteps(12)
    ours = copy.deepcopy(theirs)
    expected = got = torch.randn(2, 4, 1, 6, 6)
    for t in theirs.timesteps:
        velocity = torch.randn_like(expected)
        expected = theirs.step(velocity, t, expected, return_dict=False)[0]
        got = scheduler_step(ours, velocity, t, got)
        assert torch.isfinite(got).all() and torch.equal(got, expected), t
