"""MiniMax-H3 on Omni's stages against diffusers' `MiniMaxH3ModularPipeline` on the same tiny weights (fp32, CPU)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import torch

from omni_minimax_h3.packed import BlockKernels, CacheRow, PackedInput, forward_packed
from omni_minimax_h3.reference import FRAMES, SIZE, diffusers_run, request, run_dit, stage_inputs, to_uint8

TOL = {"rtol": 1e-5, "atol": 1e-5}
# Audio against the library: relative 1e-5 (the tiny soundtrack peaks near 0.3; quiet samples are compared
# relatively, not hidden under an absolute 1e-5).
AUDIO_TOL = {"rtol": 1e-5, "atol": 1e-8}


def loop(model: Any, samples: list[Any]) -> None:
    """Step the model part's samples to the end, each step one forward for all of them."""
    while any(not s.done for s in samples):
        running = [s for s in samples if not s.done]
        model.denoise(running)
        for s in running:
            s.step += 1


def prepared(dit: Any, processor: Any, encoder: Any, prompt: str, rid: str, **kwargs: Any) -> Any:
    item = stage_inputs(processor, encoder, {rid: request(prompt, **kwargs)})[rid]
    (sample,) = dit.model.prepare(rid, dict(item.data), dict(item.params))
    return sample


def noise(reference: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Video and audio noise in the shapes the library's prepare-latents step takes (as diffusers' tests make them)."""
    generator = torch.Generator().manual_seed(seed)
    ratio = reference.vae_spatial_compression_ratio
    latents = torch.randn(1, reference.vae_latent_channels, 37, SIZE[1] // ratio, SIZE[0] // ratio, generator=generator)
    audio = torch.randn(reference.audio_channels, reference.audio_latent_channels, round(FRAMES / 24 * 40), generator=generator)
    return latents, audio


def test_t2va_equals_diffusers_given_the_same_latents(dit, processor, encoder, reference) -> None:
    prompt = "a robot arm picks up a blue cube"
    latents, audio = noise(reference, seed=11)
    sample = prepared(dit, processor, encoder, prompt, "same-latents", steps=4)
    dit.model.prepare_state(sample.state, latents=latents.clone(), audio_latents=audio.clone())
    loop(dit.model, [sample])
    ours = dit.model.decode_tensors(sample.state)
    theirs = diffusers_run(reference, prompt, seed=None, steps=4, latents=latents.clone(), audio_latents=audio.clone())
    assert ours["videos"].shape == (1, FRAMES, 3, SIZE[1], SIZE[0]) and ours["audio"].shape[:2] == (1, 2)
    torch.testing.assert_close(ours["videos"], theirs["videos"], **TOL)
    torch.testing.assert_close(ours["audio"], theirs["audio"], **AUDIO_TOL)
    assert ours["sampling_rate"] == theirs["sampling_rate"] == reference.audio_vae.config.sampling_rate


def test_a_seed_alone_gives_the_library_output(dit, processor, encoder, reference) -> None:
    """Only a seed on both sides: the noise is drawn in the library's order (video, then audio) from one generator."""
    prompt = "waves crash on the rocks at sunset"
    outputs = run_dit(dit, stage_inputs(processor, encoder, {"seeded": request(prompt, seed=7)}))
    got = outputs["seeded"]
    theirs = diffusers_run(reference, prompt, seed=7)
    np.testing.assert_array_equal(got["video"], to_uint8(theirs["videos"]))
    np.testing.assert_allclose(got["audio"], theirs["audio"][0].T.numpy(), **AUDIO_TOL)
    assert got["fps"] == 24.0 and got["sample_rate"] == theirs["sampling_rate"]
    assert got["video"].shape == (FRAMES, SIZE[1], SIZE[0], 3) and got["video"].dtype == np.uint8
    other = run_dit(dit, stage_inputs(processor, encoder, {"other": request(prompt, seed=8)}))["other"]
    assert not np.array_equal(other["video"], got["video"])


# -- stage by stage ---------------------------------------------------------------------------------


