"""Media files a person opens: MP4 video (with its audio track muxed), shared by the server and
`OmniResult`; compressed audio files (MP3, Opus, AAC) for the server's audio answers."""

from __future__ import annotations

import io
from typing import Any

import numpy as np


def encode_mp4(frames: Any, fps: float, audio: Any = None, sample_rate: int | None = None) -> bytes:
    """Frames (T, H, W, 3) uint8 -> H.264 MP4 bytes, with an AAC track when `audio` is given
    (float samples ``[N]`` mono, or ``[N, 2]`` stereo)."""
    import av

    video = np.asarray(frames)
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video frames must be (T, H, W, 3), got {video.shape}")
    if video.dtype != np.uint8:
        video = (np.clip(video, 0.0, 1.0) * 255).round().astype(np.uint8)
    height, width = video.shape[1] - video.shape[1] % 2, video.shape[2] - video.shape[2] % 2
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=max(1, round(fps)))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        audio_stream = audio_frame = None
        if audio is not None and sample_rate:
            audio_frame = _audio_frame(audio, sample_rate)
            audio_stream = container.add_stream("aac", rate=sample_rate)
            audio_stream.layout = audio_frame.layout.name
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[:height, :width]), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio_stream is not None and audio_frame is not None:
            for packet in audio_stream.encode(audio_frame):
                container.mux(packet)
            for packet in audio_stream.encode():
                container.mux(packet)
    return buffer.getvalue()


def _audio_frame(audio: Any, sample_rate: int) -> Any:
    """Float samples ``[N]`` (mono) or ``[N, 2]`` (stereo) as one PyAV frame."""
    import av

    samples = np.asarray(audio, dtype=np.float32)
    stereo = samples.ndim == 2 and samples.shape[1] == 2
    if samples.ndim == 2 and not stereo:
        raise ValueError(f"audio must be [N] (mono) or [N, 2] (stereo), got {samples.shape}")
    # Packed float samples: one plane, channels interleaved ([1, N * channels]).
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples).reshape(1, -1), format="flt", layout="stereo" if stereo else "mono")
    frame.sample_rate = sample_rate
    return frame


# format -> (container, codec, sample rates the codec takes: another is resampled to the last)
AUDIO_CODECS = {
    "mp3": ("mp3", "libmp3lame", (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)),
    "opus": ("ogg", "libopus", (8000, 12000, 16000, 24000, 48000)),
    "aac": ("adts", "aac", (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)),
}


def encode_audio_file(audio: Any, sample_rate: int, fmt: str) -> bytes:
    """Float samples (``[N]`` mono or ``[N, 2]`` stereo, in [-1, 1]) -> an ``mp3``, ``opus`` (Ogg) or
    ``aac`` (ADTS) file, at `sample_rate` where the codec takes it (Opus: 48 kHz otherwise)."""
    import av

    container_format, codec, rates = AUDIO_CODECS[fmt]
    frame = _audio_frame(np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0), sample_rate)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=sample_rate if sample_rate in rates else rates[-1])
        stream.layout = frame.layout.name
        # (the encoder resamples the frame to the stream's rate and sample format)
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()
