"""vLLM-Omni's request shapes against ``omni serve omni-tiny/qwen3-omni``, with the official openai
client: ``extra_body={"sampling_params_list": [...]}`` (one entry per stage: thinker, talker,
code2wav) and ``audio_url`` parts, as vLLM-Omni's Qwen3-Omni example client sends them.

One server for the module (code2wav inline, the AR stages in their processes, as in
tests/test_server.py).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile

from omni_core.testing.live_server import LiveServer

pytestmark = pytest.mark.vllm

MODEL = "omni-tiny/qwen3-omni"
SEED = 42
SYSTEM = {
    "role": "system",
    "content": [{"type": "text", "text": "You are Qwen, a virtual human capable of perceiving auditory and visual inputs, as well as generating text and speech."}],
}
QUESTION = {"role": "user", "content": [{"type": "text", "text": "Explain the system architecture for a scalable audio generation pipeline."}]}

# The example's stop ids are the 30B checkpoint's (<|im_end|> 151645, codec end 2150); the tiny
# checkpoint's vocabularies are smaller (vLLM refuses out-of-vocab stop ids), and its ids are these.
TINY_IM_END, TINY_CODEC_EOS = 640, 230

# The example client's defaults (thinker, talker, code2wav), its stop ids made the tiny's.
EXAMPLE_SAMPLING_PARAMS_LIST = [
    {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 16384, "repetition_penalty": 1.05, "stop_token_ids": [TINY_IM_END], "seed": SEED},
    {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": SEED, "detokenize": False, "repetition_penalty": 1.05, "stop_token_ids": [TINY_CODEC_EOS]},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4096 * 16, "seed": SEED, "detokenize": True, "repetition_penalty": 1.1},
]

# The same shape, greedy and with short lengths, so that the other tests are quick and exact.
THINKER = {"temperature": 0.0, "top_p": 0.9, "top_k": 1, "max_tokens": 6, "repetition_penalty": 1.05, "stop_token_ids": [TINY_IM_END], "seed": SEED}
TALKER = {"temperature": 0.0, "top_k": 50, "max_tokens": 24, "seed": SEED, "detokenize": False, "repetition_penalty": 1.05, "stop_token_ids": [TINY_CODEC_EOS]}
CODE2WAV = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4096 * 16, "seed": SEED, "detokenize": True, "repetition_penalty": 1.1}
SAMPLING_PARAMS_LIST = [THINKER, TALKER, CODE2WAV]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer.start(MODEL, args=["--set", "code2wav.placement=inline"])
    try:
        yield live
    finally:
        live.close()


def test_tiny_stop_ids() -> None:
    from omni_core.config.modelref import read_hf_config, resolve_model_path
    from omni_core.plugins import default_plugins

    config = read_hf_config(resolve_model_path(MODEL, default_plugins()))
    assert config["talker_config"]["codec_eos_token_id"] == TINY_CODEC_EOS
    assert config["im_end_token_id"] == TINY_IM_END


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def _wav_data_url(seconds: float = 0.5, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def _png_data_url() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _assert_text_and_audio(completion: Any) -> None:
    message = completion.choices[0].message
    assert message.content, "no text"
    assert message.audio is not None, "no audio"
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    assert rate > 0 and samples.ndim == 1 and len(samples) > 0


def _create(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)  # type: ignore[call-overload]


# -- the example's shapes ---------------------------------------------------------------------------


def test_text_query_with_the_example_defaults_returns_text_and_audio(client: openai.OpenAI) -> None:
    """The example sends no ``modalities``: a list for every stage runs every stage."""
    _assert_text_and_audio(_create(client, [SYSTEM, QUESTION], extra_body={"sampling_params_list": EXAMPLE_SAMPLING_PARAMS_LIST}))
    completion = _create(client, [SYSTEM, QUESTION], extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST})
    _assert_text_and_audio(completion)
    assert completion.usage is not None and completion.usage.completion_tokens <= THINKER["max_tokens"]


def test_audio_url_query(client: openai.OpenAI) -> None:
    """An ``audio_url`` data URL is the same input as the ``input_audio`` part with its bytes."""
    url = _wav_data_url()
    ask = {"type": "text", "text": "What is the content of this audio?"}
    by_url = _create(client, [SYSTEM, {"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": url}}, ask]}], extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST})
    _assert_text_and_audio(by_url)
    data = url.partition(",")[2]
    by_data = _create(client, [SYSTEM, {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}, ask]}], extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST})
    without = _create(client, [SYSTEM, {"role": "user", "content": [ask]}], extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST})
    assert by_url.usage is not None and by_data.usage is not None and without.usage is not None
    assert by_url.usage.prompt_tokens == by_data.usage.prompt_tokens > without.usage.prompt_tokens
    assert by_url.choices[0].message.content == by_data.choices[0].message.content


def test_image_url_query(client: openai.OpenAI) -> None:
    image = {"type": "image_url", "image_url": {"url": _png_data_url()}}
    completion = _create(client, [SYSTEM, {"role": "user", "content": [image, {"type": "text", "text": "What is the content of this image?"}]}], extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST})
    _assert_text_and_audio(completion)


def test_without_sampling_params_list(client: openai.OpenAI) -> None:
    """Without the list the stages' defaults apply, and OpenAI's default modalities (text) unless
    the request names them (vLLM-Omni's defaults per family: issue 23, not done yet)."""
    text_only = _create(client, [SYSTEM, QUESTION], max_tokens=4)
    assert text_only.choices[0].message.content and text_only.choices[0].message.audio is None
    both = _create(client, [SYSTEM, QUESTION], max_tokens=4, modalities=["text", "audio"], extra_body={"stage_params": {"talker": {"max_tokens": 24}}})
    _assert_text_and_audio(both)


# -- the parameters take effect ---------------------------------------------------------------------


def _thinker_tokens(client: openai.OpenAI, thinker: dict[str, Any], **kwargs: Any) -> int:
    completion = _create(client, [QUESTION], modalities=["text"], extra_body={"sampling_params_list": [thinker, TALKER, CODE2WAV], **kwargs.pop("extra", {})}, **kwargs)
    assert completion.usage is not None
    return int(completion.usage.completion_tokens)


def test_thinker_entry_sets_the_thinker(client: openai.OpenAI) -> None:
    # ignore_eos: a random-weight model may otherwise stop early, and the counts would prove nothing.
    assert _thinker_tokens(client, {"max_tokens": 3, "ignore_eos": True}) == 3
    # The stage's own entry wins over the top-level field; stage_params win over the entry.
    assert _thinker_tokens(client, {"max_tokens": 3, "ignore_eos": True}, max_tokens=6) == 3
    assert _thinker_tokens(client, {"max_tokens": 3, "ignore_eos": True}, extra={"stage_params": {"thinker": {"max_tokens": 2}}}) == 2
    # Keys that steer only vLLM-Omni's engine are accepted and ignored.
    assert _thinker_tokens(client, {"max_tokens": 2, "ignore_eos": True, "detokenize": True, "output_kind": 2}) == 2


def test_talker_entry_sets_the_talker(client: openai.OpenAI) -> None:
    """The talker's max_tokens bounds the codec frames, hence the audio's length."""

    def samples(talker_tokens: int) -> int:
        talker = {**TALKER, "max_tokens": talker_tokens}
        completion = _create(client, [QUESTION], modalities=["text", "audio"], extra_body={"sampling_params_list": [THINKER, talker, CODE2WAV]})
        assert completion.choices[0].message.audio is not None
        return len(soundfile.read(io.BytesIO(base64.b64decode(completion.choices[0].message.audio.data)))[0])

    short, long = samples(8), samples(24)
    assert 0 < short < long


# -- 400s -------------------------------------------------------------------------------------------

BAD = {
    "too-short": ({"sampling_params_list": [THINKER, TALKER]}, "sampling_params_list", "3 stages"),
    "too-long": ({"sampling_params_list": [THINKER, TALKER, CODE2WAV, {}]}, "sampling_params_list", "thinker, talker, code2wav"),
    "not-an-object": ({"sampling_params_list": [THINKER, 1, CODE2WAV]}, "sampling_params_list[1]", "talker"),
    "unknown-key": ({"sampling_params_list": [THINKER, {**TALKER, "foo": 1}, CODE2WAV]}, "sampling_params_list[1].foo", "foo"),
    "unknown-key-on-code2wav": ({"sampling_params_list": [THINKER, TALKER, {"bar": 1}]}, "sampling_params_list[2].bar", "bar"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sampling_params_list(server: LiveServer, case: str) -> None:
    extra, param, named = BAD[case]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [QUESTION], **extra}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"] and error["type"] == "invalid_request_error"


URL_CASES = {
    "audio-https": ("audio_url", "https://example.com/mary_had_lamb.ogg", "--allowed-media-domains"),
    "audio-file": ("audio_url", "file:///tmp/a.wav", "--allowed-local-media-path"),
    "image-https": ("image_url", "https://example.com/cherry_blossom.jpg", "only data: URLs"),
    "video-file": ("video_url", "file:///mnt/video.mp4", "only data: URLs"),
    "audio-not-base64": ("audio_url", "data:audio/wav,RIFF", "base64"),
    "audio-not-audio": ("audio_url", "data:image/png;base64,iVBORw0KGgo=", "must carry audio"),
}


@pytest.mark.parametrize("case", list(URL_CASES))
def test_media_urls_other_than_data_are_refused(client: openai.OpenAI, case: str) -> None:
    kind, url, said = URL_CASES[case]
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, [{"role": "user", "content": [{"type": kind, kind: {"url": url}}, {"type": "text", "text": "hi"}]}])
    assert refused.value.param == f"messages[0].content[0].{kind}.url"
    assert said in str(refused.value.message)
