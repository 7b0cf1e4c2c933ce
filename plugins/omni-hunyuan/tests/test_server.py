"""HunyuanImage-3.0 over HTTP with the official openai client: the task per request from the
modalities (or the ``task`` field), think-then-draw's text and image in one chat answer, streamed or
not, and /v1/images/generations (the DiT alone)."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omni_core.testing.live_server import LiveServer

MODEL = "omni-tiny/hunyuan-image3"
STEPS = {"dit": {"num_inference_steps": 2, "seed": 3}, "ar": {"max_tokens": 5}}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer.start(MODEL, args=["--set", "ar.options.max_model_len=256"])
    try:
        yield live
    finally:
        live.close()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _image(url: str) -> np.ndarray:
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


def _chat(client: openai.OpenAI, modalities: list[str] | None, **extra: object) -> object:
    body = {"stage_params": STEPS, **extra}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A lighthouse at night"}], modalities=modalities, extra_body=body  # type: ignore[arg-type]
    )


def test_text_and_image_run_think_then_draw(client: openai.OpenAI) -> None:
    answer = _chat(client, ["text", "image"]).choices[0].message
    parts = answer.content
    assert isinstance(parts, list) and parts[0]["type"] == "text" and [p["type"] for p in parts[1:]] == ["image_url"]
    image = _image(parts[1]["image_url"]["url"])
    assert image.ndim == 3 and image.shape[2] == 3
    # The same request by task name gives the same answer (greedy text, seeded image).
    named = _chat(client, None, task="think_t2i").choices[0].message.content
    assert named[0] == parts[0]
    np.testing.assert_array_equal(_image(named[1]["image_url"]["url"]), image)


def test_think_then_draw_text_is_the_reasoning_without_the_ratio_step(client: openai.OpenAI) -> None:
    control = ("</think>", "<answer>", "<boi>", "<img_size_", "<img_ratio_")
    text = _chat(client, ["text", "image"]).choices[0].message.content[0]["text"]
    assert not [c for c in control if c in text], text
    # Asked for, the control tokens show: the text then ends in the ratio step (its last token, the
    # ratio, stops the stage: vLLM leaves a stop token out of the text).
    shown = {"dit": STEPS["dit"], "ar": {**STEPS["ar"], "skip_special_tokens": False}}
    raw = _chat(client, ["text", "image"], stage_params=shown).choices[0].message.content[0]["text"]
    assert re.search(r"</think><answer><boi><img_size_\d+>$", raw), raw


def test_streamed_think_then_draw_sends_the_text_then_the_image(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A lighthouse at night"}], modalities=["text", "image"],  # type: ignore[list-item]
        stream=True, extra_body={"stage_params": STEPS},
    )
    text, images = "", []
    for chunk in stream:
        content = chunk.choices[0].delta.content if chunk.choices else None
        if isinstance(content, str):
            assert not images, "text after the image"
            text += content
        elif content:
            images += [_image(part["image_url"]["url"]) for part in content]
    whole = _chat(client, ["text", "image"]).choices[0].message.content
    assert text == whole[0]["text"] and len(images) == 1
    np.testing.assert_array_equal(images[0], _image(whole[1]["image_url"]["url"]))


def test_text_alone_runs_only_the_ar_stage(client: openai.OpenAI, server: LiveServer) -> None:
    answer = _chat(client, ["text"]).choices[0].message
    assert isinstance(answer.content, str) and answer.content


def _png_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_an_image_in_the_message_runs_i2t(client: openai.OpenAI, server: LiveServer) -> None:
    """An ``image_url`` part makes a text answer about the image (i2t on the ar stage alone): greedy,
    so the same request answers the same, and another image answers otherwise."""
    def ask(image: Image.Image, stream: bool = False) -> str:
        content = [{"type": "image_url", "image_url": {"url": _png_url(image)}}, {"type": "text", "text": "What is in the image?"}]
        params = {"stage_params": {"ar": {"max_tokens": 8, "ignore_eos": True}}}
        if stream:
            chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], modalities=["text"], stream=True, extra_body=params)  # type: ignore[arg-type]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], modalities=["text"], extra_body=params)  # type: ignore[arg-type]
        return answer.choices[0].message.content  # type: ignore[return-value]

    red, gradient = Image.new("RGB", (100, 60), (200, 30, 30)), Image.radial_gradient("L").convert("RGB").resize((40, 90))
    first = ask(red)
    assert isinstance(first, str) and first
    assert ask(red, stream=True) == first
    assert ask(gradient) != first
    bad = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=bad, timeout=60)
    assert response.status_code == 400 and "cannot decode the image" in response.json()["error"]["message"], response.text
    picture = {"type": "image_url", "image_url": {"url": _png_url(red)}}
    for messages, message in (
        ([{"role": "user", "content": [picture] * 4 + [{"type": "text", "text": "?"}]}], "4 images; HunyuanImage-3.0 takes at most 3"),
        ([{"role": "user", "content": [picture]}, {"role": "assistant", "content": "a red square"}, {"role": "user", "content": "and now?"}],
         "messages[0]: HunyuanImage-3.0 reads the images of the last user message only"),
    ):
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=60)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    drawn = {**bad, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(red)}}, {"type": "text", "text": "redraw"}]}], "modalities": ["image"]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=drawn, timeout=60)
    # (an edit, it2i: this tiny checkpoint is a base one; test_edit.py runs edits on an Instruct copy)
    assert response.status_code == 400 and "needs an Instruct checkpoint" in response.json()["error"]["message"], response.text


def test_images_generations_runs_the_dit_alone_at_the_asked_size(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "a red apple", "size": "48x80", "seed": 1, "stage_params": {"dit": {"num_inference_steps": 2}}}
    first = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120).json()
    assert _image("data:image/png;base64," + first["data"][0]["b64_json"]).shape == (80, 48, 3), first
    assert first["size"] == "48x80"
    response = httpx.post(f"{server.url}/v1/images/generations", json={**body, "size": "50x50"}, timeout=120)
    assert response.status_code == 400 and "nearest: 64x64" in response.json()["error"]["message"]
    # vLLM-Omni's top-level diffusion fields: the dit's own, or a 400 naming the one it does not take.
    top = {"model": MODEL, "prompt": "a red apple", "size": "48x80", "seed": 1, "num_inference_steps": 2}
    response = httpx.post(f"{server.url}/v1/images/generations", json=top, timeout=120)
    assert response.status_code == 200 and response.json()["data"] == first["data"], response.text
    response = httpx.post(f"{server.url}/v1/images/generations", json={**top, "negative_prompt": "blurry"}, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "negative_prompt", response.text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"task": "edit"}, "unknown task 'edit'; this model's tasks are: t2i, it2i, t2t, i2t, think_t2i, recaption_t2i, think_recaption_t2i, think_it2i, recaption_it2i, think_recaption_it2i"),
        ({"task": "t2t", "modalities": ["image"]}, "task 't2t' does not produce image"),
        ({"task": "i2t"}, "task 'i2t' needs an image"),
        # A JSON answer (response_format) is the text tasks' only.
        ({"modalities": ["image"], "response_format": {"type": "json_object"}}, "response_format and structured_outputs apply to the text tasks t2t and i2t"),
        ({"modalities": ["image"], "structured_outputs": {"choice": ["a", "b"]}}, "response_format and structured_outputs apply"),
        ({"modalities": ["text", "image"], "response_format": {"type": "json_object"}}, "task 'think_t2i' draws an image"),
        # The reasoning's budget is the request's: below one token it is refused, as for text.
        ({"modalities": ["text", "image"], "stage_params": {"ar": {"max_tokens": -5}}}, "max_tokens must be at least 1, got -5"),
        ({"modalities": ["text", "image"], "stage_params": {"ar": {"max_tokens": 0}}}, "max_tokens must be at least 1, got 0"),
        ({"modalities": []}, "modalities must name at least one"),
    ],
)
def test_a_task_it_cannot_run_is_a_400(server: LiveServer, extra: dict, message: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_dit_parameter_is_a_400_before_any_stream(server: LiveServer, stream: bool) -> None:
    """Even for think-then-draw, where dit runs after ar: the status code says it, not an error event."""
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "image"], "stream": stream,
        "stage_params": {"ar": {"max_tokens": 2}, "dit": {"num_inference_step": 2}},
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stage_params.dit.num_inference_step"


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_reuse_prefix_kv_is_a_400_before_any_stream(server: LiveServer, stream: bool) -> None:
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "image"], "stream": stream,
        "stage_params": {"ar": {"max_tokens": 2}, "dit": {"num_inference_steps": 2, "reuse_prefix_kv": "yes"}},
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "reuse_prefix_kv must be true or false" in response.json()["error"]["message"]


def test_usage_counts_the_prompt_the_answer_was_made_from(client: openai.OpenAI, tokenizer: object) -> None:
    """``usage``: an image alone counts the DiT's prompt (``<bos>`` and the prompt's tokens, as it
    drew after them) and no completion tokens, streamed too; think-then-draw counts the ar stage's
    prompt and its reasoning with the ratio step."""
    prompt_tokens = 1 + len(tokenizer.encode("A lighthouse at night", add_special_tokens=False))
    image_alone = _chat(client, ["image"]).usage
    assert (image_alone.prompt_tokens, image_alone.completion_tokens, image_alone.total_tokens) == (prompt_tokens, 0, prompt_tokens)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A lighthouse at night"}], modalities=["image"],  # type: ignore[list-item]
        stream=True, stream_options={"include_usage": True}, extra_body={"stage_params": STEPS},
    )
    assert [chunk.usage for chunk in stream if chunk.usage] == [image_alone]
    thought = _chat(client, ["text", "image"]).usage
    # the ar prompt (User/Assistant template, <think>) is longer than the bare prompt; 5 tokens of
    # reasoning, then the ratio step's five
    assert thought.prompt_tokens > prompt_tokens and thought.completion_tokens == STEPS["ar"]["max_tokens"] + 5


def test_completions_continue_the_prompt_as_t2t_does(client: openai.OpenAI) -> None:
    """/v1/completions runs t2t (``<bos> prompt`` continued on the ar stage): the chat's text answer
    for the same words; token ids are refused with a 400 (the family reads text prompts)."""
    chat = _chat(client, ["text"]).choices[0].message.content
    completion = client.completions.create(model=MODEL, prompt="A lighthouse at night", max_tokens=STEPS["ar"]["max_tokens"], extra_body={"stage_params": {"ar": STEPS["ar"]}})
    assert completion.choices[0].text == chat and completion.usage.completion_tokens == STEPS["ar"]["max_tokens"]
    with pytest.raises(openai.BadRequestError, match="text prompt"):
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