def test_encoder_embeddings_equal_the_library_batched_or_alone(processor, encoder, reference) -> None:
    """Alone, the library's conditioning to 1e-5; in one right-padded batch, within 1e-4 of that: the padded
    forward takes a masked attention kernel, and 51 random layers amplify its rounding (measured 3.4e-5)."""
    # The encoder loads the layers up to the conditioning one and one more; the library runs the whole stack.
    assert len(encoder.model.model.model.language_model.layers) == reference.text_encoder_layer + 1
    assert reference.text_encoder.config.text_config.num_hidden_layers > reference.text_encoder_layer + 1
    prompts = {"a": "a cat sleeps on a sofa", "b": "a dog runs on the beach while seagulls fly over the sea", "c": "rain"}
    batched = stage_inputs(processor, encoder, {rid: request(p) for rid, p in prompts.items()})  # one padded forward
    for rid, prompt in prompts.items():
        expected = _library_embeds(reference, prompt)[0]
        alone = torch.as_tensor(stage_inputs(processor, encoder, {rid: request(prompt)})[rid].data["prompt_embeds"])
        assert alone.shape == expected.shape
        torch.testing.assert_close(alone, expected, **TOL)
        torch.testing.assert_close(torch.as_tensor(batched[rid].data["prompt_embeds"]), expected, rtol=1e-4, atol=1e-4)
        assert batched[rid].params["token_tags"] == [reference.text_tag] * alone.shape[0]


def _library_embeds(reference: Any, prompt: str) -> torch.Tensor:
    """diffusers' `MiniMaxH3TextEncoderStep` alone: the pipeline's own presentation and conditioner call."""
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    state = PipelineState()
    state.set("prompt", prompt)
    _, state = MiniMaxH3TextEncoderStep()(reference, state)
    return state.get("prompt_embeds")


def test_one_forward_equals_the_library_and_packing_changes_nothing(dit, processor, encoder, reference) -> None:
    samples = [
        prepared(dit, processor, encoder, "a red apple on a wooden table", "f1", seed=1, steps=3),
        prepared(dit, processor, encoder, "a drummer plays a fast beat on a stage; the crowd claps", "f2", seed=2, steps=5),
        prepared(dit, processor, encoder, "birds", "f3", seed=3, steps=4),
    ]
    dit.model.start(samples)
    steps = [0, 3, 1]  # requests at different steps share the forward
    inputs = [dit.model._packed_input(s.state, step) for s, step in zip(samples, steps)]
    packed = forward_packed(dit.model.pipe.transformer, inputs)
    for item, (video, audio) in zip(inputs, packed):
        theirs = _library_forward(reference.transformer, item)
        torch.testing.assert_close(video, theirs[0][0], **TOL)
        torch.testing.assert_close(audio, theirs[1][0], **TOL)
        alone = forward_packed(dit.model.pipe.transformer, [item])[0]
        torch.testing.assert_close(video, alone[0], **TOL)


