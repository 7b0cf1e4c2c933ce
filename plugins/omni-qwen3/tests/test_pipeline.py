"""The Qwen3-Omni pipeline assembly, deploy file, input processor and torchvision workaround."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import transformers  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)

from omni_core.parts import PartContext  # noqa: E402
from omni_qwen3 import compat, plugin  # noqa: E402
from omni_qwen3.inputs import SPEECH_SYSTEM_PROMPT, Qwen3OmniInputProcessor, resample  # noqa: E402
from omni_qwen3.pipeline import build_pipeline  # noqa: E402
from omni_qwen3.reference import prepare_inputs, sine_wave, synthetic_image  # noqa: E402

from omni_core.config import resolve  # noqa: E402
from omni_core.config.modelref import read_hf_config  # noqa: E402
from omni_core.engine.request import OmniRequest  # noqa: E402
from omni_core.errors import ConfigError, InvalidRequestError  # noqa: E402
from omni_core.plugins import load_plugins  # noqa: E402


@pytest.fixture(scope="module")
def thinker_only_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint's config rewritten as a thinker-only checkpoint's architecture."""
    directory = tmp_path_factory.mktemp("qwen3-omni-thinker")
    for file in tiny_dir.iterdir():
        if file.name != "config.json":
            (directory / file.name).symlink_to(file)
    config = json.loads((tiny_dir / "config.json").read_text())
    thinker = dict(config["thinker_config"], architectures=["Qwen3OmniMoeThinkerForConditionalGeneration"])
    thinker["model_type"] = "qwen3_omni_moe_thinker"
    (directory / "config.json").write_text(json.dumps(thinker))
    return directory


@pytest.fixture(scope="module")
def processor(tiny_dir: Path) -> Qwen3OmniInputProcessor:
    return Qwen3OmniInputProcessor(PartContext(resolve(str(tiny_dir))))


def test_full_checkpoint_gives_three_stages(tiny_dir: Path) -> None:
    config = read_hf_config(tiny_dir)
    pipeline = build_pipeline(str(tiny_dir), config)
    assert [s.name for s in pipeline.stages] == ["thinker", "talker", "code2wav"]
    thinker, talker, code2wav = pipeline.stages
    assert (thinker.kind, thinker.model, thinker.output, thinker.final) == ("ar", "omni_qwen3.thinker:ThinkerModel", "text", False)
    assert thinker.params["stop_token_ids"] == [config["im_end_token_id"]]
    assert talker.inputs[0].source == "thinker" and talker.inputs[0].adapter == "omni_qwen3.edges:ThinkerToTalker"
    assert (talker.kind, talker.model, talker.output) == ("ar", "omni_qwen3.talker:TalkerModel", None)
    assert (code2wav.kind, code2wav.output, code2wav.final) == ("generation", "audio", True)
    assert code2wav.inputs[0].source == "talker" and code2wav.inputs[0].adapter is None
    assert pipeline.input_processor == "omni_qwen3.inputs:Qwen3OmniInputProcessor"
    # As vLLM-Omni: every final output (thinker text, code2wav audio) when a request names none.
    assert pipeline.default_modalities == ("text", "audio")


def test_default_deploy_resolves(tiny_dir: Path) -> None:
    resolved = resolve(str(tiny_dir))
    assert resolved.family == "qwen3-omni" and resolved.streaming
    for stage in resolved.stages:
        assert stage.placement == "process"
        assert stage.options["dtype"] == "checkpoint"  # float32 for this tiny checkpoint (test_dtype.py)
    # No fixed KV cache size: the AR runtime sizes it from the checkpoint (test_ar_runtime.py).
    assert all(resolved.stage(name).options["kv_cache_memory_bytes"] is None for name in ("thinker", "talker"))
    assert [edge.connector for s in resolved.stages for edge in s.inputs] == ["shm", "shm"]
    # A request's stop ids add to the pipeline's end-of-turn id, never replace it.
    from omni_core.engine.params import merge_params

    merged = merge_params(resolved.stage("thinker").params, {"stop_token_ids": [5]})
    assert merged["stop_token_ids"] == [read_hf_config(tiny_dir)["im_end_token_id"], 5]
    # The talker samples as transformers' generate does by default; a request may override it.
    talker = resolved.stage("talker").params
    assert (talker["temperature"], talker["top_k"]) == (0.9, 50)
    assert merge_params(talker, {"temperature": 0.0})["temperature"] == 0.0
    # CPU deploy: one thread per stage process; upstream stages yield to the ones nearer the audio.
    assert [(s.cpu_threads, s.nice) for s in resolved.stages] == [(1, 10), (1, 5), (1, 0)]


@pytest.mark.parametrize(
    "overrides",
    [("thinker.placement=inline", "talker.placement=inline"), ("thinker.placement=inline", "thinker.replicas=2")],
)
def test_two_vllm_engines_in_one_process_are_refused_at_resolve(tiny_dir: Path, overrides: tuple[str, ...]) -> None:
    # vLLM's process-wide state breaks a second in-process engine (seen: "Engram tensor-parallel
    # group is already initialized" at load, or another engine's layers at the first request).
    with pytest.raises(ConfigError, match="the 'ar' runtime allows 1 in one process") as info:
        resolve(str(tiny_dir), overrides=overrides)
    assert info.value.key.endswith(".placement")
    resolve(str(tiny_dir), overrides=overrides[:1])  # one inline engine is fine


