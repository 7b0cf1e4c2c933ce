"""Media files a person opens: MP4 video (with its audio track muxed), shared by the server and `OmniResult`."""

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
        audio_stream = None
        samples = None
        if audio is not None and sample_rate:
            samples = np.asarray(audio, dtype=np.float32)
            stereo = samples.ndim == 2 and samples.shape[1] == 2
            if samples.ndim == 2 and not stereo:
                raise ValueError(f"audio must be [N] (mono) or [N, 2] (stereo), got {samples.shape}")
            layout = "stereo" if stereo else "mono"
            audio_stream = container.add_stream("aac", rate=sample_rate)
            audio_stream.layout = layout
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[:height, :width]), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio_stream is not None and samples is not None:
            # Packed float samples: one plane, channels interleaved ([1, N * channels]).
            audio_frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples).reshape(1, -1), format="flt", layout=layout)
            audio_frame.sample_rate = sample_rate
            for packet in audio_stream.encode(audio_frame):
                container.mux(packet)
            for packet in audio_stream.encode():
                container.mux(packet)
    return buffer.getvalue()
