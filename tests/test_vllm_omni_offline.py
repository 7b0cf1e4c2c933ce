"""vLLM-Omni's offline call on ``omni-tiny/qwen3-omni``: ``Omni(model=...).generate(inputs,
sampling_params_list)`` with the input dicts of vLLM-Omni's Qwen3-Omni example
(examples/offline_inference/qwen3_omni/end2end.py: a prompt already in the chat format, with one
placeholder per item of ``multi_modal_data``) and one vLLM `SamplingParams` per stage gives what
Omni's own call (chat messages, ``params_per_stage`` by stage name) gives, greedy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from omni_core.engine.offline import Omni
from omni_core.engine.vllm_outputs import vllm_omni_outputs
from omni_core.errors import InvalidRequestError, OmniError

pytestmark = pytest.mark.vllm

MODEL = "omni-tiny/qwen3-omni"
SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory and "
    "visual inputs, as well as generating text and speech."
)
TINY_IM_END, TINY_CODEC_EOS = 640, 230  # the tiny checkpoint's ids (tests/test_vllm_omni_requests.py checks them)
QUESTION = {"text": "Explain the system architecture for a scalable audio generation pipeline.", "audio": "What is the content of this audio?", "image": "What is the content of this image?"}
PLACEHOLDER = {"text": "", "audio": "<|audio_start|><|audio_pad|><|audio_end|>", "image": "<|vision_start|><|image_pad|><|vision_end|>"}


def vllm_prompt(kind: str) -> str:
    """The example's prompt text (its get_text_query / get_audio_query / get_image_query)."""
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{PLACEHOLDER[kind]}{QUESTION[kind]}<|im_end|>\n<|im_start|>assistant\n"


def sampling_params_list() -> list[Any]:
    from vllm import SamplingParams

    return [
        SamplingParams(temperature=0.0, top_k=1, max_tokens=5, repetition_penalty=1.05, stop_token_ids=[TINY_IM_END], seed=42),
        SamplingParams(temperature=0.0, top_k=50, max_tokens=16, seed=42, detokenize=False, stop_token_ids=[TINY_CODEC_EOS]),
        SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4096 * 16, seed=42, detokenize=True, repetition_penalty=1.1),
    ]


# What the list above means in Omni's own call: each SamplingParams with vLLM's defaults for what
# it leaves unset (top_p 1, repetition_penalty 1, ...: these change nothing greedy); code2wav does
# not sample, so its entry is dropped.
OWN_PARAMS = {
    "thinker": {"temperature": 0.0, "top_k": 1, "max_tokens": 5, "repetition_penalty": 1.05, "stop_token_ids": [TINY_IM_END], "seed": 42},
    "talker": {"temperature": 0.0, "top_k": 50, "max_tokens": 16, "repetition_penalty": 1.0, "seed": 42, "stop_token_ids": [TINY_CODEC_EOS]},
}


# A vLLM-Omni stage config (its documented format) for the engine: streamed (async_chunk), code2wav
# in the engine's process (runtime.process false), as Omni's own tests run it.
STAGE_CONFIG = """
async_chunk: true
stage_args:
  - stage_id: 0
    stage_type: llm
    runtime: {process: true, max_batch_size: 8}
    engine_args: {model_stage: thinker, model_arch: Qwen3OmniMoeForConditionalGeneration, enable_prefix_caching: false}
    final_output: true
    final_output_type: text
  - stage_id: 1
    stage_type: llm
    runtime: {process: true, max_batch_size: 8}
    engine_args: {model_stage: talker, model_arch: Qwen3OmniMoeForConditionalGeneration, enable_prefix_caching: false}
    engine_input_source: [0]
  - stage_id: 2
    stage_type: llm
    runtime: {process: false, max_batch_size: 8}
    engine_args: {model_stage: code2wav, worker_cls: vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker}
    engine_input_source: [1]
    final_output: true
    final_output_type: audio
"""


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Omni]:
    path = tmp_path_factory.mktemp("stage-config") / "qwen3_omni.yaml"
    path.write_text(STAGE_CONFIG, encoding="utf-8")
    with Omni(model=MODEL, stage_configs_path=path) as engine:
        assert engine.pipeline.streaming and engine.pipeline.stage("code2wav").placement == "inline"
        assert engine.pipeline.stage("thinker").options["max_num_seqs"] == 8
        health = {h["stage"]: h for h in engine.health()}  # (as the server's /health lists them)
        assert set(health) == {"thinker", "talker", "code2wav"} and all(h["healthy"] for h in health.values())
        yield engine


@pytest.fixture(scope="module")
def media() -> dict[str, Any]:
    from PIL import Image

    t = np.arange(16000) / 16000
    audio = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    return {"audio": audio, "image": image}


