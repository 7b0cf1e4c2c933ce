"""Bodies the server cannot use get an OpenAI error body that says what is wrong in the client's own
terms: an empty body, a body of another content type, a field that is not a readable image (named as
the client sent it, with no Python object repr), an unknown task; a form's unknown fields are logged
as a JSON body's are.

The app is the real one (`create_app`) over a pipeline of pass-through stages with HunyuanImage-3.0's
shape (``ar`` text -> ``dit`` image/video, with tasks): these checks happen before any model runs.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from litestar.testing import TestClient

from omni_core.config.pipeline import TaskSpec
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.errors import InvalidRequestError
from omni_core.server.app import create_app
from omni_core.testing.fakes import passthrough_pipeline

pytestmark = pytest.mark.timeout(120)

MODEL = "fake"
TASKS = (TaskSpec("t2t", ("ar",), ("text",)), TaskSpec("t2i", ("dit",), ("image",)), TaskSpec("t2v", ("dit",), ("video",)))
ROUTES = ("/v1/chat/completions", "/v1/images/generations", "/v1/images/edits", "/v1/videos", "/v1/audio/speech")
FORM_ROUTES = ("/v1/videos", "/v1/images/edits")  # (they also take multipart/form-data, as OpenAI's client sends them)


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG_URL = "data:image/png;base64," + base64.b64encode(_png()).decode()
JUNK_URL = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
BAD_BASE64_URL = "data:image/png;base64,@@@"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    pipeline = passthrough_pipeline(stages=2, placement="inline")
    s0, s1 = pipeline.stages
    ar = attrs.evolve(s0, name="ar", output="text", final=False)
    dit = attrs.evolve(s1, name="dit", output="image", extra_outputs=("video",), inputs=(attrs.evolve(s1.inputs[0], source="ar", target="dit"),))
    pipeline = attrs.evolve(pipeline, stages=(ar, dit), tasks=TASKS, default_modalities=("image",))
    with TestClient(create_app(AsyncOmniEngine(pipeline), model_name=MODEL)) as test_client:
        yield test_client


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    assert " object at 0x" not in error["message"], error
    return error


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("headers", [{"content-type": "application/json"}, {}], ids=["json", "untyped"])
def test_an_empty_body_is_a_400_saying_so(client: TestClient, route: str, headers: dict[str, str]) -> None:
    error = _error(client.post(route, content=b"", headers=headers), 400)
    assert error["code"] == "empty_body" and error["message"].startswith("the request body is empty"), error
    assert "a JSON object (Content-Type: application/json)" in error["message"]
    assert ("multipart/form-data" in error["message"]) == (route in FORM_ROUTES), error


@pytest.mark.parametrize("route", ROUTES)
def test_a_body_of_another_type_is_a_415_naming_what_the_route_takes(client: TestClient, route: str) -> None:
    form = _error(client.post(route, data={"model": MODEL, "prompt": "a cat"}), 415)  # what `curl -d k=v` sends
    assert form["code"] == "unsupported_media_type" and "application/x-www-form-urlencoded" in form["message"], form
    assert f"{route} takes a JSON object (Content-Type: application/json)" in form["message"]
    assert ("or a form (Content-Type: multipart/form-data)" in form["message"]) == (route in FORM_ROUTES), form
    text = _error(client.post(route, content=b"model: fake", headers={"content-type": "text/plain"}), 415)
    assert "Content-Type text/plain" in text["message"], text
    if route not in FORM_ROUTES:
        multipart = _error(client.post(route, files=[("model", (None, MODEL))]), 415)
        assert "multipart/form-data" in multipart["message"], multipart


def test_the_schema_documents_the_415(client: TestClient) -> None:
    responses = client.get("/schema/openapi.json").json()["paths"]["/v1/videos"]["post"]["responses"]
    assert responses["415"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def test_json_stays_json_whatever_its_label(client: TestClient) -> None:
    malformed = _error(client.post("/v1/images/generations", content=b'{"model": ', headers={"content-type": "application/json"}), 400)
    assert malformed["message"] == "Input data was truncated", malformed
    # ``curl -d '{...}'`` labels its JSON as a form: it is read as JSON, as before.
    body = b'{"model": "fake", "prompt": "a cat"}'
    response = client.post("/v1/images/generations", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input_reference": JUNK_URL}, "input_reference", "input_reference: cannot decode the image: not a readable image (PNG, JPEG, WebP"),
        ({"input_reference": {"image_url": JUNK_URL}}, "input_reference", "input_reference: cannot decode the image: not a readable image"),
        ({"input_reference": BAD_BASE64_URL}, "input_reference", "input_reference: invalid base64 data"),
        ({"last_frame": JUNK_URL}, "last_frame", "last_frame: cannot decode the image: not a readable image"),
        ({"references": [{"type": "image", "image": JUNK_URL}]}, "references[0].image", "references[0].image: cannot decode the image: not a readable image"),
    ],
)
def test_a_video_field_that_is_not_an_image_is_named_as_sent(client: TestClient, fields: dict[str, Any], param: str, says: str) -> None:
    error = _error(client.post("/v1/videos", json={"model": MODEL, "prompt": "a cat", **fields}), 400)
    assert error["param"] == param and error["message"].startswith(says), error


def test_an_uploaded_input_reference_that_is_not_an_image_is_named_as_sent(client: TestClient) -> None:
    files = [("model", (None, MODEL)), ("prompt", (None, "a cat")), ("input_reference", ("cat.png", b"junk", "image/png"))]
    error = _error(client.post("/v1/videos", files=files), 400)
    assert error["param"] == "input_reference" and "not a readable image (PNG, JPEG, WebP" in error["message"], error
    files[-1] = ("input_reference", ("cat.png", _png(), "image/png"))
    assert client.post("/v1/videos", files=files).status_code == 200


def test_the_family_side_names_chat_images_by_their_path() -> None:
    """What a family's input processor reads (`last_user_images`): a bad image is named by its path
    in the messages (the server passes chat images on: each family decodes them with its own limits)."""
    from PIL import Image

    from omni_core.engine.inputs import last_user_images

    def message(*parts: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "what?"}, *parts]}]

    good = {"type": "image_url", "image_url": {"url": PNG_URL}}
    assert [image.size for image in last_user_images(message(good, {"type": "image", "image": Image.new("RGB", (3, 2))}), 2, "M")] == [(8, 6), (3, 2)]
    for part, param, says in (
        ({"type": "image_url", "image_url": {"url": JUNK_URL}}, "messages[1].content[2].image_url.url", "not a readable image"),
        ({"type": "image_url", "image_url": {"url": BAD_BASE64_URL}}, "messages[1].content[2].image_url.url", "invalid base64 data"),
        ({"type": "image_url", "image_url": {}}, "messages[1].content[2].image_url", "needs a url"),
        ({"type": "image", "image": "cat.png"}, "messages[1].content[2].image", "must be a PIL image"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            last_user_images(message(good, part), 2, "M")
        assert info.value.param == param and str(info.value).startswith(f"{param}: ") and says in str(info.value), info.value
        assert " object at 0x" not in str(info.value)


def test_a_chat_part_a_model_does_not_read_is_named_in_a_sentence() -> None:
    from omni_core.engine.inputs import last_user_text

    messages = [{"role": "user", "content": [{"type": "text", "text": "a cat"}, {"type": "image_url", "image_url": {"url": PNG_URL}}]}]
    with pytest.raises(InvalidRequestError) as info:
        last_user_text(messages, hint="; send it as the image field")
    assert info.value.param == "messages[0].content[1]"
    assert str(info.value) == (
        "messages[0].content[1]: this model takes no image in a chat message (the part is of type 'image_url'; it reads text); "
        "send it as the image field"
    )
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    with pytest.raises(InvalidRequestError, match=r"takes no audio in a chat message \(the part is of type 'input_audio'; it reads text and image\)$"):
        last_user_text(audio, reads=("image_url", "image"))


def test_a_forms_unknown_fields_are_logged_as_a_json_bodys_are(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omni_core.server.routes"):
        files = [("model", (None, MODEL)), ("prompt", (None, "a cat")), ("form_only_field", (None, "bar"))]
        assert client.post("/v1/videos", files=files).status_code == 200
        assert client.post("/v1/videos", json={"model": MODEL, "prompt": "a cat", "json_only_field": 1}).status_code == 200
        assert client.post("/v1/videos", files=files).status_code == 200  # (once a field)
    said = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert said == [
        "/v1/videos: request field form_only_field ignored: not part of Omni's API (said once a field)",
        "/v1/videos: request field json_only_field ignored: not part of Omni's API (said once a field)",
    ], said


@pytest.mark.parametrize(
    ("task", "status", "says"),
    [
        ("bogus", 400, "unknown task 'bogus'; this model's tasks are: t2t, t2i, t2v"),
        ("t2t", 400, "task 't2t' does not produce image"),
        ("t2i", 200, None),
    ],
)
def test_images_take_a_task_as_chat_does(client: TestClient, task: str, status: int, says: str | None) -> None:
    response = client.post("/v1/images/generations", json={"model": MODEL, "prompt": "a cat", "task": task})
    if says is None:
        assert response.status_code == status, response.text
        return
    error = _error(response, status)
    assert error["message"].startswith(says), error
    if task == "bogus":
        chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "task": task})
        assert chat.status_code == 400 and chat.json()["error"] == error, chat.text


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/images/generations", {"prompt": "a cat"}),
        ("/v1/videos", {"prompt": "a cat"}),
    ],
)
def test_a_request_that_names_no_model_gets_the_served_one(client: TestClient, route: str, body: dict[str, Any]) -> None:
    """As vLLM takes it: `model` may be left out; a model named must be the served one."""
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model" if route != "/v1/images/generations" else "created"]
    if route == "/v1/videos":
        assert response.json()["model"] == MODEL
        assert client.post(route, files=[("prompt", (None, "a cat"))]).status_code == 200  # the form, likewise
    other = client.post(route, json={**body, "model": "other"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].image_url"),
        ("/v1/images/generations", {"n": 1}, "prompt"),
        ("/v1/videos", {"seconds": "4"}, "prompt"),
        ("/v1/audio/speech", {"voice": "a"}, "input"),
    ],
)
def test_a_missing_field_is_named_as_openai_names_it(client: TestClient, route: str, body: dict[str, Any], param: str) -> None:
    error = _error(client.post(route, json={"model": MODEL, **body}), 400)
    if route == "/v1/videos":  # the form says the same
        assert _error(client.post(route, files=[(k, (None, v)) for k, v in body.items()]), 400) == error
    assert error == {"message": f"Missing required parameter: {param!r}.", "type": "invalid_request_error", "param": param, "code": "missing_required_parameter"}


def test_an_image_url_answer_is_refused_saying_why(client: TestClient) -> None:
    error = _error(client.post("/v1/images/generations", json={"prompt": "a cat", "response_format": "url"}), 400)
    assert error["param"] == "response_format" and "keeps no image files" in error["message"], error


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({}, "image", "an edit needs an image"),
        ({"image": JUNK_URL}, "image", "image: cannot decode the image: not a readable image"),
        ({"image": [PNG_URL, JUNK_URL]}, "image[1]", "image[1]: cannot decode the image"),
        ({"images": [{"file_id": "file-1"}]}, "images[0]", "file_id is not supported"),
        ({"images": [{"image_url": "/etc/hostname"}]}, "images[0]", "images[0]"),
        ({"image": PNG_URL, "images": [{"image_url": PNG_URL}]}, "images", "give the images once"),
        ({"image": PNG_URL, "mask": PNG_URL}, "mask", "mask (inpainting) is not supported"),
    ],
)
def test_an_edit_names_what_is_wrong_with_its_images(client: TestClient, body: dict[str, Any], param: str, says: str) -> None:
    error = _error(client.post("/v1/images/edits", json={"model": MODEL, "prompt": "make it blue", **body}), 400)
    assert error["param"] == param and says in error["message"], error


def test_an_edit_takes_its_images_as_uploads_or_urls(client: TestClient) -> None:
    """OpenAI's client posts a form: ``image`` (one upload) or ``image[]`` (several); JSON takes data
    URLs or OpenAI's ``images: [{"image_url": ...}]``. The images reach the model as a chat message's
    image parts, before the prompt."""
    for files in ([("image", ("a.png", _png(), "image/png"))], [("image[]", ("a.png", _png(), "image/png")), ("image[]", ("b", _png(), None))]):
        response = client.post("/v1/images/edits", data={"model": MODEL, "prompt": "make it blue"}, files=files)
        assert response.status_code == 200, response.text
    junk = _error(client.post("/v1/images/edits", data={"prompt": "x"}, files=[("image", ("a.png", b"junk", "image/png"))]), 400)
    assert junk["param"] == "image" and "cannot decode the image" in junk["message"], junk
    response = client.post("/v1/images/edits", json={"model": MODEL, "prompt": "make it blue", "images": [{"image_url": PNG_URL}]})
    assert response.status_code == 200, response.text
