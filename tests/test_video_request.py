"""``POST /v1/videos`` and ``/v1/images/generations`` bodies -> requests: the first/last frame and
reference fields, data URLs only; vLLM-Omni's diffusion fields; OpenAI's image fields."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from omni_core.engine.request import OmniRequest
from omni_core.engine.result import OmniResult
from omni_core.server.errors import APIError
from omni_core.server.generation import Tracked
from omni_core.server.metrics import ServerMetrics
from omni_core.server.protocol import ImageGenerationRequest, VideoRequest
from omni_core.server.requests import image_request, video_request
from omni_core.server.videos import VideoJobs

PIPELINE = SimpleNamespace(modalities=("video", "audio"), stages=())
def _png() -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 2), (10, 200, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


PNG = _png()  # (the server reads an image field's header: `omni_core.server.media_urls.data_url`)


def test_frames_and_references_become_request_fields() -> None:
    body = VideoRequest(
        model="m", prompt="a cat", seconds="5", size="64x32", input_reference=PNG, last_frame=PNG,
        references=[{"type": "image", "image": PNG}, {"type": "audio", "audio": "data:audio/wav;base64,UklGRg=="}],
    )
    request = video_request(body, PIPELINE)  # type: ignore[arg-type]
    assert request.extra["image"] == PNG and request.extra["last_image"] == PNG
    assert request.extra["size"] == (64, 32) and request.extra["seconds"] == 5.0
    assert [r["type"] for r in request.extra["references"]] == ["image", "audio"]


def test_an_untyped_upload_is_typed_by_its_bytes() -> None:
    """A frame sent as ``data:application/octet-stream`` (curl's upload of a file named without an
    extension) is an image when its bytes are one, and otherwise refused as not one."""
    untyped = "data:application/octet-stream;base64," + PNG.partition(",")[2]
    request = video_request(VideoRequest(model="m", prompt="a cat", input_reference=untyped), PIPELINE)  # type: ignore[arg-type]
    assert request.extra["image"] == PNG
    with pytest.raises(APIError) as info:
        video_request(VideoRequest(model="m", prompt="a cat", last_frame="data:application/octet-stream;base64,aGVsbG8="), PIPELINE)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == "last_frame" and "not a readable image" in str(info.value)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input_reference": "https://example.com/cat.png"}, "input_reference"),
        ({"last_frame": "/etc/passwd"}, "last_frame"),
        ({"references": [{"type": "image", "image": "file:///etc/passwd"}]}, "references[0].image"),
        ({"references": [{"type": "audio", "audio": "https://example.com/a.wav"}]}, "references[0].audio"),
    ],
)
def test_media_that_would_be_fetched_or_read_is_refused(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        video_request(VideoRequest(model="m", prompt="a cat", **fields), PIPELINE)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == param


def _stage(name: str, kind: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, kind=kind)


DRAWING = SimpleNamespace(modalities=("text", "image", "video"), stages=(_stage("ar", "ar"), _stage("dit", "diffusion")))


def test_vllm_omni_diffusion_fields_go_to_the_stage_that_draws() -> None:
    """vLLM-Omni's top-level ``num_inference_steps``/``guidance_scale``/``negative_prompt`` (and a
    video's ``num_frames``/``fps``) are the last diffusion stage's parameters; ``stage_params`` wins
    per key; a field that stage's model says it does not take is a 400 naming the field."""
    body = ImageGenerationRequest(model="m", prompt="a cat", num_inference_steps=4, guidance_scale=2.5, stage_params={"dit": {"guidance_scale": 7.0}})
    request = image_request(body, DRAWING)  # type: ignore[arg-type]
    assert request.params == {"dit": {"num_inference_steps": 4, "guidance_scale": 7.0}}
    video = video_request(VideoRequest(model="m", prompt="a cat", num_frames=22, fps=12, negative_prompt="rain"), DRAWING)  # type: ignore[arg-type]
    assert video.params == {"dit": {"num_frames": 22, "fps": 12, "negative_prompt": "rain"}}
    takes = {"dit": frozenset({"num_inference_steps", "guidance_scale"})}
    assert image_request(body, DRAWING, takes=takes).params["dit"]["num_inference_steps"] == 4  # type: ignore[arg-type]
    with pytest.raises(APIError) as info:
        image_request(ImageGenerationRequest(model="m", prompt="a cat", negative_prompt="dogs"), DRAWING, takes=takes)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == "negative_prompt" and "'dit' stage does not take it" in str(info.value)
    no_diffusion = SimpleNamespace(modalities=("image",), stages=(_stage("ar", "ar"),))
    with pytest.raises(APIError) as info:
        image_request(ImageGenerationRequest(model="m", prompt="a cat", guidance_scale=3.0), no_diffusion)  # type: ignore[arg-type]
    assert info.value.param == "guidance_scale" and "no diffusion stage" in str(info.value)
    assert image_request(ImageGenerationRequest(model="m", prompt="a cat"), DRAWING).params == {}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"background": "transparent"}, "background"), ({"output_compression": 101}, "output_compression"), ({"size": "big"}, "size")],
)
def test_image_fields_it_cannot_honour_are_a_400(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        image_request(ImageGenerationRequest(model="m", prompt="a cat", **fields), DRAWING)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == param


def test_image_size_auto_is_the_models_choice() -> None:
    auto = image_request(ImageGenerationRequest(model="m", prompt="a cat", size="auto", background="opaque", quality="high"), DRAWING)  # type: ignore[arg-type]
    assert "size" not in auto.extra
    assert image_request(ImageGenerationRequest(model="m", prompt="a cat", size="64x32"), DRAWING).extra["size"] == (64, 32)  # type: ignore[arg-type]


async def test_video_jobs_drop_finished_jobs_behind_one_still_running() -> None:
    """Past `max_jobs` the oldest finished jobs go, even behind an older job that still runs."""
    release = asyncio.Event()
    metrics = ServerMetrics("m", lambda: 0)

    async def stream(wait: bool):
        if wait:
            await release.wait()
        return
        yield  # (an async generator with no deltas: the job fails, "no video")

    def tracked(request_id: str, wait: bool = False) -> Tracked:
        request = OmniRequest(prompt="p", request_id=request_id)
        return Tracked(request, stream(wait), metrics, OmniResult(request_id))

    jobs = VideoJobs(max_jobs=2)
    jobs.start(tracked("long", wait=True), "m", "p")
    jobs.start(tracked("a"), "m", "p")
    await asyncio.sleep(0.01)
    assert [jobs.job(name).status for name in ("long", "a")] == ["queued", "failed"]
    jobs.start(tracked("b"), "m", "p")
    assert list(jobs.entries) == ["long", "b"]  # a dropped, the older running one kept
    with pytest.raises(APIError, match="no video job 'a'"):
        jobs.job("a")
    jobs.start(tracked("c"), "m", "p")  # b still running: three jobs until one finishes
    assert list(jobs.entries) == ["long", "b", "c"]
    release.set()
    await asyncio.sleep(0.01)
    assert jobs.job("long").status == "failed"
    jobs.shutdown()


def test_a_stage_refusal_names_the_frame_field_as_videos_does() -> None:
    """An input processor or stage names the request field it reads (``image``, ``last_image``); the
    client sent ``input_reference`` / ``last_frame``: the 400 (and a failed job) names those."""
    from omni_core.errors import InvalidRequestError
    from omni_core.server.requests import video_field_error

    for sent, read in (("input_reference", "image"), ("last_frame", "last_image"), ("size", "size"), ("references[0].image", "references[0].image")):
        error = video_field_error(InvalidRequestError(f"{read} is wrong", param=read))
        assert (error.status, error.param, str(error)) == (400, sent, f"{read} is wrong")
    assert video_field_error(InvalidRequestError("no param")).param is None
