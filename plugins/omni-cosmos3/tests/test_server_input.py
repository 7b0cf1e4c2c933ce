"""What a client may send Cosmos3 through ``omni serve``: its conditioning frames (``image``/``video``
stage parameters) as base64 data URLs, never a path the server would open unless its operator
allowed the directory (``--allowed-local-media-path``); unknown parameters of its diffusion stage
refused with a 400 naming them, before any work."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from omni_core.testing.live_server import LiveServer

MODEL = "omni-tiny/cosmos3"
POLICY = {"task": "policy", "domain": "bridge_orig_lerobot", "chunk_size": 4, "num_inference_steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer.start(MODEL, args=["--set", "generator.placement=inline"])
    try:
        yield live
    finally:
        live.close()


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _images(server: LiveServer, generator: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL, "prompt": "A robot arm picks up a blue cube", "stage_params": {"generator": generator}}
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)


@pytest.mark.parametrize("path", ["/etc/passwd", "frame.png"])
def test_a_string_is_never_opened_as_a_path(server: LiveServer, tmp_path: Path, path: str) -> None:
    """A path is refused as such: had the server opened ``frame.png`` (a valid image), the request
    would have gone on; ``/etc/passwd`` is refused without its contents being read."""
    if path == "frame.png":
        (tmp_path / path).write_bytes(_png())
        path = str(tmp_path / path)
    response = _images(server, {**POLICY, "image": path})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stage_params.generator.image" and "only data: URLs are accepted" in error["message"], error
    assert "cannot identify" not in error["message"]  # no decoder saw the file
    for video in ("file:///etc/passwd", ["file:///etc/passwd"]):
        refused = _images(server, {**POLICY, "video": video})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stage_params.generator.video", refused.text


def test_an_operator_allowed_directory_is_read(tmp_path: Path) -> None:
    """With ``--allowed-local-media-path DIR``, a ``file://`` frame under DIR is read (by the server,
    into a data URL: the stage sees one shape); one outside DIR is still a 400."""
    allowed = tmp_path / "frames"
    allowed.mkdir()
    (allowed / "frame.png").write_bytes(_png())
    (tmp_path / "outside.png").write_bytes(_png())
    live = LiveServer.start(MODEL, args=["--set", "generator.placement=inline", "--allowed-local-media-path", str(allowed)])
    try:
        response = _images(live, {**POLICY, "image": (allowed / "frame.png").as_uri()})
        assert response.status_code == 200, response.text
        outside = _images(live, {**POLICY, "image": (tmp_path / "outside.png").as_uri()})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "stage_params.generator.image", outside.text
    finally:
        live.close()


def test_an_image_as_a_data_url_is_taken(server: LiveServer) -> None:
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    response = _images(server, {**POLICY, "image": url})
    assert response.status_code == 200, response.text
    bad = _images(server, {**POLICY, "image": "data:image/png;base64," + base64.b64encode(b"junk").decode()})
    assert bad.status_code == 400 and "cannot decode the image" in bad.json()["error"]["message"], bad.text


def test_unknown_diffusion_stage_params_are_a_400_naming_them(server: LiveServer) -> None:
    response = _images(server, {"num_inference_steps": 2, "bogus": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stage_params.generator.bogus" and "'bogus'" in error["message"] and "diffusion" in error["message"]
    stage = httpx.post(f"{server.url}/v1/images/generations", json={"model": MODEL, "prompt": "a cat", "stage_params": {"dit": {}}}, timeout=60)
    assert stage.status_code == 400 and stage.json()["error"]["param"] == "stage_params.dit", stage.text


def test_chat_without_modalities_answers_with_the_image_the_images_route_draws(server: LiveServer) -> None:
    """The family's default output (an image), as an ``image_url`` content part: as vLLM-Omni's chat
    answers a text-to-image model."""
    generator = {"num_inference_steps": 2, "seed": 3}
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "a red apple"}], "stage_params": {"generator": generator}},
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    parts = chat.json()["choices"][0]["message"]["content"]
    assert [p["type"] for p in parts] == ["image_url"]  # (no empty text part)
    png = base64.b64decode(parts[0]["image_url"]["url"].removeprefix("data:image/png;base64,"))
    images = httpx.post(
        f"{server.url}/v1/images/generations", json={"model": MODEL, "prompt": "a red apple", "stage_params": {"generator": generator}}, timeout=120
    )
    assert images.status_code == 200, images.text
    assert png == base64.b64decode(images.json()["data"][0]["b64_json"])
    # usage counts the prompt the generator read (its templated tokens), and no completion tokens
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] > 3 and usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"]
    longer = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "a red apple on a wooden table by the window"}], "stage_params": {"generator": generator}},
        timeout=120,
    )
    assert longer.json()["usage"]["prompt_tokens"] > usage["prompt_tokens"]


def _post_image(server: LiveServer, **fields: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/images/generations", json={"model": MODEL, "prompt": "a red apple", "seed": 3, **fields}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _decoded(b64_image: str) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64_image)))


def test_vllm_omni_diffusion_fields_and_openai_output_formats(server: LiveServer) -> None:
    """vLLM-Omni's top-level ``num_inference_steps``/``guidance_scale``/``negative_prompt`` draw what the
    same values in ``stage_params`` draw (which win per key); OpenAI's ``output_format`` gives JPEG and
    WebP of the same image, and the answer names the format and the size."""
    drawing = {"num_inference_steps": 2, "guidance_scale": 3.0, "negative_prompt": "blurry"}
    staged = _post_image(server, stage_params={"generator": drawing})
    top = _post_image(server, **drawing)
    assert top["data"][0]["b64_json"] == staged["data"][0]["b64_json"]
    default = _post_image(server, stage_params={"generator": {"num_inference_steps": 2}})
    assert default["data"][0]["b64_json"] != staged["data"][0]["b64_json"]  # (the fields changed the image)
    overridden = _post_image(server, **{**drawing, "num_inference_steps": 500}, stage_params={"generator": {"num_inference_steps": 2}})
    assert overridden["data"][0]["b64_json"] == staged["data"][0]["b64_json"]

    png = _decoded(staged["data"][0]["b64_json"])
    assert (png.format, staged["output_format"], staged["size"]) == ("PNG", "png", f"{png.width}x{png.height}")
    reference = np.asarray(png.convert("RGB"), dtype=np.float32)
    for fmt, name in (("jpeg", "JPEG"), ("webp", "WEBP")):
        answer = _post_image(server, **drawing, output_format=fmt, output_compression=0)
        image = _decoded(answer["data"][0]["b64_json"])
        assert (image.format, answer["output_format"], answer["size"]) == (name, fmt, staged["size"])
        assert np.abs(np.asarray(image.convert("RGB"), dtype=np.float32) - reference).mean() < 12  # (lossy: the same picture)
    refused = httpx.post(f"{server.url}/v1/images/generations", json={"model": MODEL, "prompt": "a cat", "background": "transparent"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background", refused.text


@pytest.mark.parametrize(("field", "param"), [("last_frame", "last_frame"), ("references", "references")])
def test_video_fields_cosmos3_does_not_take_are_refused_not_dropped(server: LiveServer, field: str, param: str) -> None:
    """/v1/videos' last frame and references (MiniMax-H3's) are a 400 naming the field as sent (the
    request field ``last_image`` the input processor names is ``last_frame`` here), before any work;
    before, Cosmos3 drew a video from the prompt alone."""
    image = "data:image/png;base64," + base64.b64encode(_png()).decode()
    value = image if field == "last_frame" else [{"type": "image", "image": image}]
    body = {"model": MODEL, "prompt": "a robot", field: value, "stage_params": {"generator": {"num_inference_steps": 2}}}
    response = httpx.post(f"{server.url}/v1/videos", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "Cosmos3 takes no" in error["message"], error
