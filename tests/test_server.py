"""The OpenAI-compatible server end to end: a real ``omni serve`` process on a loopback port, driven
by the official ``openai`` client and by httpx (raw SSE, error bodies, /metrics).

The served model is the `served` fixture: ``omni-tiny/toy`` and ``omni-tiny/qwen3-omni`` by default;
``OMNI_SERVER_TEST_MODELS`` picks others (each needs an entry in `CASES`). The toy's outputs are
checked against a reference run of the same tiny weights in transformers (greedy), and its audio
against its decoder run in one piece (Qwen3-Omni's equality with transformers is tested at the
engine level, plugins/omni-qwen3/tests/test_e2e.py).

Servers are shared per module: one with every stage inline (fast to start), one with the default
process placement and an API key (auth, client disconnects, SIGTERM), and one (process placement,
key from the environment) started by the SIGINT test itself.
"""

from __future__ import annotations

import base64
import glob
import io
import json
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Callable, Iterator

import attrs
import httpx
import numpy as np
import openai
import pytest
import soundfile

from omni_core.testing.live_server import LiveServer, launch_env, leftover_processes, omni_command

pytestmark = pytest.mark.vllm

MODELS_ENV = "OMNI_SERVER_TEST_MODELS"
API_KEY = "sk-test-omni"
PROMPT = [{"role": "user", "content": "Once upon a time there was a little robot"}]
MAX_TOKENS = 10
PCM16_STEP = 1.0 / 32767.0  # one 16-bit quantization step in float samples


