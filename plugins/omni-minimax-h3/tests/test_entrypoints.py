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
        if job["status"] != "in_progress":
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
        ({"seconds": "2"}, "seconds", "nearest valid: 124 frames"),
        ({"input_reference": "https://example.com/cat.png"}, "input_reference", "data URL"),
        ({"last_frame": "/etc/passwd"}, "last_frame", "data URL"),
        ({"references": [{"type": "image", "image": "https://example.com/a.png"}]}, "references", "data URLs"),
        ({"references": [{"type": "audio", "audio": "data:audio/wav;base64,AAAA"}]}, "references", "cannot decode"),
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