def own_messages(kind: str, media: dict[str, Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if kind == "audio":
        parts.append({"type": "audio", "audio": media["audio"]})
    if kind == "image":
        parts.append({"type": "image", "image": media["image"]})
    parts.append({"type": "text", "text": QUESTION[kind]})
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def test_text_prompt_gives_our_calls_text_and_audio(omni: Omni, media: dict[str, Any]) -> None:
    """No ``modalities`` in the prompt: every final output (text and audio), as vLLM-Omni."""
    (theirs,) = omni.generate({"prompt": vllm_prompt("text")}, sampling_params_list())
    (ours,) = omni.generate({"messages": own_messages("text", media)}, params_per_stage=OWN_PARAMS)
    assert theirs.prompt_token_ids == ours.prompt_token_ids
    assert theirs.token_ids == ours.token_ids and theirs.text == ours.text and len(ours.token_ids) >= 1
    assert theirs.audio is not None and ours.audio is not None and theirs.audio.shape == ours.audio.shape
    np.testing.assert_allclose(theirs.audio, ours.audio, atol=1e-4)


def test_the_examples_output_loop(omni: Omni) -> None:
    """vLLM-Omni's example reads per-stage outputs (`omni_core.engine.vllm_outputs`): its loop runs as written."""
    results = omni.generate([{"prompt": vllm_prompt("text")}, {"prompt": vllm_prompt("text"), "modalities": ["text"]}], sampling_params_list())
    texts, audios = {}, {}
    for stage_outputs in vllm_omni_outputs(results, omni.pipeline):
        if stage_outputs.final_output_type == "text":
            for output in stage_outputs.request_output:
                texts[output.request_id] = output.outputs[0].text
        elif stage_outputs.final_output_type == "audio":
            for output in stage_outputs.request_output:
                audio_numpy = output.multimodal_output["audio"].float().detach().cpu().numpy()
                audios[output.request_id] = audio_numpy.flatten()
                assert stage_outputs.stage_id == 2
    assert texts == {r.request_id: r.text for r in results}
    assert list(audios) == [results[0].request_id]
    np.testing.assert_array_equal(audios[results[0].request_id], results[0].audio)


def test_audio_and_image_prompts_as_a_list(omni: Omni, media: dict[str, Any]) -> None:
    """A list of prompts (results in order), ``multi_modal_data`` and vLLM-Omni's ``modalities`` key."""
    prompts = [
        {"prompt": vllm_prompt("audio"), "multi_modal_data": {"audio": (media["audio"], 16000)}, "modalities": ["text"]},
        {"prompt": vllm_prompt("image"), "multi_modal_data": {"image": media["image"]}, "modalities": ["text"]},
    ]
    theirs = omni.generate(prompts, sampling_params_list())
    ours = omni.generate([{"messages": own_messages(kind, media)} for kind in ("audio", "image")], modalities=["text"], params_per_stage=OWN_PARAMS)
    for mine, other in zip(ours, theirs):
        assert other.audio is None
        assert other.prompt_token_ids == mine.prompt_token_ids and other.token_ids == mine.token_ids and other.text == mine.text
    assert theirs[0].prompt_token_ids != theirs[1].prompt_token_ids


def test_audio_at_another_rate_is_resampled(omni: Omni, media: dict[str, Any]) -> None:
    """vLLM takes ``(samples, rate)``: 44.1 kHz audio is resampled to the model's 16 kHz."""
    t = np.arange(44100) / 44100
    fast = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    prompt = {"prompt": vllm_prompt("audio"), "multi_modal_data": {"audio": (fast, 44100)}, "modalities": ["text"]}
    (theirs,) = omni.generate(prompt, sampling_params_list())
    (same_rate,) = omni.generate({**prompt, "multi_modal_data": {"audio": (media["audio"], 16000)}}, sampling_params_list())
    assert theirs.prompt_token_ids == same_rate.prompt_token_ids  # one second of audio either way


BAD = {
    "placeholder without its audio": ({"prompt": vllm_prompt("audio"), "modalities": ["text"]}, "multi_modal_data", "1 audio placeholder"),
    "image without its placeholder": ({"prompt": vllm_prompt("text"), "multi_modal_data": {"image": [np.zeros((8, 8, 3))]}, "modalities": ["text"]}, "multi_modal_data", "PIL"),
    "audio without its rate": ({"prompt": vllm_prompt("audio"), "multi_modal_data": {"audio": np.zeros(1600, np.float32)}}, "multi_modal_data", "sample rate"),
    "unknown prompt key": ({"prompt": "hi", "negative_prompt": "x"}, "prompts[0].negative_prompt", "negative_prompt"),
    "no prompt": ({"multi_modal_data": {}}, "prompts[0]", "either 'prompt'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_are_typed_errors(omni: Omni, case: str) -> None:
    prompt, param, said = BAD[case]
    with pytest.raises(InvalidRequestError) as refused:
        omni.generate(prompt, sampling_params_list())
    assert refused.value.param == param and said in str(refused.value)


def test_bad_sampling_params_lists(omni: Omni) -> None:
    prompt = {"prompt": vllm_prompt("text")}
    with pytest.raises(InvalidRequestError, match="thinker, talker, code2wav") as short:
        omni.generate(prompt, sampling_params_list()[:2])
    assert short.value.param == "sampling_params_list"
    with pytest.raises(InvalidRequestError, match="'foo'") as unknown:
        omni.generate(prompt, [{"max_tokens": 2}, {"foo": 1}, {}])
    assert unknown.value.param == "sampling_params_list[1].foo"
    with pytest.raises(InvalidRequestError) as wrong:
        omni.generate(prompt, [{"max_tokens": 2}, 3, {}])
    assert wrong.value.param == "sampling_params_list[1]"


def test_stage_configs_path_with_a_deploy_is_refused() -> None:
    with pytest.raises(OmniError, match="stage_configs_path"):
        Omni(model=MODEL, deploy="x.yaml", stage_configs_path="y.yaml")