@attrs.frozen
class Reference:
    """What the served model must answer for a prompt under greedy decoding."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    audio: np.ndarray | None
    sample_rate: int | None
    log_softmax: np.ndarray | None = None  # [steps, vocab]: each generated token's distribution


@attrs.frozen
class ServedModel:
    """What the tests need to know about one served pipeline.

    - `text_stage`: the AR stage whose parameters top-level sampling fields go to.
    - `inline`: ``--set`` overrides that put every stage inline (the fast test server).
    - `modalities`: what the model produces (error messages must name them); `voice`: one it has.
    - `greedy_stage_params`: stage_params that make every stage after the first deterministic too
      (top-level ``temperature`` reaches only the first AR stage).
    - `failing_stage_params`: stage_params that make a stage fail on purpose (a test hook), or None.
    - `rejecting_stage_params`: stage_params that make a later stage reject the request's input
      while it runs (a test hook: its model's per-item check), or None.
    - `unsupported_part`: a content part the model does not take, or None.
    - `mm_processor_kwargs`: (a valid, an invalid) ``mm_processor_kwargs`` for its input
      processor, or None where the family reads none.
    - `reference`: greedy reference for (messages, max_tokens), or None to skip those comparisons.
    - `long_tokens`: the text stage's tokens for a request that must still run when the client leaves
      or a stage is killed (a few seconds: the disconnect tests scale their waits by its duration).
    """

    model: str
    text_stage: str
    inline: tuple[str, ...]
    modalities: tuple[str, ...]
    voice: str = "default"
    long_tokens: int = 200
    greedy_stage_params: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    failing_stage_params: dict[str, dict[str, Any]] | None = None
    rejecting_stage_params: dict[str, dict[str, Any]] | None = None
    unsupported_part: dict[str, Any] | None = None
    mm_processor_kwargs: tuple[dict[str, Any], dict[str, Any]] | None = None
    reference: Callable[[list[dict[str, str]], int], Reference] | None = None
    # greedy reference of a raw completion: (prompt, max_tokens) -> (the prompt's token ids, the text)
    completion_reference: Callable[[str, int], tuple[list[int], str]] | None = None


def _toy_root() -> Any:
    from omni_core.config.modelref import resolve_model_path
    from omni_core.plugins import default_plugins

    return resolve_model_path("omni-tiny/toy", default_plugins())


def _toy_greedy(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers greedy generation on the toy LM: the new tokens and each one's log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(_toy_root() / "lm", dtype=torch.float32).eval()
    with torch.inference_mode():
        out = lm.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1).numpy()


def _toy_reference(messages: list[dict[str, str]], max_tokens: int) -> Reference:
    """transformers greedy generation on the toy LM, then the toy vocoder over all tokens at once."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from omni_toy.vocoder import WEIGHTS_NAME, ToyVocoderNet, VocoderConfig

    root = _toy_root()
    tokenizer = AutoTokenizer.from_pretrained(root / "lm")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    token_ids, log_softmax = _toy_greedy(prompt_ids, max_tokens)
    config = VocoderConfig.read(root / "vocoder")
    net = ToyVocoderNet(config)
    net.load_state_dict(load_file(str(root / "vocoder" / WEIGHTS_NAME)))
    with torch.inference_mode():
        audio = net.eval()(net.features(torch.tensor([token_ids])))[0].numpy()
    return Reference(prompt_ids, token_ids, tokenizer.decode(token_ids, skip_special_tokens=True), audio, config.sample_rate, log_softmax)


def _toy_completion(prompt: str, max_tokens: int) -> tuple[list[int], str]:
    """The toy LM continuing `prompt` as it is (tokenized as vLLM tokenizes a completion's prompt), greedy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_toy_root() / "lm")
    prompt_ids = tokenizer(prompt).input_ids
    return prompt_ids, tokenizer.decode(_toy_greedy(prompt_ids, max_tokens)[0], skip_special_tokens=True)


CASES = {
    "omni-tiny/toy": ServedModel(
        model="omni-tiny/toy",
        text_stage="lm",
        inline=("lm.placement=inline", "vocoder.placement=inline"),
        modalities=("text", "audio"),
        failing_stage_params={"vocoder": {"fail": "stage"}},
        rejecting_stage_params={"vocoder": {"fail": "request"}},
        unsupported_part={"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        reference=_toy_reference,
        completion_reference=_toy_completion,
    ),
    "omni-tiny/qwen3-omni": ServedModel(
        model="omni-tiny/qwen3-omni",
        text_stage="thinker",
        # Two vLLM engines inline in one process fail here ("Engram tensor-parallel group is already
        # initialized"): the AR stages keep their own processes.
        inline=("code2wav.placement=inline",),
        modalities=("text", "audio"),
        voice="chelsie",
        long_tokens=600,  # ~2 s (random weights emit a stop token after ~120: `_long` sets min_tokens)
        # Random weights never emit the codec's end token: cap the talker (transformers' default is 4096).
        greedy_stage_params={"thinker": {"temperature": 0.0}, "talker": {"temperature": 0.0, "max_tokens": 40}},
        mm_processor_kwargs=({"use_audio_in_video": True}, {"use_audio_in_video": "yes"}),
    ),
}


def _selected_models() -> list[str]:
    return [m.strip() for m in os.environ.get(MODELS_ENV, "omni-tiny/toy,omni-tiny/qwen3-omni").split(",") if m.strip()]


@pytest.fixture(scope="module", params=_selected_models())
def served(request: pytest.FixtureRequest) -> ServedModel:
    if request.param not in CASES:
        pytest.fail(f"no test case for {request.param!r}: add a ServedModel to CASES in {__file__}")
    return CASES[request.param]


@pytest.fixture(scope="module")
def reference(served: ServedModel) -> Reference | None:
    return served.reference(PROMPT, MAX_TOKENS) if served.reference else None


def _set_args(overrides: tuple[str, ...]) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


@pytest.fixture(scope="module")
def inline_server(served: ServedModel) -> Iterator[LiveServer]:
    """Every stage inline, no API key, 1 MB body limit."""
    server = LiveServer.start(served.model, args=[*_set_args(served.inline), "--max-body-mb", "1"])
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def process_server(served: ServedModel) -> Iterator[LiveServer]:
    """The default deploy (a worker process per stage), with ``--api-key``."""
    server = LiveServer.start(served.model, api_key=API_KEY)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=["inline", "process"])
def any_server(request: pytest.FixtureRequest) -> LiveServer:
    return request.getfixturevalue(f"{request.param}_server")


# -- helpers ---------------------------------------------------------------------------------------


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "unused", max_retries=0, timeout=120)


def _long(served: ServedModel) -> dict[str, dict[str, Any]]:
    """stage_params of a request that runs `long_tokens` text tokens: ``ignore_eos`` alone still stops at
    the generation config's other stop tokens, which random weights emit early; ``min_tokens`` does not."""
    n = served.long_tokens
    return {served.text_stage: {"max_tokens": n, "min_tokens": n, "ignore_eos": True}}


def _headers(server: LiveServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}


def _chat_body(served: ServedModel, **extra: Any) -> dict[str, Any]:
    base = {"model": served.model, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if served.greedy_stage_params:
        base["stage_params"] = served.greedy_stage_params
    return {**base, **extra}


def _sse_data(response: httpx.Response) -> list[str]:
    """The `data` of every event of a server-sent-event stream, in order."""
    return [line[len("data:") :].strip() for line in response.iter_lines() if line.startswith("data:")]


def _read_wav(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    return samples, rate


def _pcm16(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<i2").astype(np.float32) / 32767.0


def _assert_error_body(response: httpx.Response, status: int | range) -> dict[str, Any]:
    statuses = status if isinstance(status, range) else range(status, status + 1)
    assert response.status_code in statuses, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def _metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value in Prometheus text (0 when absent): ``name{labels} value``."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == key:
            return float(value)
    return 0.0


def _complete_ok(server: LiveServer, served: ServedModel) -> None:
    """The server still answers a normal request."""
    response = httpx.post(f"{server.url}/v1/chat/completions", json=_chat_body(served, max_tokens=2), headers=_headers(server), timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


# -- chat ------------------------------------------------------------------------------------------


def test_models_health_and_no_key_needed(inline_server: LiveServer, served: ServedModel) -> None:
    models = _client(inline_server).models.list()
    assert [m.id for m in models.data] == [served.model]
    # vLLM's fields: the checkpoint directory, the text stage's context (its max_model_len)
    from omni_core.config import resolve

    resolved = resolve(served.model, overrides=served.inline)
    card = models.data[0].model_extra or {}
    assert card["root"] == str(resolved.model_path) and card["max_model_len"] == resolved.stage(served.text_stage).options["max_model_len"]
    # Without --api-key, /v1 routes need no Authorization header.
    assert httpx.get(f"{inline_server.url}/v1/models").status_code == 200
    health = httpx.get(f"{inline_server.url}/health").json()
    assert health["status"] == "ok" and health["replicas"]
    assert all(r["healthy"] and r["ready"] and r["active_requests"] == 0 for r in health["replicas"])


def test_chat_text_matches_reference(inline_server: LiveServer, served: ServedModel, reference: Reference | None) -> None:
    completion = _client(inline_server).chat.completions.create(
        model=served.model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, modalities=["text"]
    )
    choice = completion.choices[0]
    assert choice.message.content and choice.message.audio is None
    assert choice.message.role == "assistant"
    usage = completion.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 1 <= usage.completion_tokens <= MAX_TOKENS
    assert choice.finish_reason in (("length", "stop") if usage.completion_tokens == MAX_TOKENS else ("stop",))
    if reference is not None:
        assert usage.prompt_tokens == len(reference.prompt_token_ids)
        assert usage.completion_tokens == len(reference.token_ids)
        assert choice.message.content == reference.text
        # OpenAI's logit_bias reaches vLLM's sampler: -100 on the greedy first token takes it out.
        banned = _client(inline_server).chat.completions.create(
            model=served.model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, modalities=["text"],
            logit_bias={str(reference.token_ids[0]): -100},
        )
        assert banned.choices[0].message.content != reference.text


def test_chat_logprobs_match_reference(inline_server: LiveServer, served: ServedModel, reference: Reference | None) -> None:
    """OpenAI's ``logprobs``/``top_logprobs``: per generated token its logprob and the top ones, the
    same in a stream; against transformers' log-softmax of the same weights where there is a reference."""
    client = _client(inline_server)
    asked: dict[str, Any] = dict(model=served.model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, modalities=["text"], logprobs=True, top_logprobs=3)
    completion = client.chat.completions.create(**asked)
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert completion.usage is not None and len(content) == completion.usage.completion_tokens
    for entry in content:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(p <= 0.0 for p in tops)
        assert entry.logprob <= tops[0] + 1e-6  # (the likeliest by the raw logits; a penalty may pick another)
        assert entry.bytes == list(entry.token.encode("utf-8"))
    if reference is not None and reference.log_softmax is not None:
        assert len(content) == len(reference.token_ids)
        for step, entry in enumerate(content):
            expected = reference.log_softmax[step]
            assert entry.logprob == pytest.approx(float(expected[reference.token_ids[step]]), abs=1e-4), step
            likeliest = np.sort(expected)[::-1][:3]
            assert [top.logprob for top in entry.top_logprobs] == pytest.approx(likeliest.tolist(), abs=1e-4), step
    streamed = [
        (entry.token, entry.logprob)
        for chunk in client.chat.completions.create(**asked, stream=True)
        for piece in chunk.choices if piece.logprobs is not None and piece.logprobs.content
        for entry in piece.logprobs.content
    ]
    assert streamed == [(entry.token, entry.logprob) for entry in content]
    # Not asked for: none.
    assert client.chat.completions.create(**{**asked, "logprobs": None, "top_logprobs": None}).choices[0].logprobs is None


def test_chat_response_format_constrains_the_text(inline_server: LiveServer, served: ServedModel) -> None:
    """OpenAI's ``response_format`` is vLLM's structured outputs on the text stage: even random weights
    answer JSON that the schema accepts (``json_object``: a JSON object)."""
    import json

    client = _client(inline_server)
    schema = {
        "type": "object", "additionalProperties": False, "required": ["color", "n"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    }
    asked: dict[str, Any] = dict(model=served.model, messages=PROMPT, max_tokens=200, temperature=0.0, modalities=["text"])
    constrained = client.chat.completions.create(**asked, response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    choice = constrained.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content or "")
    assert set(value) == {"color", "n"} and value["color"] in ("red", "green", "blue") and value["n"] in range(10), value
    # (random weights may write one endless string under json_object: an object it starts, at least)
    anything = client.chat.completions.create(**asked, response_format={"type": "json_object"}).choices[0]
    assert (anything.message.content or "").lstrip().startswith("{"), anything
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.message.content or ""), dict), anything


def test_chat_text_and_audio(inline_server: LiveServer, served: ServedModel, reference: Reference | None) -> None:
    completion = _client(inline_server).chat.completions.create(
        model=served.model,
        messages=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        modalities=["text", "audio"],
        audio={"voice": served.voice, "format": "wav"},
        extra_body={"stage_params": served.greedy_stage_params},
    )
    message = completion.choices[0].message
    assert message.audio is not None and message.audio.id and message.audio.expires_at > time.time()
    assert message.content and message.audio.transcript == message.content
    samples, rate = _read_wav(base64.b64decode(message.audio.data))
    assert rate > 0 and samples.ndim == 1 and len(samples) > 0 and np.abs(samples).max() > 0
    for fmt in ("flac", "pcm16"):  # the other encodings carry the same samples
        other = _client(inline_server).chat.completions.create(
            model=served.model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, modalities=["text", "audio"], audio={"voice": served.voice, "format": fmt},
            extra_body={"stage_params": served.greedy_stage_params},
        )
        assert other.choices[0].message.audio is not None
        data = base64.b64decode(other.choices[0].message.audio.data)
        decoded = _pcm16(base64.b64encode(data).decode()) if fmt == "pcm16" else _read_wav(data)[0]
        np.testing.assert_allclose(decoded, samples, atol=2 * PCM16_STEP)
    if reference is not None:
        assert message.content == reference.text
        assert rate == reference.sample_rate
        assert reference.audio is not None and samples.shape == reference.audio.shape
        np.testing.assert_allclose(samples, reference.audio, atol=2 * PCM16_STEP + 1e-5)


def test_streaming_chat_with_audio_matches_non_streaming(any_server: LiveServer, served: ServedModel) -> None:
    url, headers = f"{any_server.url}/v1/chat/completions", _headers(any_server)
    audio_body = {"modalities": ["text", "audio"], "audio": {"voice": served.voice, "format": "wav"}, "stage_params": served.greedy_stage_params}
    whole = httpx.post(url, json=_chat_body(served, **audio_body), headers=headers, timeout=120)
    assert whole.status_code == 200, whole.text
    whole_body = whole.json()
    assert whole_body["choices"][0]["message"]["role"] == "assistant"  # (always sent, as OpenAI does)
    expected_text = whole_body["choices"][0]["message"]["content"]
    expected_audio, rate = _read_wav(base64.b64decode(whole_body["choices"][0]["message"]["audio"]["data"]))

    body = _chat_body(served, stream=True, stream_options={"include_usage": True}, **audio_body)
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = _sse_data(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0].get("role") == "assistant"
    text = "".join(d.get("content") or "" for d in deltas)
    audio_parts = [d["audio"] for d in deltas if "audio" in d]
    assert text == expected_text
    assert audio_parts and {p["sample_rate"] for p in audio_parts} == {rate}
    assert len({p["id"] for p in audio_parts}) == 1
    streamed = np.concatenate([_pcm16(p["data"]) for p in audio_parts])
    assert streamed.shape == expected_audio.shape
    np.testing.assert_allclose(streamed, expected_audio, atol=2 * PCM16_STEP)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [whole_body["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole_body["usage"]

    # The openai client parses the same stream.
    stream = _client(any_server).chat.completions.create(
        model=served.model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_text


def test_stage_params_and_max_tokens(inline_server: LiveServer, served: ServedModel) -> None:
    client = _client(inline_server)
    stage = served.text_stage

    def tokens(**kwargs: Any) -> int:
        completion = client.chat.completions.create(model=served.model, messages=PROMPT, modalities=["text"], **kwargs)
        assert completion.usage is not None
        return completion.usage.completion_tokens

    # ignore_eos: a random-weight model may otherwise stop early, and the counts would prove nothing.
    assert tokens(extra_body={"stage_params": {stage: {"max_tokens": 3, "ignore_eos": True}}}) == 3
    assert tokens(max_tokens=4, extra_body={"stage_params": {stage: {"ignore_eos": True}}}) == 4
    assert tokens(max_completion_tokens=5, extra_body={"stage_params": {stage: {"ignore_eos": True}}}) == 5
    # The named stage's parameters win over the top-level field.
    assert tokens(max_tokens=6, extra_body={"stage_params": {stage: {"max_tokens": 2, "ignore_eos": True}}}) == 2


# -- completions ------------------------------------------------------------------------------------


def test_completions_continue_the_prompt_as_it_is(inline_server: LiveServer, served: ServedModel) -> None:
    """/v1/completions (as vLLM serves it: what `vllm bench serve` asks): the prompt continued with no
    chat template, greedy equal to transformers on the toy LM (its text, and its token ids as the
    prompt); a batch answers each prompt as alone, streamed the same text; logprobs per token."""
    client = _client(inline_server)
    greedy = {"temperature": 0.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(model=served.model, prompt="The sky is", logprobs=1, **greedy)  # type: ignore[arg-type]
    (choice,) = alone.choices
    assert alone.object == "text_completion" and choice.finish_reason == "length"
    assert alone.usage.completion_tokens == 6 and alone.usage.total_tokens == alone.usage.prompt_tokens + 6
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == 6 and len(choice.logprobs.top_logprobs) == 6
    assert choice.logprobs.text_offset[0] == 0 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    if served.completion_reference is not None:
        prompt_ids, text = served.completion_reference("The sky is", 6)
        assert alone.usage.prompt_tokens == len(prompt_ids) and choice.text == text
        by_ids = client.completions.create(model=served.model, prompt=prompt_ids, **greedy)  # type: ignore[arg-type]
        assert by_ids.choices[0].text == text
    other = client.completions.create(model=served.model, prompt="Once upon", **greedy)  # type: ignore[arg-type]
    batch = client.completions.create(model=served.model, prompt=["The sky is", "Once upon"], **greedy)  # type: ignore[arg-type]
    assert [(c.index, c.text) for c in batch.choices] == [(0, choice.text), (1, other.choices[0].text)]
    assert batch.usage.completion_tokens == 12 and batch.usage.prompt_tokens == alone.usage.prompt_tokens + other.usage.prompt_tokens
    chunks = list(client.completions.create(model=served.model, prompt=["The sky is", "Once upon"], stream=True, stream_options={"include_usage": True}, **greedy))  # type: ignore[arg-type]
    for index, expected in enumerate((choice.text, other.choices[0].text)):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == expected and [c.finish_reason for c in mine][-1] == "length"
    assert chunks[-1].usage == batch.usage and not chunks[-1].choices
    assert batch.id.startswith("cmpl-") and batch.id.count("-") == 1 and len({c.id for c in chunks}) == 1  # one id a completion


def test_streams_end_each_event_as_vllm_does(inline_server: LiveServer, served: ServedModel) -> None:
    """Each SSE event ends in a ``\n\n`` blank line, as vLLM's server ends them: vLLM's own benchmark
    client (`vllm bench serve`), which splits what it reads on ``"\n\n"``, finds every event even
    when a whole stream arrives in one read (under Litestar's ``\r\n\r\n`` it lost all but one)."""
    from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

    usage = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4, "ignore_eos": True}
    for route, body in (
        ("/v1/completions", {"prompt": "The sky is", **usage}),
        ("/v1/chat/completions", {"messages": PROMPT, "modalities": ["text"], **usage}),
    ):
        raw = httpx.post(f"{inline_server.url}{route}", json={"model": served.model, **body}, timeout=120).content
        assert b"\r" not in raw, route
        messages = StreamedResponseHandler().add_chunk(raw)
        assert messages[-1] == "data: [DONE]" and len(messages) == raw.count(b"\n\n") >= 3, (route, messages)
        events = [json.loads(message.removeprefix("data: ")) for message in messages[:-1]]
        assert events[-1]["usage"]["completion_tokens"] == 4 and all(event["choices"] for event in events[:-1]), route


def test_completions_refuse_what_they_do_not_implement(inline_server: LiveServer, served: ServedModel) -> None:
    url = f"{inline_server.url}/v1/completions"
    for body, param in (
        ({"prompt": "hi", "echo": True}, "echo"),
        ({"prompt": "hi", "suffix": "end"}, "suffix"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({}, "prompt"),
    ):
        assert _assert_error_body(httpx.post(url, json=body, timeout=60), 400)["param"] == param, body
    _complete_ok(inline_server, served)


# -- speech, images, videos -------------------------------------------------------------------------


def _decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """A compressed audio file's samples (mono) and rate, decoded by FFmpeg (PyAV)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        parts = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
        return np.concatenate(parts), stream.rate


def test_speech_wav_and_sse(inline_server: LiveServer, served: ServedModel) -> None:
    if "audio" not in served.modalities:
        pytest.skip("the model produces no audio")
    text = "Hello, how are you today?"
    with _client(inline_server).audio.speech.with_streaming_response.create(
        model=served.model, voice=served.voice, input=text, response_format="wav", extra_body={"stage_params": served.greedy_stage_params}
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        samples, rate = _read_wav(response.read())
    assert rate > 0 and len(samples) > 0

    body = {"model": served.model, "input": text, "voice": served.voice, "stream_format": "sse", "stage_params": served.greedy_stage_params}
    with httpx.stream("POST", f"{inline_server.url}/v1/audio/speech", json=body, timeout=120) as sse:
        assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(e) for e in _sse_data(sse)]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 1 and events[-1]["type"] == "speech.audio.done" and events[:-1] == deltas
    assert {d["sample_rate"] for d in deltas} == {rate}
    streamed = np.concatenate([_pcm16(d["audio"]) for d in deltas])
    # Same input, greedy: the streamed chunks are the WAV's samples.
    np.testing.assert_allclose(streamed, samples, atol=2 * PCM16_STEP)
    assert events[-1]["duration_s"] == pytest.approx(len(samples) / rate)

    # OpenAI's compressed formats: the same audio (its length, to a codec frame), as the type says.
    for fmt, media_type, codec_frame in (("mp3", "audio/mpeg", 1152), ("opus", "audio/ogg", 960), ("aac", "audio/aac", 1024)):
        with _client(inline_server).audio.speech.with_streaming_response.create(
            model=served.model, voice=served.voice, input=text, response_format=fmt, extra_body={"stage_params": served.greedy_stage_params}  # type: ignore[arg-type]
        ) as response:
            assert response.headers["content-type"] == media_type
            decoded, decoded_rate = _decode_audio(response.read())
        assert abs(len(decoded) / decoded_rate - len(samples) / rate) <= 2 * codec_frame / decoded_rate, fmt
        assert np.abs(decoded).max() > 0, fmt
    # OpenAI's speed: the model's own pace only, never an answer that ignored it
    slower = httpx.post(f"{inline_server.url}/v1/audio/speech", json={"model": served.model, "input": text, "speed": 0.5}, timeout=60)
    assert _assert_error_body(slower, 400)["param"] == "speed"


@pytest.mark.parametrize(
    "route, body",
    [("/v1/images/generations", {"prompt": "a red apple"}), ("/v1/videos", {"prompt": "a red apple", "seconds": "1"})],
)
def test_image_and_video_routes_name_what_the_model_produces(inline_server: LiveServer, served: ServedModel, route: str, body: dict[str, Any]) -> None:
    wanted = "image" if "images" in route else "video"
    if wanted in served.modalities:
        pytest.skip(f"the model produces {wanted}")
    error = _assert_error_body(httpx.post(f"{inline_server.url}{route}", json={"model": served.model, **body}, timeout=60), 400)
    assert wanted in error["message"] and all(m in error["message"] for m in served.modalities)
    assert error["code"] == "unsupported_modality"


# -- metrics ----------------------------------------------------------------------------------------


def test_metrics_count_latencies_and_requests(inline_server: LiveServer, served: ServedModel) -> None:
    before = httpx.get(f"{inline_server.url}/metrics").text
    assert "# TYPE omni_time_to_first_token_seconds histogram" in before
    body = _chat_body(served, stream=True, modalities=["text", "audio"])
    with httpx.stream("POST", f"{inline_server.url}/v1/chat/completions", json=body, timeout=120) as response:
        assert _sse_data(response)[-1] == "[DONE]"
    bad = httpx.post(f"{inline_server.url}/v1/chat/completions", json={"model": served.model}, timeout=60)
    assert bad.status_code == 400
    chat = 'route="/v1/chat/completions",status="{}"'
    deadline = time.monotonic() + 5
    while True:  # the request counter moves once the response is fully sent, a moment after [DONE]
        response = httpx.get(f"{inline_server.url}/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        after = response.text
        if _metric(after, "omni_requests_total", chat.format(200)) > _metric(before, "omni_requests_total", chat.format(200)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for histogram in ("omni_time_to_first_token_seconds", "omni_time_to_first_packet_seconds", "omni_e2e_request_latency_seconds"):
        assert _metric(after, f"{histogram}_count") == _metric(before, f"{histogram}_count") + 1, histogram
        assert _metric(after, f"{histogram}_sum") > _metric(before, f"{histogram}_sum")
    for status in ("200", "400"):
        labels = chat.format(status)
        assert _metric(after, "omni_requests_total", labels) == _metric(before, "omni_requests_total", labels) + 1
    assert _metric(after, "omni_requests_running") == 0
    assert _metric(after, "omni_model_info", f'model="{served.model}"') == 1


# -- errors -----------------------------------------------------------------------------------------

_MSG = {"role": "user", "content": "hi"}

ERROR_CASES: dict[str, tuple[Callable[[ServedModel], Any], int, str | None]] = {
    # name: (body, or raw bytes, for the served model; expected status; expected code)
    "bad-json": (lambda s: b'{"model": "x", "messages": [', 400, None),
    "not-an-object": (lambda s: b"[1, 2]", 400, None),
    "messages-not-a-list": (lambda s: {"model": s.model, "messages": "hi"}, 400, None),
    "max-tokens-not-int": (lambda s: {"model": s.model, "messages": [_MSG], "max_tokens": "many"}, 400, None),
    "temperature-not-number": (lambda s: {"model": s.model, "messages": [_MSG], "temperature": [1]}, 400, None),
    "missing-messages": (lambda s: {"model": s.model}, 400, "missing_required_parameter"),
    "unknown-role": (lambda s: {"model": s.model, "messages": [{"role": "robot", "content": "hi"}]}, 400, None),
    "unknown-model": (lambda s: {"model": "no-such-model", "messages": [_MSG]}, 404, "model_not_found"),
    "unknown-part-type": (lambda s: {"model": s.model, "messages": [{"role": "user", "content": [{"type": "hologram", "hologram": {}}]}]}, 400, None),
    "prompt-over-context": (lambda s: {"model": s.model, "messages": [{"role": "user", "content": "hello " * 5000}]}, 400, None),
    "unknown-stage": (lambda s: {"model": s.model, "messages": [_MSG], "stage_params": {"no_such_stage": {"max_tokens": 1}}}, 400, None),
    "unknown-stage-param": (lambda s: {"model": s.model, "messages": [_MSG], "stage_params": {s.text_stage: {"no_such_param": 1}}}, 400, None),
    "n-2": (lambda s: {"model": s.model, "messages": [_MSG], "n": 2}, 400, None),
    # OpenAI fields Omni does not implement: refused, never answered as if not asked
    "top-logprobs-without-logprobs": (lambda s: {"model": s.model, "messages": [_MSG], "top_logprobs": 2}, 400, None),
    "top-logprobs-over-20": (lambda s: {"model": s.model, "messages": [_MSG], "logprobs": True, "top_logprobs": 21}, 400, None),
    "response-format-yaml": (lambda s: {"model": s.model, "messages": [_MSG], "response_format": {"type": "yaml"}}, 400, None),
    "response-format-bad-schema": (lambda s: {"model": s.model, "messages": [_MSG], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, None),
    "tools": (lambda s: {"model": s.model, "messages": [_MSG], "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, None),
    # vLLM fields Omni does not implement, likewise
    "beam-search": (lambda s: {"model": s.model, "messages": [_MSG], "use_beam_search": True}, 400, None),
    "chat-template-kwargs": (lambda s: {"model": s.model, "messages": [_MSG], "chat_template_kwargs": {"enable_thinking": False}}, 400, None),
    "two-structured-outputs": (lambda s: {"model": s.model, "messages": [_MSG], "response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, 400, None),
    "logit-bias-not-numbers": (lambda s: {"model": s.model, "messages": [_MSG], "logit_bias": {"1": "high"}}, 400, None),
    "max-tokens-0": (lambda s: {"model": s.model, "messages": [_MSG], "max_tokens": 0}, 400, None),
    "unknown-modality": (lambda s: {"model": s.model, "messages": [_MSG], "modalities": ["smell"]}, 400, None),
    "oversized-body": (lambda s: {"model": s.model, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}, 413, None),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_requests_get_openai_errors(inline_server: LiveServer, served: ServedModel, case: str, stream: bool) -> None:
    make_body, status, code = ERROR_CASES[case]
    body = make_body(served)
    if stream and not isinstance(body, dict):
        pytest.skip("not a JSON object: nothing to stream")
    url = f"{inline_server.url}/v1/chat/completions"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        response = httpx.post(url, json={**body, "stream": True} if stream else body, timeout=60)
    error = _assert_error_body(response, status)
    if code is not None:
        assert error["code"] == code
    if status < 500:
        assert error["type"] == "invalid_request_error" or status == 413


def test_server_serves_after_bad_requests(inline_server: LiveServer, served: ServedModel) -> None:
    for make_body, _, _ in ERROR_CASES.values():
        body = make_body(served)
        httpx.post(f"{inline_server.url}/v1/chat/completions", **({"content": body} if isinstance(body, bytes) else {"json": body}), timeout=60)
    _complete_ok(inline_server, served)
    health = httpx.get(f"{inline_server.url}/health").json()
    assert health["status"] == "ok" and all(r["active_requests"] == 0 for r in health["replicas"])


def test_unsupported_content_part_for_this_model(inline_server: LiveServer, served: ServedModel) -> None:
    if served.unsupported_part is None:
        pytest.skip("no content part type this model rejects")
    body = _chat_body(served, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, served.unsupported_part]}])
    error = _assert_error_body(httpx.post(f"{inline_server.url}/v1/chat/completions", json=body, timeout=60), 400)
    assert served.unsupported_part["type"] in error["message"]
    _complete_ok(inline_server, served)


def test_mm_processor_kwargs_reach_the_model_family(inline_server: LiveServer, served: ServedModel) -> None:
    """vLLM's ``mm_processor_kwargs`` request field reaches the family's input processor: a valid
    one is served (here without media it changes nothing), an invalid one is a 400 naming it."""
    if served.mm_processor_kwargs is None:
        pytest.skip("the family reads no mm_processor_kwargs")
    valid, invalid = served.mm_processor_kwargs
    url = f"{inline_server.url}/v1/chat/completions"
    plain = httpx.post(url, json=_chat_body(served), timeout=120)
    with_kwargs = httpx.post(url, json=_chat_body(served, mm_processor_kwargs=valid), timeout=120)
    assert plain.status_code == with_kwargs.status_code == 200, with_kwargs.text
    assert with_kwargs.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    error = _assert_error_body(httpx.post(url, json=_chat_body(served, mm_processor_kwargs=invalid), timeout=120), 400)
    assert error["param"] == "mm_processor_kwargs" and error["type"] == "invalid_request_error"


def test_vllm_sampling_fields_reach_the_text_stage(inline_server: LiveServer, served: ServedModel) -> None:
    """vLLM's extra sampling fields, top-level as its chat completions take them, reach the text stage
    (`allowed_token_ids` forces the tokens, `structured_outputs` the answer); a field no route reads
    is served, and logged once."""
    url = f"{inline_server.url}/v1/chat/completions"
    body = _chat_body(served, modalities=["text"], logprobs=True)
    forced = httpx.post(url, json={**body, "allowed_token_ids": [50], "min_tokens": MAX_TOKENS, "ignore_eos": True}, timeout=120)
    assert forced.status_code == 200, forced.text
    tokens = [t["token"] for t in forced.json()["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == MAX_TOKENS and len(set(tokens)) == 1, tokens
    chosen = httpx.post(url, json={**body, "structured_outputs": {"choice": ["yes", "no"]}}, timeout=120)
    assert chosen.status_code == 200 and chosen.json()["choices"][0]["message"]["content"] in ("yes", "no"), chosen.text
    for _ in range(2):
        assert httpx.post(url, json={**body, "omni_unknown_field": 1}, timeout=120).status_code == 200
    assert inline_server.log_path.read_text(errors="replace").count("omni_unknown_field ignored") == 1


def test_openai_client_sees_typed_errors(inline_server: LiveServer, served: ServedModel) -> None:
    client = _client(inline_server)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=PROMPT)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=served.model, messages=PROMPT, n=2)
    assert bad.value.param == "n"


def test_stage_failure_fails_only_that_request(inline_server: LiveServer, served: ServedModel) -> None:
    if served.failing_stage_params is None:
        pytest.skip("the model has no failure test hook")
    url = f"{inline_server.url}/v1/chat/completions"
    body = _chat_body(served, modalities=list(served.modalities), stage_params=served.failing_stage_params)
    error = _assert_error_body(httpx.post(url, json=body, timeout=120), range(500, 600))
    assert error["type"] == "server_error" and error["code"] == "stage_failed"
    # Streamed: the error arrives in-band after the stream started, then [DONE].
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        events = _sse_data(response)
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    _complete_ok(inline_server, served)
    health = httpx.get(f"{inline_server.url}/health").json()
    assert health["status"] == "ok"


def test_input_rejected_mid_pipeline_is_a_client_error(inline_server: LiveServer, served: ServedModel) -> None:
    """A later stage that rejects the request's input while it runs (after the first stage
    streamed) gives a 400 naming the parameter, not a 500; the server goes on."""
    if served.rejecting_stage_params is None:
        pytest.skip("the model has no rejection test hook")
    url = f"{inline_server.url}/v1/chat/completions"
    body = _chat_body(served, modalities=list(served.modalities), stage_params=served.rejecting_stage_params)
    error = _assert_error_body(httpx.post(url, json=body, timeout=120), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == "fail" and "on purpose" in error["message"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        events = _sse_data(response)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "invalid_request_error"
    _complete_ok(inline_server, served)


# -- process placement: auth, disconnects, shutdown -------------------------------------------------


def test_api_key_required_on_v1_routes(process_server: LiveServer, served: ServedModel) -> None:
    url = process_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, route, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", _chat_body(served))):
            error = _assert_error_body(httpx.request(method, f"{url}{route}", json=body, headers=headers, timeout=60), 401)
            assert error["type"] == "authentication_error"
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert _client(process_server).chat.completions.create(model=served.model, messages=PROMPT, max_tokens=2, modalities=["text"]).choices[0].message.content


def test_client_disconnect_cancels_in_every_stage(process_server: LiveServer, served: ServedModel) -> None:
    url, headers = process_server.url, _headers(process_server)
    # Long enough to be still running when the client leaves; how long it takes when left alone
    # shows whether the stages stopped early or merely finished.
    long = _long(served)
    body = _chat_body(served, stream=True, modalities=list(served.modalities), stage_params=long)
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        assert _sse_data(response)[-1] == "[DONE]"
    full_duration = time.monotonic() - started

    # The client leaves after the fourth event, about a tenth into the request. If this (test)
    # process was descheduled so long that the stages had already finished by then, the attempt
    # tests nothing: try again (a server that only streams once it is done fails every attempt).
    for _attempt in range(3):
        cancelled_before = _metric(httpx.get(f"{url}/metrics").text, "omni_requests_cancelled_total")
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data:")
                if seen == 4:
                    running = any(r["active_requests"] for r in httpx.get(f"{url}/health").json()["replicas"])
                    left = time.monotonic()
                    break
        if running:
            break
    assert running, "three times the request had ended in every stage by its fourth streamed event"
    _assert_cancelled_everywhere(url, cancelled_before, left, full_duration)
    _complete_ok(process_server, served)


def test_non_streaming_client_disconnect_cancels_in_every_stage(process_server: LiveServer, served: ServedModel) -> None:
    """A client that waits for the whole answer and hangs up first: the request stops in every
    stage instead of running to its end for nobody."""
    url, headers = process_server.url, _headers(process_server)
    long = _long(served)
    body = _chat_body(served, modalities=list(served.modalities), stage_params=long)
    started = time.monotonic()
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120).status_code == 200
    full_duration = time.monotonic() - started

    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Type": "application/json", "Content-Length": len(payload)}.items())
    address = httpx.URL(url)
    # The client hangs up as soon as a stage runs the request. If this (test) process was descheduled
    # so long that the request had run to its end before it was seen running, the attempt tests
    # nothing: wait until the server is idle and try again (a server that never reports it running
    # fails every attempt).
    for _attempt in range(3):
        _wait_idle(url, full_duration + 30)
        cancelled_before = _metric(httpx.get(f"{url}/metrics").text, "omni_requests_cancelled_total")
        with socket.create_connection((address.host, address.port), timeout=30) as client:
            client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.host}\r\n{head}\r\n".encode() + payload)
            deadline = time.monotonic() + full_duration
            while not (running := any(r["active_requests"] for r in httpx.get(f"{url}/health").json()["replicas"])):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            left = time.monotonic()
        if running:
            break
    assert running, "three times the request had ended in every stage before it was seen running"
    _assert_cancelled_everywhere(url, cancelled_before, left, full_duration)
    _complete_ok(process_server, served)


def _server_state(url: str) -> tuple[str, list[dict[str, Any]]]:
    """The server's Prometheus text and its replicas (``/health``)."""
    return httpx.get(f"{url}/metrics").text, httpx.get(f"{url}/health").json()["replicas"]


def _nothing_running(metrics: str, replicas: list[dict[str, Any]]) -> bool:
    """No request runs in the server nor in any stage replica."""
    return _metric(metrics, "omni_requests_running") == 0 and all(r["active_requests"] == 0 for r in replicas)


def _wait_idle(url: str, timeout: float) -> None:
    """Until no request runs in the server or any stage (an earlier attempt's, ending or cancelled)."""
    deadline = time.monotonic() + timeout
    while not _nothing_running(*_server_state(url)):
        assert time.monotonic() < deadline, "the server never became idle"
        time.sleep(0.05)


def _assert_cancelled_everywhere(url: str, cancelled_before: float, left: float, full_duration: float) -> None:
    """After the client left (at `left`): one more cancelled request, nothing running in any stage,
    well before the request would have ended by itself (it took `full_duration` when left alone)."""
    while True:
        metrics, replicas = _server_state(url)
        done = _metric(metrics, "omni_requests_cancelled_total") == cancelled_before + 1 and _nothing_running(metrics, replicas)
        if done or time.monotonic() - left > full_duration:
            break
        time.sleep(0.1)
    assert done, (metrics, replicas)
    assert time.monotonic() - left < 0.5 * full_duration, "the stages seem to have run the request to its end"
    assert all(r["placement"] == "process" for r in replicas)


def test_sigkilled_stage_fails_its_requests_then_serves_again(process_server: LiveServer, served: ServedModel) -> None:
    """SIGKILL the text stage's process while a streaming and a non-streaming request run in it:
    within 5 s the stream carries an error event and closes, the other gets a 5xx OpenAI error
    body; the stage is restarted and the next request succeeds."""
    url, headers = process_server.url, _headers(process_server)
    long = _long(served)
    outcome: dict[str, Any] = {}
    streaming = threading.Event()

    def stream() -> None:
        body = _chat_body(served, stream=True, modalities=list(served.modalities), stage_params=long)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    streaming.set()
            outcome["stream"] = (response.status_code, events, time.monotonic())

    def whole() -> None:
        body = _chat_body(served, modalities=list(served.modalities), stage_params=long)
        response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        outcome["whole"] = (response, time.monotonic())

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while True:
        text_stage = next(r for r in httpx.get(f"{url}/health").json()["replicas"] if r["stage"] == served.text_stage)
        if streaming.is_set() and text_stage.get("active_requests", 0) >= 2:
            break
        assert time.monotonic() < deadline and not outcome, ("the requests never ran together", outcome)
        time.sleep(0.02)
    os.kill(text_stage["pid"], signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(60)

    status, events, closed = outcome["stream"]
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and served.text_stage in error["message"], error
    assert closed - killed < 5.0
    response, answered = outcome["whole"]
    body = _assert_error_body(response, range(500, 600))
    assert body["type"] == "server_error" and served.text_stage in body["message"], body
    assert answered - killed < 5.0
    assert f"stage {served.text_stage} replica 0: worker process killed by SIGKILL" in process_server.log_tail(200_000)

    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() - killed < 180, httpx.get(f"{url}/health").text
        time.sleep(0.2)
    _complete_ok(process_server, served)
    # The killed worker's shared-memory pool (its written pages hold memory) went when the new
    # worker made its own.
    assert not glob.glob(f"/dev/shm/omni-shm-{text_stage['pid']}-*")


def test_sigterm_shuts_down_cleanly(process_server: LiveServer) -> None:
    """Stops the shared process-placement server: keep it after every other test that uses it."""
    assert process_server.descendants, "the process placement should have started worker processes"
    code = process_server.stop(signal.SIGTERM)
    assert code in (0, -signal.SIGTERM, 128 + signal.SIGTERM), process_server.log_tail()
    assert process_server.leftover_processes() == []
    assert "Traceback" not in process_server.log_tail(20_000)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_group_with_env_api_key(served: ServedModel, sig: int) -> None:
    """Ctrl-C in a terminal (SIGINT to the server and its workers), or a service manager stopping
    the process group (SIGTERM: systemd's default); the key comes from OMNI_API_KEY."""
    server = LiveServer.start(served.model, env={"OMNI_API_KEY": "sk-from-env"})
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sk-from-env"}).status_code == 200
        assert server.descendants
        code = server.stop(sig, group=True)
        assert code in (0, -sig, 128 + sig), server.log_tail()
        assert server.leftover_processes() == []
        # Workers leave it to the engine to stop them: no KeyboardInterrupt mid-step, no worker
        # killed by the signal (the engine would take it for a crash and restart the replica).
        log = server.log_tail(50_000)
        assert "Traceback" not in log and "crashed" not in log and "worker process killed" not in log, log
    finally:
        server.kill()


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_signal_while_loading_stops_the_load(sig: int, group: bool) -> None:
    """Ctrl-C (to the process group, as a terminal sends it) or SIGTERM (to the server alone, as
    ``kill`` or ``docker stop`` sends it) while the stages still load:
    uvicorn alone notes the signal and acts after its startup, so `omni serve` went on loading
    (minutes, for large weights) before it stopped. Now the load stops: the replicas still loading
    are ended, none is left, and the pipeline never reports ready. (Qwen3-Omni's two vLLM stages
    load for ~10 s here after their first progress line: the signal comes well inside that.)"""
    server = LiveServer.launch("omni-tiny/qwen3-omni")
    try:
        deadline = time.monotonic() + 120
        while "loading the model part of stage 'thinker'" not in server.log_tail(50_000):
            assert server.process.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        server.descendants = server.children()
        code = server.stop(sig, group=group, timeout=60)
        log = server.log_tail(50_000)
        assert code in (0, -sig, 128 + sig), log
        assert f"{signal.Signals(sig).name} while loading: stopping the stages" in log, log
        assert "ready in" not in log and "ready: serving" not in log, log
        assert "Traceback" not in log and "crashed" not in log, log
        assert server.leftover_processes() == []
    finally:
        server.kill()


def test_ctrl_c_while_omni_generate_loads(tmp_path) -> None:
    """The offline path (`omni generate`, `Omni`): Ctrl-C while the stages load used to leave the
    loop with the load abandoned, and the exiting interpreter waited forever on worker processes
    that ignore SIGTERM (they leave stopping to the engine). Now the load is cancelled, the
    replicas it started are stopped, and the command ends ("Aborted!", exit 1) with none left."""
    import psutil

    log = tmp_path / "generate.log"
    command = [*omni_command(), "generate", "omni-tiny/qwen3-omni", "--prompt", "hi", "--out", str(tmp_path / "out")]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=launch_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "loading the model part of stage 'thinker'" not in log.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        children = psutil.Process(process.pid).children(recursive=True)
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(60)
        text = log.read_text(errors="replace")
        assert code == 1 and "Aborted!" in text and "ready in" not in text, text
        assert leftover_processes(children) == []
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
