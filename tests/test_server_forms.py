"""`omni_core.server.forms`: a ``multipart/form-data`` body read as the JSON object it stands for (how
OpenAI's client posts ``/v1/videos``), through Litestar with the server's error handler."""

from __future__ import annotations

import base64
from typing import Any, Iterator

import msgspec
import pytest
from litestar import Request, post
from litestar.params import Body
from litestar.testing import TestClient, create_test_client
from typing_extensions import Annotated

from omni_core.server.errors import handle_exception
from omni_core.server.forms import FormRequest
from omni_core.server.protocol import VideoRequest


class _Form(FormRequest):
    json_fields = frozenset({"seed", "stage_params", "references"})


@post("/echo", request_class=_Form)
async def echo(data: Annotated[VideoRequest, Body()]) -> dict[str, Any]:
    return msgspec.to_builtins(data)


class _Counted(_Form):
    parses = 0

    async def _form_body(self) -> dict[str, Any]:
        type(self).parses += 1
        return await super()._form_body()


@post("/twice", request_class=_Counted)
async def twice(data: Annotated[dict[str, Any], Body()], request: Request) -> dict[str, Any]:
    # Another Request on the same connection (as the server's scan for ignored fields may be) reads
    # the form the route's body was built from, without parsing it again.
    return {"again": await _Counted(request.scope).json() == data, "parses": _Counted.parses}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with create_test_client([echo, twice], exception_handlers={Exception: handle_exception}) as test_client:
        yield test_client


def _form(client: TestClient, *fields: tuple[str, Any]) -> Any:
    return client.post("/echo", files=[(name, value if isinstance(value, tuple) else (None, value)) for name, value in fields])


PNG = b"\x89PNG\r\n\x1a\n not really a png"


def test_a_form_reads_as_the_json_body(client: TestClient) -> None:
    response = _form(
        client,
        ("model", "m"), ("prompt", "a cat"), ("seconds", "5"), ("size", "64x32"), ("seed", "7"),
        ("input_reference", ("frame.png", PNG, "image/png")),
        ("last_frame", ("last.png", PNG, "application/octet-stream")),  # (the type from the file name)
        ("stage_params[dit][num_inference_steps]", "2"), ("stage_params[dit][cache]", "first_block"),
        ("stage_params[encoder][flag]", "true"),
        ("references", '[{"type": "image", "image": "data:image/png;base64,AAAA"}]'),
    )
    assert response.status_code == 201, response.text
    body = response.json()
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert body["input_reference"] == data_url and body["last_frame"] == data_url
    assert (body["prompt"], body["seconds"], body["size"], body["seed"]) == ("a cat", "5", "64x32", 7)
    assert body["stage_params"] == {"dit": {"num_inference_steps": 2, "cache": "first_block"}, "encoder": {"flag": True}}
    assert body["references"] == [{"type": "image", "image": "data:image/png;base64,AAAA"}]
    # Texts stay texts where the schema has text: a prompt that looks like JSON is not decoded.
    assert _form(client, ("model", "m"), ("prompt", "[1, 2]")).json()["prompt"] == "[1, 2]"


def test_a_form_is_parsed_once_a_request(client: TestClient) -> None:
    before = _Counted.parses
    response = client.post("/twice", files=[("prompt", (None, "a cat")), ("seed", (None, "7"))])
    assert response.status_code == 201, response.text
    assert response.json() == {"again": True, "parses": before + 1}


def test_json_bodies_are_unchanged(client: TestClient) -> None:
    response = client.post("/echo", json={"model": "m", "prompt": "p", "input_reference": {"image_url": "data:image/png;base64,AAAA"}})
    assert response.status_code == 201 and response.json()["input_reference"] == {"image_url": "data:image/png;base64,AAAA"}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ((("seed", "seven"),), "seed", "must be JSON"),
        ((("stage_params", "{bad"),), "stage_params", "must be JSON"),
        ((("stage_params", "[" * 100_000),), None, "nested too deeply"),
        ((("references[][type]", "image"), ("references[][image]", "data:,")), "references", "one JSON text field"),
        ((("stage_params[dit]c", "1"),), "stage_params[dit]c", "is not name"),
        ((("prompt", "again"),), "prompt", "given twice"),
        ((("stage_params[dit]", "1"), ("stage_params[dit][steps]", "2")), "stage_params", "stage_params[dit]"),  # (either order)
        ((("seconds[]", "5"),), "seconds", "Expected `str | null`, got `array`"),
    ],
)
def test_bad_forms_get_a_400_naming_the_field(client: TestClient, fields: tuple, param: str | None, says: str) -> None:
    response = _form(client, ("model", "m"), ("prompt", "p"), *fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
