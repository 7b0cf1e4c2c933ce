"""The code2wav stage equals transformers' chunked decode on the tiny checkpoint's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import transformers  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)

import torch  # noqa: E402

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage  # noqa: E402
from omni_core.errors import InvalidRequestError  # noqa: E402
from omni_core.outputs import Chunk, StageInput  # noqa: E402
from omni_core.stages.generation import GenerationStageRuntime  # noqa: E402
from omni_qwen3.reference import decode_codes, reference_generate  # noqa: E402

TEXT = [{"role": "user", "content": "Hello world, what is this?"}]


def runtime(tiny_dir: Path, streaming: bool, **options: Any) -> GenerationStageRuntime:
    stage = ResolvedStage(
        name="code2wav",
        kind="generation",
        runtime_ref="omni_core.stages.generation:GenerationStageRuntime",
        model="omni_qwen3.code2wav:Code2WavModel",
        output="audio",
        final=True,
        placement="inline",
        options=options,
    )
    pipeline = ResolvedPipeline(
        model=str(tiny_dir), model_path=str(tiny_dir), family="qwen3-omni", stages=(stage,), streaming=streaming
    )
    stage_runtime = GenerationStageRuntime(pipeline, stage)
    stage_runtime.load()
    return stage_runtime


def run(stage_runtime: GenerationStageRuntime, requests: dict[str, list[np.ndarray]]) -> tuple[dict[str, np.ndarray], int]:
    """Feed each request's frame pieces (``[T, Q]``) as streamed input; return waveforms and steps."""
    outputs: dict[str, list[np.ndarray]] = {rid: [] for rid in requests}
    for rid, pieces in requests.items():
        stage_runtime.add_request(rid, StageInput(data={"codes": pieces[0]}, final=len(pieces) == 1))
    for i in range(1, max(len(p) for p in requests.values())):
        for rid, pieces in requests.items():
            if i < len(pieces):
                stage_runtime.extend_request(rid, StageInput(data={"codes": pieces[i]}, final=i == len(pieces) - 1))
    steps = 0
    while stage_runtime.has_unfinished():
        chunks: list[Chunk] = stage_runtime.step()
        steps += 1
        for chunk in chunks:
            assert chunk.error is None, chunk.error
            assert chunk.data["sample_rate"] == 24000
            outputs[chunk.request_id].append(chunk.data["audio"])
    return {rid: np.concatenate(parts) for rid, parts in outputs.items()}, steps


