"""``POST /v1/videos`` bodies -> requests: the first/last frame and reference fields, data URLs only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omni_core.server.errors import APIError
from omni_core.server.protocol import VideoRequest
from omni_core.server.requests import video_request

PIPELINE = SimpleNamespace(modalities=("video", "audio"), stages=())
PNG = "data:image/png;base64,iVBORw0KGgo="


def test_frames_and_references_become_request_fields() -> None:
    body = VideoRequest(
        model="m", prompt="a cat", seconds="5", size="64x32", input_reference=PNG, last_frame=PNG,
        references=[{"type": "image", "image": PNG}, {"type": "audio", "audio": "data:audio/wav;base64,UklGRg=="}],
    )
    request = video_request(body, PIPELINE)  # type: ignore[arg-type]
    assert request.extra["image"] == PNG and request.extra["last_image"] == PNG
    assert request.extra["size"] == (64, 32) and request.extra["seconds"] == 5.0
    assert [r["type"] for r in request.extra["references"]] == ["image", "audio"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input_reference": "https://example.com/cat.png"}, "input_reference"),
        ({"last_frame": "/etc/passwd"}, "last_frame"),
        ({"references": [{"type": "image", "image": "file:///etc/passwd"}]}, "references"),
        ({"references": [{"type": "audio", "audio": "https://example.com/a.wav"}]}, "references"),
    ],
)
def test_media_that_would_be_fetched_or_read_is_refused(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        video_request(VideoRequest(model="m", prompt="a cat", **fields), PIPELINE)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == param
