"""Decoding a request's media with bounds checked first: what the header or the container says is
checked before the pixels or samples are decoded, so a small file that declares a huge image, hours
of audio or millions of frames costs a header read and a 400, not the machine's memory.

The limits are module constants (a family may pass tighter ones); every refusal is an
`InvalidRequestError` naming the limit. Imports of PIL, soundfile and PyAV happen in the functions.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

from omni_core.errors import InvalidRequestError

# An image's pixel count (width x height), read from its header.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# Seconds of audio in one audio input.
MAX_AUDIO_SECONDS = 600.0
# Frames of one video, and their pixels summed (decoded RGB takes 3 bytes a pixel).
MAX_VIDEO_FRAMES = 20_000
MAX_VIDEO_PIXELS = 2**31
# What "a readable image" means in a refusal: the formats PIL reads (its common ones named).
READABLE_IMAGES = "PNG, JPEG, WebP, GIF, BMP, TIFF, ..."


def open_image(raw: bytes, where: str, param: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """Encoded image bytes -> a PIL RGB image, its size checked (from the header) before decoding."""
    from PIL import Image

    with _image_errors(where, param or where, max_pixels), Image.open(io.BytesIO(raw)) as image:  # (the header only)
        check_image_size(image.width, image.height, where, param, max_pixels)
        image.load()
        return image.convert("RGB")


def check_image(raw: bytes, where: str, param: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS) -> str:
    """A 400 unless encoded image bytes have the header of an image PIL reads, of at most
    `max_pixels` pixels: what a server checks before the family decodes the pixels. Returns the
    image's media type, as its header says (``image/png``, ...)."""
    from PIL import Image

    with _image_errors(where, param or where, max_pixels), Image.open(io.BytesIO(raw)) as image:
        check_image_size(image.width, image.height, where, param, max_pixels)
        return Image.MIME.get(image.format or "", f"image/{(image.format or 'unknown').lower()}")


@contextlib.contextmanager
def _image_errors(where: str, param: str, max_pixels: int) -> Iterator[None]:
    """PIL's failures while opening or decoding an image as `InvalidRequestError`s naming `where`."""
    from PIL import Image, UnidentifiedImageError

    try:
        yield
    except Image.DecompressionBombError as exc:  # over PIL's own, larger limit: refused in `open`
        import re

        found = re.search(r"\((\d+) pixels\)", str(exc))
        said = f"{found.group(1)} pixels" if found else f"more than {max_pixels} pixels"
        raise InvalidRequestError(
            f"{where}: the image is {said}; images are limited to {max_pixels} pixels: downscale it first", param=param
        ) from None
    except UnidentifiedImageError:
        raise InvalidRequestError(f"{where}: cannot decode the image: not a readable image ({READABLE_IMAGES})", param=param) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise InvalidRequestError(f"{where}: cannot decode the image ({_reason(exc)})", param=param) from None


def check_image_size(width: int, height: int, where: str, param: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """A 400 for an image (or video frame) of more than `max_pixels` pixels."""
    if width * height > max_pixels:
        raise _too_many_pixels(where, param or where, width, height, max_pixels)


def read_audio(raw: bytes, where: str, param: str | None = None, max_seconds: float = MAX_AUDIO_SECONDS) -> tuple[Any, int]:
    """Encoded audio bytes (wav/flac/ogg/mp3: what libsndfile reads) -> (float32 samples
    ``[N, channels]``, sample rate), the duration checked from the header before decoding, and the
    decoding itself stopped past the limit (a header may lie)."""
    import soundfile

    param = param or where
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as file:
            rate = int(file.samplerate)
            limit = int(max_seconds * rate)
            if file.frames > limit:
                raise _too_long(where, param, file.frames / rate, max_seconds)
            samples = file.read(limit + 1, dtype="float32", always_2d=True)
    except InvalidRequestError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{where}: cannot decode the audio as wav/mp3/flac ({_reason(exc)})", param=param) from None
    if samples.shape[0] > limit:
        raise _too_long(where, param, None, max_seconds)
    return samples, rate


def check_video_stream(stream: Any, where: str, param: str | None = None, max_frames: int = MAX_VIDEO_FRAMES) -> None:
    """Check a PyAV video stream's frame size and frame count (as the container declares them, or
    its duration x frame rate) against the limits, before its frames are decoded."""
    param = param or where
    context = stream.codec_context
    width, height = int(context.width or 0), int(context.height or 0)
    check_image_size(width, height, where, param)
    frames = int(stream.frames or 0)
    if not frames and stream.duration and stream.time_base and stream.average_rate:
        frames = int(float(stream.duration * stream.time_base) * float(stream.average_rate))
    check_frame_count(frames, width, height, where, param, max_frames)


def check_frame_count(frames: int, width: int, height: int, where: str, param: str | None = None, max_frames: int = MAX_VIDEO_FRAMES) -> None:
    """A 400 for a video of more than `max_frames` frames or `MAX_VIDEO_PIXELS` pixels in all;
    decoders call it as frames arrive too (a container may declare less than it holds)."""
    param = param or where
    if frames > max_frames:
        raise InvalidRequestError(f"{where}: the video has {frames} frames or more; videos are limited to {max_frames} frames", param=param)
    if frames * width * height > MAX_VIDEO_PIXELS:
        raise InvalidRequestError(
            f"{where}: the video has {frames} frames of {width}x{height} or more; videos are limited to {MAX_VIDEO_PIXELS} "
            "pixels in all: send fewer or smaller frames",
            param=param,
        )


def _too_many_pixels(where: str, param: str, width: int, height: int, max_pixels: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"{where}: the image is {width}x{height}; images are limited to {max_pixels} pixels: downscale it first", param=param
    )


def _too_long(where: str, param: str, seconds: float | None, max_seconds: float) -> InvalidRequestError:
    said = f"{seconds:.0f} s long" if seconds is not None else "longer than the limit"
    return InvalidRequestError(f"{where}: the audio is {said}; audio inputs are limited to {max_seconds:g} s", param=param)


def _reason(exc: BaseException) -> str:
    """A decoder's reason minus the Python object reprs some put in it (``<_io.BytesIO object at 0x...>``)."""
    import re

    return re.sub(r"\s*<[^<>]* object at 0x[0-9a-f]+>", "", str(exc)).strip() or type(exc).__name__