def test_reference_generate_waveform(tiny_dir: Path, model: Any) -> None:
    ref = reference_generate(tiny_dir, TEXT, model=model, max_new_tokens=8, talker_max_new_tokens=40)
    assert ref.codes is not None and ref.waveform is not None and ref.codes.shape[1] > 25
    for streaming in (False, True):
        stage_runtime = runtime(tiny_dir, streaming)
        waves, steps = run(stage_runtime, {"a": [ref.codes.T]})
        assert steps == (-(-ref.codes.shape[1] // stage_runtime.chunk_size) if streaming else 1)
        assert waves["a"].shape == ref.waveform.shape
        np.testing.assert_allclose(waves["a"], ref.waveform, atol=1e-5)


def _stream_stepwise(
    stage_runtime: GenerationStageRuntime, pieces: list[np.ndarray], between: Any = None
) -> list[np.ndarray]:
    """Audio chunks emitted when `pieces` stream in one by one, stepping in between (as a talker
    and code2wav run side by side); `between()` runs after every step."""
    out = []
    stage_runtime.add_request("a", StageInput(data={"codes": pieces[0]}, final=len(pieces) == 1))
    for i in range(1, len(pieces) + 1):
        while stage_runtime.has_unfinished():
            out += [chunk.data["audio"] for chunk in stage_runtime.step()]
            if between is not None:
                between()
        if i < len(pieces):
            stage_runtime.extend_request("a", StageInput(data={"codes": pieces[i]}, final=i == len(pieces) - 1))
    return out


def test_small_streamed_chunks_equal_one_full_decode(tiny_dir: Path, model: Any) -> None:
    """Under 300 frames the reference is one decode: 25-frame chunks, each continuing its request's
    decoder state (one frame of context for the previous chunk's held-back samples), give the same
    samples; chunks decoded afresh from their frames alone do not."""
    rng = np.random.default_rng(2)
    codes = rng.integers(0, model.config.code2wav_config.codebook_size, size=(4, 120))
    expected = decode_codes(model, codes)
    pieces = [codes.T[i : i + 10] for i in range(0, 120, 10)]  # a talker emitting 10 frames at a time
    stage_runtime = runtime(tiny_dir, streaming=True)
    assert stage_runtime.chunk_size == 25 and stage_runtime.left_context == 1
    chunks = _stream_stepwise(stage_runtime, pieces)
    spf = stage_runtime.model.samples_per_frame
    # The first audio after 25 frames, not after the whole answer.
    assert chunks[0].shape[0] == 25 * spf - stage_runtime.model.trimmed_samples and len(chunks) == 120 // 25 + 1
    waveform = np.concatenate(chunks)
    assert waveform.shape == expected.shape
    np.testing.assert_allclose(waveform, expected, atol=1e-5)
    forgetful = runtime(tiny_dir, streaming=True)
    stateless = np.concatenate(_stream_stepwise(forgetful, pieces, between=lambda: forgetful.model.forget("a")))
    assert stateless.shape == expected.shape
    assert np.abs(stateless - expected).max() > 1e-3  # the state matters: the test can fail


@pytest.mark.parametrize("chunk_size", [25, 300])
def test_streamed_chunks_equal_the_reference_chunked_decode(tiny_dir: Path, model: Any, chunk_size: int) -> None:
    """Over 300 frames the reference decodes in segments of 300 with 25 frames of context; any
    chunking inside them, and the non-streaming decode, give its samples."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, model.config.code2wav_config.codebook_size, size=(4, 340))
    expected = decode_codes(model, codes)
    pieces = [codes.T[:120], codes.T[120:310], codes.T[310:]]
    waves, steps = run(runtime(tiny_dir, streaming=True, chunk_size=chunk_size), {"a": pieces})
    assert steps == sum(-(-n // chunk_size) for n in (300, 40))
    assert waves["a"].shape == expected.shape
    np.testing.assert_allclose(waves["a"], expected, atol=1e-5)
    assert np.abs(expected).mean() > 1e-3
    if chunk_size == 25:
        whole, steps = run(runtime(tiny_dir, streaming=False), {"a": pieces})
        assert steps == 2  # one decode per segment, one chunk at the end
        np.testing.assert_allclose(whole["a"], expected, atol=1e-5)


def test_batched_requests_equal_alone(tiny_dir: Path, model: Any) -> None:
    rng = np.random.default_rng(1)
    size = model.config.code2wav_config.codebook_size
    requests = {f"r{i}": [rng.integers(0, size, size=(n, 4))] for i, n in enumerate((7, 31, 18))}
    stage_runtime = runtime(tiny_dir, streaming=True, chunk_size=32)
    waves, steps = run(stage_runtime, requests)
    assert steps == 1  # all three in one batched decode
    for rid, (codes,) in requests.items():
        np.testing.assert_allclose(waves[rid], decode_codes(model, codes.T), atol=1e-5)


def test_bad_codes_are_rejected(tiny_dir: Path) -> None:
    stage_runtime = runtime(tiny_dir, streaming=True)
    with pytest.raises(InvalidRequestError, match="codes"):
        stage_runtime.add_request("bad", StageInput(data={"codes": torch.zeros((3, 2), dtype=torch.long)}))
    with pytest.raises(InvalidRequestError, match="codes"):
        stage_runtime.add_request("big", StageInput(data={"codes": torch.full((3, 4), 10_000)}))


def test_stream_state_lives_as_long_as_the_request(tiny_dir: Path, model: Any) -> None:
    """The convolution states kept between chunks go when a request ends or is aborted."""
    rng = np.random.default_rng(3)
    size = model.config.code2wav_config.codebook_size
    stage_runtime = runtime(tiny_dir, streaming=True)
    streams = stage_runtime.model._streams
    for rid in ("done", "aborted"):
        stage_runtime.add_request(rid, StageInput(data={"codes": rng.integers(0, size, size=(30, 4))}, final=False))
    stage_runtime.step()
    assert set(streams) == {"done", "aborted"}  # one chunk each, more to come
    assert stage_runtime.health_stats() == {"requests": 2, "model_held_requests": 2}  # what /health shows
    stage_runtime.abort_request("aborted")
    stage_runtime.extend_request("done", StageInput(data={"codes": rng.integers(0, size, size=(5, 4))}, final=True))
    while stage_runtime.has_unfinished():
        stage_runtime.step()
    assert streams == {}
    assert stage_runtime.health_stats() == {"requests": 0, "model_held_requests": 0}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_streams_at_different_points_batch_together(tiny_dir: Path, model: Any, compiled: bool) -> None:
    """Requests joining at different times share decodes whose rows mix a first chunk (from the
    start) with continued ones at different cache fills and lengths; each equals its full decode,
    with the activations eager or compiled."""
    rng = np.random.default_rng(4)
    size = model.config.code2wav_config.codebook_size
    codes = {rid: rng.integers(0, size, size=(n, 4)) for rid, n in (("a", 150), ("b", 97), ("c", 60))}
    joins = {"a": 0, "b": 2, "c": 5}  # the step each request arrives at
    stage_runtime = runtime(tiny_dir, streaming=True, first_chunk_size=3, chunk_size=7, compile=compiled)
    assert stage_runtime.model.stack.compiled == compiled  # compiling worked here
    fed = {rid: 0 for rid in codes}
    out: dict[str, list[np.ndarray]] = {rid: [] for rid in codes}
    mixed = 0
    for step in range(200):
        for rid, frames in codes.items():  # 4 more frames per request per step, as a talker emits them
            if step >= joins[rid] and fed[rid] < len(frames):
                piece = StageInput(data={"codes": frames[fed[rid] : fed[rid] + 4]}, final=fed[rid] + 4 >= len(frames))
                (stage_runtime.add_request if fed[rid] == 0 else stage_runtime.extend_request)(rid, piece)
                fed[rid] += 4
        if not stage_runtime.has_unfinished():
            if all(fed[rid] >= len(frames) for rid, frames in codes.items()):
                break
            continue  # waiting for more frames
        streams_before = set(stage_runtime.model._streams)
        chunks = stage_runtime.step()
        mixed += len({c.request_id for c in chunks} - streams_before) > 0 and len(chunks) > 1
        for chunk in chunks:
            out[chunk.request_id].append(chunk.data["audio"])
    assert mixed  # at least one decode batched a first chunk with continued ones
    for rid, frames in codes.items():
        np.testing.assert_allclose(np.concatenate(out[rid]), decode_codes(model, frames.T), atol=1e-5)


def test_frame_by_frame_across_a_segment_boundary(tiny_dir: Path, model: Any) -> None:
    """Frames arriving one at a time, decoded in small chunks: the stage keeps the frames the next
    segment's 25-frame context needs (more than its one frame of left context) and equals the
    reference's segmented decode."""
    rng = np.random.default_rng(5)
    codes = rng.integers(0, model.config.code2wav_config.codebook_size, size=(4, 330))
    stage_runtime = runtime(tiny_dir, streaming=True, first_chunk_size=2, chunk_size=8, max_chunk_size=100)
    chunks = _stream_stepwise(stage_runtime, [codes.T[i : i + 1] for i in range(codes.shape[1])])
    np.testing.assert_allclose(np.concatenate(chunks), decode_codes(model, codes), atol=1e-5)