def test_blocks_in_groups_and_pieces_change_nothing(dit, processor, encoder) -> None:
    """`BlockKernels.rows`: each block on groups of requests of at most that many rows (one request
    alone where it is larger, its second half then in pieces) gives the velocities of one call over
    every row, whatever the groups' and the pieces' edges."""
    samples = [
        prepared(dit, processor, encoder, "a red apple on a wooden table", "p1", seed=1, steps=3),
        prepared(dit, processor, encoder, "birds", "p2", seed=3, steps=4),
    ]
    dit.model.start(samples)
    inputs = [dit.model._packed_input(s.state, step) for s, step in zip(samples, [0, 2])]
    transformer = dit.model.pipe.transformer
    whole = forward_packed(transformer, inputs, kernels=BlockKernels(rows=10**9))
    total = sum(item.length for item in inputs)
    for rows in (total // 3, 97, total - 1):
        for (video, audio), (video_p, audio_p) in zip(whole, forward_packed(transformer, inputs, kernels=BlockKernels(rows=rows))):
            torch.testing.assert_close(video_p, video, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(audio_p, audio, rtol=1e-6, atol=1e-6)


def test_compiled_blocks_equal_eager_ones(dit, processor, encoder) -> None:
    """The ``compile`` option's blocks (`BlockKernels.compiled`, inductor on CPU here) give the eager
    blocks' velocities, for one request and for three whose row count differs (a new shape), with
    and without the first-block cache."""
    from omni_core.stages.diffusion_cache import CacheConfig, CacheState

    samples = [
        prepared(dit, processor, encoder, "a red apple on a wooden table", "c1", seed=1, steps=3),
        prepared(dit, processor, encoder, "a drummer plays a fast beat on a stage", "c2", seed=2, steps=5, size=[96, 64]),
        prepared(dit, processor, encoder, "birds", "c3", seed=3, steps=4),
    ]
    dit.model.start(samples)
    inputs = [dit.model._packed_input(s.state, step) for s, step in zip(samples, [0, 3, 1])]
    transformer = dit.model.pipe.transformer
    compiled = BlockKernels.compiled()
    pieces = attrs.evolve(compiled, rows=sum(item.length for item in inputs) // 2 + 1)  # the second half in two calls
    for batch, kernels in ((inputs[:1], compiled), (inputs, compiled), (inputs, pieces)):
        eager_out = forward_packed(transformer, batch)
        compiled_out = forward_packed(transformer, batch, kernels=kernels)
        for (video, audio), (video_c, audio_c) in zip(eager_out, compiled_out):
            torch.testing.assert_close(video_c, video, **TOL)
            torch.testing.assert_close(audio_c, audio, **TOL)
    # The first-block cache's path: step 0 runs every block and records; at step 1 a threshold of 0
    # runs them again, one of 100 reuses the recorded residual (each system with its own states).
    for threshold in (0.0, 100.0):
        states = {kernels: [CacheState(CacheConfig("first_block", threshold, 0)) for _ in range(2)] for kernels in ("eager", "compiled")}
        for step in (0, 1):
            step_inputs = [dit.model._packed_input(s.state, step) for s in samples[:2]]
            expected = forward_packed(transformer, step_inputs, [CacheRow(c, step, 5) for c in states["eager"]])
            got = forward_packed(transformer, step_inputs, [CacheRow(c, step, 5) for c in states["compiled"]], kernels=compiled)
            for (video, audio), (video_c, audio_c) in zip(expected, got):
                torch.testing.assert_close(video_c, video, **TOL)
                torch.testing.assert_close(audio_c, audio, **TOL)
        assert [c.skipped_steps for c in states["compiled"]] == [c.skipped_steps for c in states["eager"]] == [int(threshold > 0)] * 2


@torch.inference_mode()
def _library_forward(transformer: Any, item: PackedInput) -> Any:
    return transformer(
        hidden_states=item.hidden_states[None], audio_hidden_states=item.audio_hidden_states[None],
        encoder_hidden_states=item.encoder_hidden_states[None], timestep=item.timestep, timestep_indices=item.timestep_indices,
        token_tags=item.token_tags, position_ids=item.position_ids, video_indices=item.video_indices,
        audio_indices=item.audio_indices, text_indices=item.text_indices, return_dict=False,
    )


@pytest.mark.parametrize("steps", [2, 6, 30])
def test_both_sigma_schedules(dit, processor, encoder, reference, steps: int) -> None:
    """Video rows follow the ``scheduler/`` shift (12), audio rows the ``audio_scheduler/`` shift (3)."""
    sample = prepared(dit, processor, encoder, "a cat", f"sigmas{steps}", steps=steps)
    dit.model.start([sample])
    state = sample.state
    for scheduler, shift in ((state.scheduler, 12.0), (state.audio_scheduler, 3.0)):
        assert scheduler.config.shift == shift
        base = torch.linspace(1.0, 0.0, steps)
        expected = torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))
        torch.testing.assert_close(scheduler.sigmas, expected)
    reference.scheduler.set_timesteps(steps)
    reference.audio_scheduler.set_timesteps(steps)
    torch.testing.assert_close(state.values["timesteps"], reference.scheduler.timesteps)
    torch.testing.assert_close(state.values["audio_timesteps"], reference.audio_scheduler.timesteps)
    assert sample.total_steps == len(reference.scheduler.timesteps) == steps - 1


def test_vae_decode_equals_the_library(dit, processor, encoder, reference) -> None:
    """The decode of fixed (random) final latents: unpacking, video VAE and audio VAE."""
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3DecodeStep

    sample = prepared(dit, processor, encoder, "a cat", "decode")
    dit.model.start([sample])
    values = sample.state.values
    generator = torch.Generator().manual_seed(5)
    values["latents"] = torch.randn(values["latents"].shape, generator=generator)
    values["audio_latents"] = torch.randn(values["audio_latents"].shape, generator=generator)
    ours = dit.model.decode_tensors(sample.state)
    state = PipelineState()
    for name in ("latents", "audio_latents", "num_latent_frames", "latent_height", "latent_width", "num_audio_latents"):
        state.set(name, values[name].clone() if isinstance(values[name], torch.Tensor) else values[name])
    state.set("output_type", "pt")
    _, state = MiniMaxH3AfterDenoiseStep()(reference, state)
    _, state = MiniMaxH3DecodeStep()(reference, state)
    torch.testing.assert_close(ours["videos"], state.get("videos"), **TOL)
    torch.testing.assert_close(ours["audio"], state.get("audio"), **AUDIO_TOL)


# -- fl2va: a first frame, a last frame, both ---------------------------------------------------------


def keyframe(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


FRAMES_OF = {
    "first": {"image": keyframe(48, 32, 1)},
    "last": {"last_image": keyframe(32, 48, 2)},
    "both": {"image": keyframe(40, 40, 3), "last_image": keyframe(64, 32, 4)},  # the second is cover-cropped
}


@pytest.mark.parametrize("which", list(FRAMES_OF))
def test_fl2va_equals_diffusers(dit, processor, encoder, reference, which: str) -> None:
    """Keyframes through the input processor (canvas, presentation), the encoder (vision tower) and the dit
    (VAE encode under seed 42, anchors at t=0.999, the conditioning noise drawn first): the library's output."""
    prompt = "a robot arm picks up a blue cube"
    frames = FRAMES_OF[which]
    got = run_dit(dit, stage_inputs(processor, encoder, {which: request(prompt, seed=9, **frames)}))[which]
    theirs = diffusers_run(reference, prompt, seed=9, **frames)
    np.testing.assert_array_equal(got["video"], to_uint8(theirs["videos"]))
    np.testing.assert_allclose(got["audio"], theirs["audio"][0].T.numpy(), **AUDIO_TOL)


def test_fl2va_embeddings_and_given_latents_equal_diffusers(dit, processor, encoder, reference) -> None:
    prompt = "waves crash on the rocks"
    frames = FRAMES_OF["both"]
    item = stage_inputs(processor, encoder, {"fl-latents": request(prompt, seed=4, steps=4, **frames)})["fl-latents"]
    expected = reference(prompt=prompt, image=frames["image"], last_image=frames["last_image"], height=SIZE[1], width=SIZE[0],
                         output=["keyframes", "prompt_embeds", "text_token_tags"], num_frames=FRAMES, num_inference_steps=2,
                         generator=torch.Generator().manual_seed(0), output_type="pt")
    torch.testing.assert_close(torch.as_tensor(item.data["prompt_embeds"]), expected["prompt_embeds"][0], **TOL)
    assert item.params["token_tags"] == expected["text_token_tags"].tolist()
    assert [np.asarray(k).tolist() for k in item.params["keyframes"]] == [np.asarray(k).tolist() for k in expected["keyframes"]]
    latents, audio = noise(reference, seed=21)
    (sample,) = dit.model.prepare("fl-latents", dict(item.data), dict(item.params))
    dit.model.prepare_state(sample.state, latents=latents.clone(), audio_latents=audio.clone())
    loop(dit.model, [sample])
    ours = dit.model.decode_tensors(sample.state)
    theirs = diffusers_run(reference, prompt, seed=4, steps=4, latents=latents.clone(), audio_latents=audio.clone(), **frames)
    torch.testing.assert_close(ours["videos"], theirs["videos"], **TOL)
    torch.testing.assert_close(ours["audio"], theirs["audio"], **AUDIO_TOL)


def test_four_concurrent_requests_of_different_tasks_equal_each_alone(dit, processor, encoder) -> None:
    """t2va, fl2va (first; first and last) and ref2va sent together: the three on ``transformer/`` share every
    forward (different prompts, sizes, seeds and step counts); each request gives what it gives alone."""
    requests = {
        "t2va": request("a cat sleeps on a sofa", seed=1, steps=3, size=(64, 32)),
        "first": request("a dog runs on the beach", seed=2, steps=4, **FRAMES_OF["first"]),
        "both": request("birds sing in the forest", seed=3, steps=3, **FRAMES_OF["both"]),
        "ref2va": request("rain", seed=4, steps=2, references=omni_references(REFERENCES["images+audio"])),
    }
    alone = {rid: run_dit(dit, stage_inputs(processor, encoder, {rid: item}))[rid] for rid, item in requests.items()}
    before = len(dit.batch_sizes)
    together = run_dit(dit, stage_inputs(processor, encoder, requests))
    assert max(dit.batch_sizes[before:]) == 3, "the three requests on one transformer must share a forward"
    for rid in requests:
        assert np.abs(together[rid]["video"].astype(int) - alone[rid]["video"].astype(int)).max() <= 1, rid
        np.testing.assert_allclose(together[rid]["audio"], alone[rid]["audio"], rtol=1e-4, atol=1e-5, err_msg=rid)  # padding in the encoder: ~1e-6
        assert np.abs(alone[rid]["audio"]).max() > 1e-2  # not silence


# -- ref2va: image and audio references --------------------------------------------------------------


def waveform(seconds: float, rate: int, seed: int, channels: int = 2) -> torch.Tensor:
    return (torch.rand(channels, int(seconds * rate), generator=torch.Generator().manual_seed(seed)) * 2 - 1) * 0.3


REFERENCES = {
    "image": [("image", keyframe(56, 40, 5))],
    "images+audio": [("image", keyframe(40, 40, 6)), ("audio", waveform(2.0, 8000, 7)), ("image", keyframe(32, 64, 8))],
    "mono audio": [("audio", waveform(1.5, 8000, 9, channels=1)), ("image", keyframe(48, 32, 10))],
}


def library_references(entries: list) -> list:
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference

    return [MiniMaxH3ImageReference(image=v) if kind == "image" else MiniMaxH3AudioReference(audio=v, sample_rate=8000) for kind, v in entries]


def omni_references(entries: list) -> list:
    return [{"type": "image", "image": v} if kind == "image" else {"type": "audio", "audio": v.numpy(), "sample_rate": 8000} for kind, v in entries]


@pytest.mark.parametrize("which", list(REFERENCES))
def test_ref2va_equals_diffusers(dit, processor, encoder, reference, which: str) -> None:
    """References through the library's setup, labelled presentation and encoders, on ``transformer_ref/``."""
    prompt = "a dog barks in the park"
    entries = REFERENCES[which]
    got = run_dit(dit, stage_inputs(processor, encoder, {which: request(prompt, seed=3, references=omni_references(entries))}))[which]
    theirs = diffusers_run(reference, prompt, seed=3, references=library_references(entries))
    np.testing.assert_array_equal(got["video"], to_uint8(theirs["videos"]))
    np.testing.assert_allclose(got["audio"], theirs["audio"][0].T.numpy(), **AUDIO_TOL)


def test_ref2va_embeddings_equal_diffusers(processor, encoder, reference) -> None:
    entries = REFERENCES["images+audio"]
    item = stage_inputs(processor, encoder, {"ref-embeds": request("a dog", references=omni_references(entries))})["ref-embeds"]
    expected = reference(prompt="a dog", references=library_references(entries), height=SIZE[1], width=SIZE[0], num_frames=FRAMES,
                         num_inference_steps=2, output=["prompt_embeds", "text_token_tags"], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.as_tensor(item.data["prompt_embeds"]), expected["prompt_embeds"][0], **TOL)
    assert item.params["token_tags"] == expected["text_token_tags"].tolist()


@pytest.mark.parametrize(
    ("references", "says"),
    [
        ([{"type": "audio", "audio": np.zeros(800, np.float32), "sample_rate": 8000}], "paired with at least one image"),
        ([{"type": "image", "image": keyframe(32, 32, i)} for i in range(10)], "at most 9 image"),
        ([{"type": "audio", "audio": np.zeros(800, np.float32), "sample_rate": 16000}, {"type": "image", "image": keyframe(32, 32, 0)}], "8000 Hz"),
        ([{"type": "video", "video": "data:video/mp4;base64,AAAA"}], "video references"),
        ([{"type": "image", "image": "/etc/passwd"}], "data URL"),
    ],
)
def test_ref2va_combinations_the_library_rejects_are_400s(processor, references: list, says: str) -> None:
    from omni_core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        processor.process(request("a cat", references=references))
    assert says in str(info.value) and info.value.param.startswith("references"), str(info.value)
