"""Audio and image encodings for HTTP responses."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np



def pcm16(samples: Any) -> bytes:
    """float32 samples in [-1, 1] -> little-endian 16-bit PCM bytes."""
    array = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return (array * 32767.0).astype("<i2").tobytes()


# Media types of the compressed formats (`omni_core.media.encode_audio_file`).
COMPRESSED_AUDIO = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac"}


def encode_audio(samples: Any, sample_rate: int, fmt: str) -> tuple[bytes, str]:
    """Encode a waveform as ``wav``, ``flac``, ``mp3``, ``opus``, ``aac`` or raw ``pcm``/``pcm16``;
    returns (bytes, media type)."""
    if fmt in ("pcm", "pcm16"):
        return pcm16(samples), "audio/pcm"
    if fmt in COMPRESSED_AUDIO:
        from omni_core.media import encode_audio_file

        return encode_audio_file(samples, sample_rate, fmt), COMPRESSED_AUDIO[fmt]
    import soundfile

    buffer = io.BytesIO()
    array = np.asarray(samples, dtype=np.float32).reshape(-1)
    if fmt == "wav":
        soundfile.write(buffer, array, sample_rate, format="WAV", subtype="PCM_16")
        return buffer.getvalue(), "audio/wav"
    if fmt == "flac":
        soundfile.write(buffer, array, sample_rate, format="FLAC")
        return buffer.getvalue(), "audio/flac"
    raise ValueError(f"unsupported audio format {fmt!r}")


def encode_png(image: Any) -> bytes:
    return encode_image(image, "png")


def encode_image(image: Any, fmt: str, compression: int | None = None) -> bytes:
    """An RGB image (``[H, W, 3]`` uint8) as ``png``, ``jpeg`` or ``webp``; `compression` (0-100, as
    OpenAI's ``output_compression``: 0 the least) sets JPEG/WebP quality to ``100 - compression``
    (default: Pillow's, 75)."""
    from PIL import Image

    options: dict[str, Any] = {}
    if compression is not None and fmt in ("jpeg", "webp"):
        options["quality"] = 100 - compression
    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image)).save(buffer, format=fmt.upper(), **options)
    return buffer.getvalue()


def image_size(image: Any) -> str:
    """An image's size as OpenAI writes it, ``"WIDTHxHEIGHT"``."""
    height, width = np.asarray(image).shape[:2]
    return f"{width}x{height}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
