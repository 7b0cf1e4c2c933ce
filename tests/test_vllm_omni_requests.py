"""vLLM-Omni's request shapes against ``omni serve omni-tiny/qwen3-omni``, with the official openai
client: ``extra_body={"sampling_params_list": [...]}`` (one entry per stage: thinker, talker,
code2wav) and ``audio_url`` parts, as vLLM-Omni's Qwen3-Omni example client sends them.

One server for the module (code2wav inline, the AR stages in their processes, as in
tests/test_server.py), started with vLLM's operator flags for media URLs: ``file://`` under a
temporary directory and ``http://`` from a media server on 127.0.0.1 (with a small size and time
limit). The same server checks what hostile input gets: unknown stage parameters of every stage
(ar, generation) refused with a status code before a stream starts, a 20 MB prompt refused before
it is tokenized, a PNG declaring a huge size refused before it is decoded, and deeply nested JSON.
"""

from __future__ import annotations

import base64
import functools
import io
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
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


# The server's media limits (--max-media-mb, --media-fetch-timeout) and the media server's slow answer.
MEDIA_MB = 0.25
FETCH_TIMEOUT_S = 1.0
SLOW_S = 6.0


class MediaHandler(SimpleHTTPRequestHandler):
    """Serves the media directory's ``allowed/`` files, plus ``/big`` (over the server's size
    limit) and ``/slow`` (answers after `SLOW_S`)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path in ("/big", "/slow"):
            if self.path == "/slow":
                time.sleep(SLOW_S)
            body = b"\0" * (int(MEDIA_MB * 1024 * 1024) + 1 if self.path == "/big" else 16)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``allowed/`` (the server's --allowed-local-media-path: an image, a wav, a symlink to
    ``outside/``) and ``outside/``."""
    root = tmp_path_factory.mktemp("media")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "image.png").write_bytes(base64.b64decode(_png_data_url().partition(",")[2]))
    (allowed / "audio.wav").write_bytes(base64.b64decode(_wav_data_url().partition(",")[2]))
    (outside / "secret.png").write_bytes((allowed / "image.png").read_bytes())
    (allowed / "link.png").symlink_to(outside / "secret.png")
    return root


@pytest.fixture(scope="module")
def media_url(media_dir: Path) -> Iterator[str]:
    """The base URL of a real HTTP server on 127.0.0.1 serving `MediaHandler`."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(MediaHandler, directory=str(media_dir / "allowed")))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(media_dir: Path, media_url: str) -> Iterator[LiveServer]:
    # vLLM's spelling: several hosts after one --allowed-media-domains.
    operator = [
        "--allowed-local-media-path", str(media_dir / "allowed"), "--allowed-media-domains", "127.0.0.1", "media.invalid",
        "--max-media-mb", str(MEDIA_MB), "--media-fetch-timeout", str(FETCH_TIMEOUT_S),
    ]
    live = LiveServer.start(MODEL, args=["--set", "code2wav.placement=inline", *operator])
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


def _mp4_data_url(with_sound: bool) -> str:
    from omni_qwen3.reference import moving_frames, mp4_bytes, sine_wave

    raw = mp4_bytes(moving_frames(5), fps=4, audio=sine_wave(1.25, 330.0) if with_sound else None)
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def test_video_url_query(client: openai.OpenAI) -> None:
    """The example's video query: a ``video_url`` part (here a data URL of an MP4)."""
    video = {"type": "video_url", "video_url": {"url": _mp4_data_url(with_sound=False)}}
    ask = {"type": "text", "text": "Describe the video briefly."}
    completion = _create(client, [SYSTEM, {"role": "user", "content": [video, ask]}], extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST})
    _assert_text_and_audio(completion)
    without = _create(client, [SYSTEM, {"role": "user", "content": [ask]}], extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST})
    assert completion.usage is not None and without.usage is not None
    assert completion.usage.prompt_tokens > without.usage.prompt_tokens  # the frames became prompt tokens


