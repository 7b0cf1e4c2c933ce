"""`omni generate` and the server's /v1/videos on the tiny checkpoint: an MP4 with a stereo soundtrack."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from omni_core.testing.live_server import LiveServer

MODEL = "omni-tiny/minimax-h3"
INLINE = ["--set", "encoder.placement=inline", "--set", "dit.placement=inline"]


def _streams(data: bytes) -> tuple[int, int, int]:
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = sum(1 for _ in container.decode(video=0))
        audio = container.streams.audio[0]
        return frames, audio.codec_context.channels, audio.rate


def test_cli_generate_writes_an_mp4_with_sound(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from omni_cli.main import cli

    params = json.dumps({"dit": {"num_inference_steps": 2}})
    result = CliRunner().invoke(cli, ["generate", MODEL, "--prompt", "a cat sleeps on a sofa", "--stage-params", params, "--out", str(tmp_path), "--json", *INLINE])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output[result.output.index("{\n"):])
    video, audio = body["video"], body["audio"]
    assert Path(video["path"]).name.endswith(".mp4") and video["frames"] == 124 and video["fps"] == 24.0
    assert video["shape"] == [124, 32, 64, 3]  # the tiny checkpoint's own 16:9 canvas
    assert audio["sample_rate"] == 8000 and audio["channels"] == 2
    frames, channels, rate = _streams(Path(video["path"]).read_bytes())
    assert (frames, channels, rate) == (124, 2, 8000)


def _png_data_url(width: int, height: int, seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer.start(MODEL, args=INLINE)
    try:
        yield live
    finally:
        live.stop()


def _finished(server: LiveServer, video_id: str) -> dict:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = httpx.get(f"{server.url}/v1/videos/{video_id}", timeout=30).json()
        if job["status"] not in ("queued", "in_progress"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"video {video_id} did not finish")


@pytest.mark.parametrize("frames", [{}, {"input_reference": True}, {"input_reference": True, "last_frame": True}], ids=["t2va", "first", "first+last"])
def test_videos_route_serves_an_mp4_with_sound(server: LiveServer, frames: dict) -> None:
    import httpx

    body = {"model": MODEL, "prompt": "waves crash on the rocks", "seconds": "5", "size": "32x32", "seed": 3,
            "stage_params": {"dit": {"num_inference_steps": 2}}}
    body.update({field: _png_data_url(48, 32, index) for index, field in enumerate(frames)})
    job = httpx.post(f"{server.url}/v1/videos", json=body, timeout=60).json()
    assert _finished(server, job["id"])["status"] == "completed"
    content = httpx.get(f"{server.url}/v1/videos/{job['id']}/content", timeout=60)
    assert content.status_code == 200 and content.headers["content-type"].startswith("video/mp4")
    assert _streams(content.content) == (124, 2, 8000)


def test_openai_client_creates_polls_and_downloads_a_video(server: LiveServer, tmp_path: Path) -> None:
    """OpenAI's own client: `videos.create` posts a form (the first frame as a file upload, what
    `extra_body` adds as form fields), then poll, download, list and delete."""
    import warnings

    import openai
    from PIL import Image

    frame = tmp_path / "first.png"
    frame.write_bytes(base64.b64decode(_png_data_url(48, 32, 7).split(",", 1)[1]))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (OpenAI deprecates its own video models)
        with frame.open("rb") as upload:
            job = client.videos.create(
                model=MODEL, prompt="a kite in the wind", size="32x32", input_reference=upload,  # type: ignore[arg-type]
                extra_body={"seed": 2, "num_inference_steps": 2},  # (vLLM-Omni's field: the dit's parameter)
            )
        done = client.videos.poll(job.id, poll_interval_ms=200)
        assert (done.status, done.progress, done.size, done.seconds) == ("completed", 100, "32x32", "5.167")
        assert _streams(client.videos.download_content(job.id).content) == (124, 2, 8000)
        # The stills OpenAI's API offers: the first frame (WebP), 8 frames across the clip 4 a row (JPEG).
        thumbnail = client.videos.download_content(job.id, variant="thumbnail")
        spritesheet = client.videos.download_content(job.id, variant="spritesheet")
        assert (thumbnail.response.headers["content-type"], spritesheet.response.headers["content-type"]) == ("image/webp", "image/jpeg")
        stills = [Image.open(io.BytesIO(still.content)) for still in (thumbnail, spritesheet)]
        assert [(still.format, still.size) for still in stills] == [("WEBP", (32, 32)), ("JPEG", (128, 64))]
        with pytest.raises(openai.BadRequestError, match="variant"):
            client.videos.download_content(job.id, variant="poster")  # type: ignore[arg-type]
        assert job.id in [video.id for video in client.videos.list()]
        assert client.videos.delete(job.id).deleted
        with pytest.raises(openai.BadRequestError, match="multiples of 32"):
            client.videos.create(model=MODEL, prompt="a kite", size="33x32")  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="num_inference_steps counts"):  # (the form field reaches the dit)
            client.videos.create(model=MODEL, prompt="a kite", size="32x32", extra_body={"num_inference_steps": 1})  # type: ignore[arg-type]


def _cancelled(server: LiveServer) -> float:
    import httpx

    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("omni_requests_cancelled_total ")))


def test_video_jobs_report_progress_list_and_delete(server: LiveServer) -> None:
    """OpenAI's Videos API around the jobs: `progress` follows the steps, `GET /v1/videos` pages
    through the jobs (newest first), `DELETE` cancels a running job in the stages and forgets it."""
    import httpx

    body = {"model": MODEL, "prompt": "a storm at sea", "size": "256x256", "seed": 5, "stage_params": {"dit": {"num_inference_steps": 1000}}}
    long = httpx.post(f"{server.url}/v1/videos", json=body, timeout=60).json()
    assert (long["status"], long["progress"], long["size"], long["completed_at"]) == ("queued", 0, "256x256", None)
    deadline = time.monotonic() + 120
    while (job := httpx.get(f"{server.url}/v1/videos/{long['id']}", timeout=30).json())["progress"] == 0:
        assert job["status"] in ("queued", "in_progress") and time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["status"] == "in_progress" and 0 < job["progress"] < 100, job

    short = httpx.post(f"{server.url}/v1/videos", json={**body, "size": "32x32", "stage_params": {"dit": {"num_inference_steps": 2}}}, timeout=60).json()
    listed = httpx.get(f"{server.url}/v1/videos", params={"limit": 1}, timeout=30).json()
    assert [job["id"] for job in listed["data"]] == [short["id"]] and listed["has_more"] and listed["object"] == "list"
    after = httpx.get(f"{server.url}/v1/videos", params={"after": short["id"]}, timeout=30).json()
    assert after["data"][0]["id"] == long["id"]
    assert httpx.get(f"{server.url}/v1/videos", params={"limit": 0}, timeout=30).status_code == 400

    cancelled = _cancelled(server)
    deleted = httpx.delete(f"{server.url}/v1/videos/{long['id']}", timeout=30)
    assert deleted.json() == {"id": long["id"], "deleted": True, "object": "video.deleted"}
    assert _cancelled(server) == cancelled + 1  # the running request was aborted, not left to finish
    assert httpx.get(f"{server.url}/v1/videos/{long['id']}", timeout=30).status_code == 404
    assert httpx.delete(f"{server.url}/v1/videos/{long['id']}", timeout=30).status_code == 404

    done = _finished(server, short["id"])  # (the other job goes on)
    assert (done["status"], done["progress"], done["size"], done["seconds"]) == ("completed", 100, "32x32", "5.167"), done
    assert done["completed_at"] >= done["created_at"]


def _wav_data_url(seconds: float, rate: int) -> str:
    import soundfile

    buffer = io.BytesIO()
    samples = np.random.default_rng(0).uniform(-0.3, 0.3, (int(seconds * rate), 2)).astype(np.float32)
    soundfile.write(buffer, samples, rate, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_videos_route_takes_references(server: LiveServer) -> None:
    import httpx

    references = [{"type": "image", "image": _png_data_url(40, 40, 5)}, {"type": "audio", "audio": _wav_data_url(1.0, 8000)}]
    body = {"model": MODEL, "prompt": "a dog barks", "size": "32x32", "seed": 1, "references": references,
            "stage_params": {"dit": {"num_inference_steps": 2}}}
    job = httpx.post(f"{server.url}/v1/videos", json=body, timeout=60).json()
    assert _finished(server, job["id"])["status"] == "completed"
    content = httpx.get(f"{server.url}/v1/videos/{job['id']}/content", timeout=60)
    assert _streams(content.content) == (124, 2, 8000)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"size": "48x32"}, "size", "nearest valid: 64x32"),
        ({"size": "160x32"}, "size", "nearest valid: 160x64"),
        ({"seconds": "20"}, "seconds", "nearest valid: 345 frames"),
        ({"size": "32768x32768"}, "size", "nearest valid: 1024x1024 for 124 frames"),  # (not an out-of-memory worker)
        ({"seconds": "2"}, "seconds", "nearest valid: 124 frames"),
        ({"input_reference": "https://example.com/cat.png"}, "input_reference", "data URL"),
        ({"last_frame": "/etc/passwd"}, "last_frame", "data URL"),
        ({"references": [{"type": "image", "image": "https://example.com/a.png"}]}, "references", "data URLs"),
        ({"references": [{"type": "audio", "audio": "data:audio/wav;base64,AAAA"}]}, "references", "cannot decode"),
        # the engine, from the dit's declared parameters, before the encoder runs
        ({"stage_params": {"dit": {"temperature": 0.5}}}, "stage_params.dit.temperature", "it takes: cache, num_frames, num_inference_steps, seconds, seed, size"),
        ({"guidance_scale": 5.0}, "guidance_scale", "'dit' stage does not take it"),
    ],
)
def test_videos_route_refuses_bad_requests_with_400(server: LiveServer, body: dict, param: str, says: str) -> None:
    import httpx

    response = httpx.post(f"{server.url}/v1/videos", json={"model": MODEL, "prompt": "a cat", **body}, timeout=60)
    if response.status_code == 200:  # the job starts, then fails validation in the input processor
        job = _finished(server, response.json()["id"])
        assert job["status"] == "failed" and job["error"]["param"].startswith(param) and says in job["error"]["message"], job
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"].startswith(param) and says in error["message"], error


@pytest.mark.parametrize("modalities", [["video"], ["text", "video"], None])
def test_chat_completions_point_to_the_videos_route(server: LiveServer, modalities: list[str] | None) -> None:
    """A chat answer carries text, audio and images: a video asked there is a 400 naming /v1/videos
    (not a 200 that silently drops it); so is a chat asking for the text this model does not write."""
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "waves"}], **({"modalities": modalities} if modalities else {})}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "/v1/videos" in response.json()["error"]["message"], response.text
