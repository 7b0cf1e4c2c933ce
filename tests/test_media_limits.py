"""`omni_core.media_decode`: sizes and durations are checked from headers and container metadata
before decoding, so a small file declaring a huge medium fails fast with a 400 naming the limit."""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest

from omni_core.errors import InvalidRequestError
from omni_core.media_decode import MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS, check_video_stream, open_image, read_audio


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height (RGB, 8 bit) and carries a few bytes of image data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(("width", "height"), [(10_000, 10_000), (200_000, 200_000)], ids=["over-ours", "over-pil-bomb-limit"])
def test_a_huge_declared_image_fails_fast_naming_the_limit(width: int, height: int) -> None:
    raw = png_header_only(width, height)
    assert len(raw) < 200
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        open_image(raw, "messages[0].content[0]", "messages")
    assert time.monotonic() - started < 1.0
    assert f"limited to {MAX_IMAGE_PIXELS} pixels" in str(info.value) and (f"{width}x{height}" in str(info.value) or f"{width * height} pixels" in str(info.value))
    assert info.value.param == "messages"


def test_images_within_the_limit_decode() -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buffer, format="PNG")
    image = open_image(buffer.getvalue(), "x")
    assert image.size == (40, 30) and image.mode == "RGB" and image.getpixel((0, 0)) == (200, 10, 10)
    with pytest.raises(InvalidRequestError, match="cannot decode the image"):
        open_image(b"junk" * 10, "x")
    with pytest.raises(InvalidRequestError, match="limited to 100 pixels"):
        open_image(buffer.getvalue(), "x", max_pixels=100)


def test_audio_longer_than_the_limit_is_refused_from_its_header() -> None:
    import soundfile

    rate = 8000
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(int((MAX_AUDIO_SECONDS + 10) * rate), np.float32), rate, format="FLAC")
    assert len(buffer.getvalue()) < 1_000_000  # minutes of silence, a small file
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match=f"limited to {MAX_AUDIO_SECONDS:g} s"):
        read_audio(buffer.getvalue(), "x")
    assert time.monotonic() - started < 1.0
    short = io.BytesIO()
    soundfile.write(short, np.full(800, 0.25, np.float32), rate, format="WAV")
    samples, got_rate = read_audio(short.getvalue(), "x")
    assert got_rate == rate and samples.shape == (800, 1) and abs(float(samples[0, 0]) - 0.25) < 1e-4
    with pytest.raises(InvalidRequestError, match="limited to 0.05 s"):
        read_audio(short.getvalue(), "x", max_seconds=0.05)


def test_video_frame_count_and_size_are_checked_from_the_container() -> None:
    import av

    from omni_core.media import encode_mp4

    raw = encode_mp4(np.zeros((6, 16, 16, 3), np.uint8), fps=6)
    with av.open(io.BytesIO(raw)) as container:
        stream = container.streams.video[0]
        check_video_stream(stream, "x", max_frames=6)
        with pytest.raises(InvalidRequestError, match="limited to 5 frames"):
            check_video_stream(stream, "x", max_frames=5)
