"""The toy families: checkpoints, plugin registration, resolution, the edge adapter, pass-through."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_core.config.resolve import resolve
from omni_core.outputs import Chunk
from omni_core.plugins import load_plugins
from omni_core.config.resolved import ResolvedPipeline
from omni_core.parts import InputProcessor, PartContext, build_part
from omni_core.refs import load_ref
from omni_core.stages.generation import GenerationStageRuntime
from omni_toy import plugin
from omni_core.engine.request import OmniRequest
from omni_toy.pipeline import TokensToCodes, build_toy_pipeline
from omni_toy.tiny import make_tiny, make_tiny_passthrough
from omni_toy.vocoder import VocoderConfig


@pytest.fixture(scope="module")
def host():
    return load_plugins(allowlist=(), extra_plugins=[plugin])


def test_plugin_registers_both_families_lazily(host) -> None:
    assert host.family("toy").architectures == ("OmniToyPipeline",)
    assert host.family("toy-passthrough").make_tiny == "omni_toy.tiny:make_tiny_passthrough"
    for family in (host.family("toy"), host.family("toy-passthrough")):
        load_ref(family.pipeline)
        assert family.make_tiny is not None and load_ref(family.make_tiny)


def test_make_tiny_writes_lm_and_a_matching_vocoder(tmp_path: Path) -> None:
    make_tiny(tmp_path, "tiny")
    root = json.loads((tmp_path / "config.json").read_text())
    assert root == {"architectures": ["OmniToyPipeline"], "model_type": "omni-toy"}
    lm = json.loads((tmp_path / "lm" / "config.json").read_text())
    vocoder = VocoderConfig.read(tmp_path / "vocoder")
    assert (vocoder.vocab_size, vocoder.input_hidden_size) == (lm["vocab_size"], lm["hidden_size"])
    assert vocoder.left_context >= vocoder.receptive_field - 1
    assert (tmp_path / "vocoder" / "model.safetensors").is_file()
    assert (tmp_path / "lm" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="size"):
        make_tiny(tmp_path / "other", "huge")


def test_toy_pipeline_shape() -> None:
    pipeline = build_toy_pipeline("/nowhere", {})
    lm, vocoder = pipeline.stages
    assert (lm.kind, lm.output, lm.final, lm.params["max_tokens"]) == ("ar", "text", False, 16)
    assert (vocoder.kind, vocoder.output, vocoder.final) == ("generation", "audio", True)
    assert vocoder.inputs[0].source == "lm" and load_ref(vocoder.inputs[0].adapter) is TokensToCodes


def test_adapter_turns_tokens_or_hidden_states_into_frames() -> None:
    pipeline = ResolvedPipeline(model="toy", model_path="/nowhere", family="toy", stages=())
    adapter = TokensToCodes(PartContext(pipeline))
    state: dict = {}
    first = adapter.on_chunk(state, Chunk("r", "lm", 0, {"token_ids": [5, 7], "text": "ab"}))
    assert first is not None and not first.final
    assert first.data["codes"].dtype == torch.long and first.data["codes"].tolist() == [5, 7]
    assert adapter.on_chunk(state, Chunk("r", "lm", 1, {"token_ids": []})) is None  # nothing new yet
    last = adapter.on_chunk(state, Chunk("r", "lm", 2, {"token_ids": [], "finish_reason": "stop"}, final=True))
    assert last is not None and last.final and last.data["codes"].shape == (0,)
    hidden = np.ones((3, 64), dtype=np.float32)
    from_hidden = adapter.on_chunk(state, Chunk("r", "lm", 3, {"token_ids": [1, 2, 3], "hidden_states": hidden}))
    assert from_hidden is not None and tuple(from_hidden.data["codes"].shape) == (3, 64)


def test_passthrough_family_resolves_and_copies_frames(tmp_path: Path, host) -> None:
    make_tiny_passthrough(tmp_path)
    pipeline = resolve(str(tmp_path), plugins=host)
    assert pipeline.family == "toy-passthrough" and [s.name for s in pipeline.stages] == ["echo"]
    processor = build_part(pipeline.input_processor, PartContext(pipeline), InputProcessor, "input processor")
    inputs = processor.process(OmniRequest(prompt="héllo"))
    runtime = GenerationStageRuntime(pipeline, pipeline.stage("echo"))
    runtime.load()
    runtime.add_request("r", inputs["echo"])
    chunks = []
    while runtime.has_unfinished():
        chunks.extend(runtime.step())
    audio = np.concatenate([c.data["audio"] for c in chunks])
    assert chunks[-1].final and audio.tolist() == list("héllo".encode())


async def _collect(engine, request) -> list:
    return [delta async for delta in engine.generate(request)]


@pytest.mark.parametrize("placement", ["inline", "process"])
async def test_passthrough_through_the_engine_with_fail_hooks(tmp_path: Path, host, placement: str) -> None:
    from omni_core.engine.async_engine import AsyncOmniEngine
    from omni_core.errors import InvalidRequestError, StageError

    make_tiny_passthrough(tmp_path)
    pipeline = resolve(str(tmp_path), deploy={"stages": {"echo": {"placement": placement}}}, plugins=host)
    async with AsyncOmniEngine(pipeline) as engine:
        deltas = await asyncio.wait_for(_collect(engine, OmniRequest(prompt="hello")), 60)
        assert np.concatenate([d.data["audio"] for d in deltas]).tolist() == list(b"hello")
        with pytest.raises(InvalidRequestError):
            await asyncio.wait_for(_collect(engine, OmniRequest(prompt="x", params={"echo": {"fail": "invalid"}})), 60)
        with pytest.raises(InvalidRequestError, match="on purpose") as rejected:
            await asyncio.wait_for(_collect(engine, OmniRequest(prompt="x", params={"echo": {"fail": "request"}})), 60)
        assert rejected.value.param == "fail"  # rejected mid-step by the model's check(): still the client's error
        with pytest.raises(StageError, match="on purpose"):
            await asyncio.wait_for(_collect(engine, OmniRequest(prompt="x", params={"echo": {"fail": "stage"}})), 60)
        deltas = await asyncio.wait_for(_collect(engine, OmniRequest(prompt="again")), 60)
        assert deltas[-1].final


@pytest.mark.vllm
async def test_toy_pipeline_speaks_its_tokens(tmp_path: Path, host) -> None:
    """LM (vLLM) -> adapter -> vocoder, streamed: the audio is the vocoder's decode of the tokens."""
    from omni_core.engine.async_engine import AsyncOmniEngine
    from omni_toy.vocoder import ToyVocoder

    make_tiny(tmp_path)
    deploy = {"stages": {"lm": {"placement": "inline"}, "vocoder": {"placement": "inline"}}}
    pipeline = resolve(str(tmp_path), deploy=deploy, plugins=host)
    async with AsyncOmniEngine(pipeline) as engine:
        request = OmniRequest(prompt="Once upon a time", params={"lm": {"max_tokens": 24}})
        deltas = await asyncio.wait_for(_collect(engine, request), 120)
    tokens = [t for d in deltas if d.stage == "lm" for t in d.data.get("token_ids", [])]
    audio_chunks = [d.data["audio"] for d in deltas if d.stage == "vocoder"]
    assert len(tokens) == 24 and len(audio_chunks) > 1  # streamed in chunks
    reference = ToyVocoder(PartContext(pipeline, pipeline.stage("vocoder")))
    reference.load("cpu", "float32")
    assert reference.net is not None
    with torch.inference_mode():
        expected = reference.net(reference.net.features(torch.tensor([tokens])))[0].numpy()
    np.testing.assert_allclose(np.concatenate(audio_chunks), expected, atol=1e-5, rtol=0)