def test_thinker_only_checkpoint_gives_a_text_pipeline(thinker_only_dir: Path, tiny_dir: Path) -> None:
    host = load_plugins(allowlist=(), entry_points=[], extra_plugins=[plugin])
    family = host.family_for(str(thinker_only_dir), read_hf_config(thinker_only_dir))
    assert family.name == "qwen3-omni"
    pipeline = build_pipeline(str(thinker_only_dir), read_hf_config(thinker_only_dir))
    assert [(s.name, s.final, s.output) for s in pipeline.stages] == [("thinker", True, "text")]
    # No im_end_token_id in a thinker config: the tokenizer's id is used.
    assert pipeline.stages[0].params["stop_token_ids"] == [read_hf_config(tiny_dir)["im_end_token_id"]]
    resolved = resolve(str(thinker_only_dir))
    assert [s.name for s in resolved.stages] == ["thinker"]


def test_processor_builds_the_reference_prompt(processor: Qwen3OmniInputProcessor, tiny_dir: Path) -> None:
    messages = [{"role": "user", "content": [{"type": "audio", "audio": sine_wave(1.0)},
                                              {"type": "image", "image": synthetic_image(64, 96)},
                                              {"type": "text", "text": "What is this?"}]}]
    inputs = processor.process(OmniRequest(messages=messages, modalities=("text",)))
    thinker = inputs["thinker"].data
    expected = prepare_inputs(tiny_dir, messages)["input_ids"][0].tolist()
    config = read_hf_config(tiny_dir)["thinker_config"]
    # One placeholder per item (vLLM expands them); the same prompt otherwise.
    collapsed = [t for i, t in enumerate(expected) if t not in (config["audio_token_id"], config["image_token_id"])
                 or expected[i - 1] != t]
    assert thinker["prompt_token_ids"] == collapsed
    assert len(thinker["multi_modal_data"]["audio"]) == 1 and thinker["multi_modal_data"]["audio"][0][1] == 16000
    assert len(thinker["multi_modal_data"]["image"]) == 1
    assert thinker["capture_hidden"] is False  # text only: the talker does not run
    # The expanded length the processor checks equals the reference's prompt length.
    audio, image = thinker["multi_modal_data"]["audio"][0][0], thinker["multi_modal_data"]["image"][0]
    assert len(collapsed) + processor._audio_tokens(audio) - 1 + processor._image_tokens(image) - 1 == len(expected)
    assert inputs["talker"].params == {"speaker": "Ethan"}


def test_voice_and_speech_task(processor: Qwen3OmniInputProcessor) -> None:
    inputs = processor.process(OmniRequest(prompt="Read me.", modalities=("text", "audio"), extra={"voice": "Chelsie", "task": "speech"}))
    assert inputs["talker"].params == {"speaker": "Chelsie"}
    assert inputs["thinker"].data["capture_hidden"] is True
    prompt = processor.tokenizer.decode(inputs["thinker"].data["prompt_token_ids"])
    assert prompt.startswith(f"<|im_start|>system\n{SPEECH_SYSTEM_PROMPT}<|im_end|>")
    assert "<|im_start|>user\nRead me.<|im_end|>" in prompt
    with pytest.raises(InvalidRequestError, match="voice"):
        processor.process(OmniRequest(prompt="hi", extra={"voice": "Nobody"}))
    with pytest.raises(InvalidRequestError, match="text"):
        processor.process(OmniRequest(prompt="  ", extra={"task": "speech"}))


def test_audio_formats_and_resampling(processor: Qwen3OmniInputProcessor) -> None:
    import soundfile

    t = np.arange(44100) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 440 * t)], axis=1).astype(np.float32) * 0.5
    for fmt in ("WAV", "FLAC"):
        buffer = io.BytesIO()
        soundfile.write(buffer, stereo, 44100, format=fmt)
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(), "format": fmt.lower()}}
        data = processor.process(OmniRequest(messages=[{"role": "user", "content": [part]}]))["thinker"].data
        audio, rate = data["multi_modal_data"]["audio"][0]
        assert rate == 16000 and audio.shape == (16000,)
        expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
        assert np.abs(audio[100:-100] - expected[100:-100]).max() < 2e-3  # FLAC is 16-bit
    # Band-limited: a tone below the new Nyquist survives resampling unchanged in frequency.
    assert resample(np.ones(480, dtype=np.float32), 48000, 16000).shape == (160,)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}]}], "base64"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "image"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "wav"}}]}], "cannot decode the audio"),
        ([{"role": "user", "content": [{"type": "audio", "audio": np.zeros(0)}]}], "non-empty"),
        ([{"role": "user", "content": 5}], "string or a list"),
        ([{"content": "no role"}], "role"),
        ([], "non-empty"),
    ],
)
def test_bad_messages(processor: Qwen3OmniInputProcessor, messages: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        processor.process(OmniRequest(messages=messages))
    assert " object at 0x" not in str(info.value)  # the decoders' reasons, without Python reprs


def test_oversized_image_is_refused_before_decoding(processor: Qwen3OmniInputProcessor) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (5000, 4000)).save(buffer, format="PNG")  # 20 megapixels, a small file
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(InvalidRequestError, match="5000x4000.*limited"):
        processor.process(OmniRequest(messages=messages))


def test_compat_serves_the_pil_image_module() -> None:
    """Where torchvision is missing, vLLM's qwen2_vl import chain works through the PIL twin."""
    if compat.torchvision_available():
        assert compat.install() is False  # nothing to do where torchvision works
        return
    assert compat.install() is True and compat.install() is True  # idempotent
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize

    assert smart_resize is pil.smart_resize and Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil
    # The module vLLM failed to import before the alias.
    import vllm.model_executor.models.qwen2_vl  # noqa: F401


def test_compat_is_needed_without_it(tmp_path: Path) -> None:
    """In a fresh interpreter without the alias, vLLM's thinker module fails on torchvision."""
    if compat.torchvision_available():
        pytest.skip("torchvision works here: no workaround needed")
    import subprocess

    code = "import vllm.model_executor.models.qwen2_vl"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "torchvision" in done.stderr