def test_audio_in_video_query(client: openai.OpenAI) -> None:
    """The example's ``use_audio_in_video``: the MP4's sound track is read too (more prompt tokens)."""
    video = {"type": "video_url", "video_url": {"url": _mp4_data_url(with_sound=True)}}
    messages = [SYSTEM, {"role": "user", "content": [video, {"type": "text", "text": "What can you hear and see?"}]}]
    with_sound = _create(client, messages, extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST, "mm_processor_kwargs": {"use_audio_in_video": True}})
    _assert_text_and_audio(with_sound)
    frames_only = _create(client, messages, extra_body={"sampling_params_list": SAMPLING_PARAMS_LIST})
    assert with_sound.usage is not None and frames_only.usage is not None
    assert with_sound.usage.prompt_tokens > frames_only.usage.prompt_tokens


def test_without_sampling_params_list_or_modalities(client: openai.OpenAI) -> None:
    """Without the list the stages' defaults apply; without ``modalities`` the answer is what
    vLLM-Omni gives for Qwen3-Omni: every final stage's output (its stage config's thinker, text,
    and code2wav, audio). ``modalities`` narrows it, as there."""
    # Greedy, and a short talker: random weights never end the audio.
    short_talker = {"stage_params": {"talker": {"max_tokens": 24, "temperature": 0.0}}}
    both = _create(client, [SYSTEM, QUESTION], max_tokens=4, temperature=0.0, extra_body=short_talker)
    _assert_text_and_audio(both)
    named = _create(client, [SYSTEM, QUESTION], max_tokens=4, temperature=0.0, modalities=["text", "audio"], extra_body=short_talker)
    assert named.choices[0].message.content == both.choices[0].message.content
    assert named.choices[0].message.audio is not None and both.choices[0].message.audio is not None
    # The same codec frames (greedy talker), hence as long a waveform (its float rounding may vary with batching).
    assert len(base64.b64decode(named.choices[0].message.audio.data)) == len(base64.b64decode(both.choices[0].message.audio.data))
    text_only = _create(client, [SYSTEM, QUESTION], max_tokens=4, modalities=["text"])
    assert text_only.choices[0].message.content and text_only.choices[0].message.audio is None


# -- the parameters take effect ---------------------------------------------------------------------


def _thinker_tokens(client: openai.OpenAI, thinker: dict[str, Any], **kwargs: Any) -> int:
    # Seeded: ignore_eos does not cover the family's stop token (<|im_end|>), which an unseeded draw
    # of the random-weight model may sample, depending on what ran before.
    thinker = {"seed": SEED, **thinker}
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


# -- media URLs the operator allowed (--allowed-local-media-path, --allowed-media-domains) ----------


def _greedy_answer(client: openai.OpenAI, part: dict[str, Any]) -> tuple[int, str]:
    completion = _create(client, [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}], modalities=["text"], max_tokens=4, temperature=0.0)
    assert completion.usage is not None
    return completion.usage.prompt_tokens, completion.choices[0].message.content


@pytest.mark.parametrize("kind", ["image_url", "audio_url"])
def test_allowed_file_and_http_urls_give_the_model_the_same_bytes(client: openai.OpenAI, media_dir: Path, media_url: str, kind: str) -> None:
    """An allowed ``file://`` or ``http://`` medium is the same input as its bytes sent inline."""
    name, inline = ("image.png", _png_data_url()) if kind == "image_url" else ("audio.wav", _wav_data_url())
    answers = [
        _greedy_answer(client, {"type": kind, kind: {"url": url}})
        for url in (inline, f"{media_url}/{name}", (media_dir / "allowed" / name).as_uri())
    ]
    assert answers[0] == answers[1] == answers[2], answers
    without = _create(client, [{"role": "user", "content": "What is this?"}], modalities=["text"], max_tokens=1)
    assert without.usage is not None and answers[0][0] > without.usage.prompt_tokens  # the medium is in the prompt


