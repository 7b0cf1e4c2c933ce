"""`omni_core.media.encode_mp4` and `OmniResult` with mono and stereo soundtracks; whose prompt a result counts; MP3, Opus
and AAC files of a waveform."""

from __future__ import annotations

import io

import numpy as np
import pytest

from omni_core.engine.result import OmniResult
from omni_core.media import AUDIO_CODECS, encode_audio_file, encode_mp4
from omni_core.outputs import OutputDelta


def _tracks(data: bytes) -> tuple[int, int, int]:
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = sum(1 for _ in container.decode(video=0))
        container.seek(0)
        audio = container.streams.audio[0]
        channels = audio.codec_context.channels
        samples = sum(frame.samples for frame in container.decode(audio=0))
    return frames, channels, samples


@pytest.mark.parametrize("channels", [1, 2])
def test_mp4_keeps_the_channels(channels: int) -> None:
    rate = 16000
    t = np.arange(rate, dtype=np.float32) / rate
    left, right = 0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)
    audio = left if channels == 1 else np.stack([left, right], axis=1)
    frames = np.zeros((24, 32, 32, 3), np.uint8)
    got_frames, got_channels, got_samples = _tracks(encode_mp4(frames, 24.0, audio, rate))
    assert got_frames == 24 and got_channels == channels
    assert abs(got_samples - rate) <= 2048  # AAC pads to whole frames


def test_mp4_refuses_other_layouts() -> None:
    with pytest.raises(ValueError, match="stereo"):
        encode_mp4(np.zeros((2, 32, 32, 3), np.uint8), 24.0, np.zeros((100, 3), np.float32), 8000)


def test_result_keeps_stereo_audio_across_chunks() -> None:
    result = OmniResult("r")
    for index in range(2):
        result.add(OutputDelta("r", "dit", "audio", index, {"audio": np.full((10, 2), index, np.float32), "sample_rate": 100}, final=index == 1))
    assert result.audio.shape == (20, 2) and result.audio_duration == pytest.approx(0.2)
    mono = OmniResult("m")
    mono.add(OutputDelta("m", "s", "audio", 0, {"audio": np.zeros((1, 10), np.float32), "sample_rate": 100}, final=True))
    assert mono.audio.shape == (10,)


def test_result_json_names_frames_and_channels() -> None:
    result = OmniResult("v")
    result.add(OutputDelta("v", "dit", "video", 0, {"video": np.zeros((5, 8, 8, 3), np.uint8), "fps": 24.0,
                                                   "audio": np.zeros((100, 2), np.float32), "sample_rate": 8000}, final=True))
    body = result.to_json({"video": "v.mp4"})
    assert body["video"]["frames"] == 5 and body["video"]["fps"] == 24.0 and body["video"]["path"] == "v.mp4"
    assert body["audio"]["channels"] == 2 and body["audio"]["sample_rate"] == 8000 and body["audio"]["num_samples"] == 100
    assert body["finish_reason"] == "stop"  # (no text stage gave one: as the server reports it)


def test_result_counts_the_text_stages_prompt_else_the_first_one_sent() -> None:
    """An image alone counts its diffusion stage's prompt; where a text stage answers too, its prompt,
    whichever arrives first (a request's ``usage`` reads `prompt_token_ids`)."""
    image = np.zeros((4, 4, 3), np.uint8)
    alone = OmniResult("a")
    alone.add(OutputDelta("a", "dit", "image", 0, {"image": image, "prompt_token_ids": [1, 2, 3]}))
    alone.add(OutputDelta("a", "dit", "image", 1, {"image": image, "prompt_token_ids": [9]}, final=True))
    assert alone.prompt_token_ids == [1, 2, 3] and len(alone.images) == 2 and not alone.extra
    both = OmniResult("b")
    both.add(OutputDelta("b", "dit", "image", 0, {"image": image, "prompt_token_ids": [1, 2, 3, 4, 5]}))
    both.add(OutputDelta("b", "ar", "text", 0, {"text": "hi", "prompt_token_ids": [7, 8]}))
    both.add(OutputDelta("b", "ar", "text", 1, {"text": "!", "prompt_token_ids": [6]}, final=True))
    assert both.prompt_token_ids == [7, 8] and both.text == "hi!"


@pytest.mark.parametrize("fmt", list(AUDIO_CODECS))
@pytest.mark.parametrize(("rate", "channels"), [(24000, 1), (32000, 2), (22050, 1)])
def test_compressed_audio_keeps_the_sound(fmt: str, rate: int, channels: int) -> None:
    """Decoded again (FFmpeg), a file holds the tone it was given (440 Hz; 660 Hz on the right), as long
    as it was (to a few codec frames), at the rate given (an Opus file decodes at 48 kHz whatever it was
    encoded at)."""
    import av

    t = np.arange(rate * 2, dtype=np.float32) / rate
    left, right = 0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)
    audio = left if channels == 1 else np.stack([left, right], axis=1)
    with av.open(io.BytesIO(encode_audio_file(audio, rate, fmt))) as container:
        stream = container.streams.audio[0]
        decoded = np.concatenate([frame.to_ndarray() for frame in container.decode(stream)], axis=1)  # planar: [channels, N]
        got_rate, got_channels = stream.rate, stream.codec_context.channels
    assert got_channels == channels and got_rate == (48000 if fmt == "opus" else rate)
    assert abs(decoded.shape[1] / got_rate - 2.0) < 0.1
    for channel, tone in zip(decoded, (440, 660)):
        spectrum = np.abs(np.fft.rfft(channel))
        assert np.fft.rfftfreq(len(channel), 1 / got_rate)[spectrum.argmax()] == pytest.approx(tone, abs=2)
