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


def encode_audio(samples: Any, sample_rate: int, fmt: str) -> tuple[bytes, str]:
    """Encode a waveform as ``wav``, ``flac`` or raw ``pcm``/``pcm16``; returns (bytes, media type)."""
    if fmt in ("pcm", "pcm16"):
        return pcm16(samples), "audio/pcm"
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
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image)).save(buffer, format="PNG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