def _operator_cases(media_dir: Path, media_url: str) -> dict[str, tuple[str, str]]:
    port = media_url.rsplit(":", 1)[1]
    allowed = media_dir / "allowed"
    return {
        "host not allowed": (f"http://localhost:{port}/image.png", "--allowed-media-domains: 127.0.0.1, media.invalid"),
        "too large": (f"{media_url}/big", f"limited to {int(MEDIA_MB * 1024 * 1024)} bytes"),
        "too slow": (f"{media_url}/slow", f"longer than the limit of {FETCH_TIMEOUT_S:g} s"),
        "file outside": ((media_dir / "outside" / "secret.png").as_uri(), "resolves outside it"),
        "symlink out": ((allowed / "link.png").as_uri(), "resolves outside it"),
        "dot-dot out": (f"file://{allowed}/../outside/secret.png", "resolves outside it"),
    }


@pytest.mark.parametrize("case", ["host not allowed", "too large", "too slow", "file outside", "symlink out", "dot-dot out"])
def test_media_urls_beyond_what_the_operator_allowed_are_refused(client: openai.OpenAI, media_dir: Path, media_url: str, case: str) -> None:
    url, said = _operator_cases(media_dir, media_url)[case]
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}])
    assert time.monotonic() - started < SLOW_S - 1  # the slow server is cut off at the time limit
    assert refused.value.param == "messages[0].content[0].image_url.url"
    assert said in str(refused.value.message), refused.value.message


# -- hostile input ----------------------------------------------------------------------------------

UNKNOWN_STAGE_PARAMS = {
    "thinker (ar)": ({"thinker": {"bogus": 1}}, "stage_params.thinker.bogus"),
    "talker (ar, after the thinker)": ({"talker": {"bogus": 1}}, "stage_params.talker.bogus"),
    "code2wav (generation)": ({"code2wav": {"bogus": 1}}, "stage_params.code2wav.bogus"),
    "unknown stage": ({"vocoder": {"max_tokens": 1}}, "stage_params.vocoder"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(UNKNOWN_STAGE_PARAMS))
def test_unknown_stage_params_are_a_400_before_any_stream(server: LiveServer, case: str, stream: bool) -> None:
    """Refused with a status code, not with an error event in a 200 stream, whichever stage it is for."""
    stage_params, param = UNKNOWN_STAGE_PARAMS[case]
    body = {"model": MODEL, "messages": [QUESTION], "modalities": ["text", "audio"], "max_tokens": 2, "stream": stream, "stage_params": stage_params}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert error["param"] == param and param.rsplit(".", 1)[1] in error["message"] and error["type"] == "invalid_request_error"


def test_a_20_mb_prompt_is_refused_before_tokenizing(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 3_500_000}]}
    started = time.monotonic()
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert time.monotonic() - started < 5.0
    assert response.status_code == 400 and response.json()["error"]["code"] == "prompt_too_long", response.text
    speech = httpx.post(f"{server.url}/v1/audio/speech", json={"model": MODEL, "input": "hello " * 3_500_000}, timeout=60)
    assert speech.status_code == 400 and speech.json()["error"]["param"] == "input", speech.text


def test_an_image_declaring_a_huge_size_is_refused_before_decoding(client: openai.OpenAI) -> None:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    # 30000 x 30000 pixels declared in a 100-byte file.
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(b"\0" * 8)) + chunk(b"IEND", b"")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], max_tokens=1)
    assert time.monotonic() - started < 5.0
    assert "900000000 pixels" in str(refused.value.message) and "limited to 16777216 pixels" in str(refused.value.message)


def test_deeply_nested_json_is_a_400_on_every_post_route(server: LiveServer) -> None:
    document = httpx.get(f"{server.url}/schema/openapi.json", timeout=30).json()
    routes = [path for path, methods in document["paths"].items() if "post" in methods]
    assert "/v1/chat/completions" in routes and "/v1/videos" in routes
    for route in routes:
        for body in (b"[" * 100_000, b'{"model": ' + b"[" * 100_000):
            response = httpx.post(f"{server.url}{route}", content=body, headers={"content-type": "application/json"}, timeout=30)
            assert response.status_code == 400, (route, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
