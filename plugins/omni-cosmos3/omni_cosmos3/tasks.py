"""Cosmos3 request parameters: parsing and validation, before any work starts (no torch here).

Tasks: ``t2i`` (text -> image), ``t2v`` (text -> video), ``t2va`` (text -> video with a
synchronized audio track), and the action tasks of checkpoints trained with ``action_gen``:
``policy`` (text + a first frame -> a video rollout and the robot actions that produce it) and
``inverse_dynamics`` (text + a video -> the actions connecting its frames). An action request names
its embodiment (``domain``, e.g. ``bridge_orig_lerobot``: it fixes the action width) and its
``chunk_size`` (action steps; the video has ``chunk_size + 1`` frames); its size comes from the
conditioning frames and the ``resolution_tier`` (256, 480, 704, 720), as in diffusers. Where a request gives no size, it gets one in transformer tokens, so a
tiny checkpoint (few pixels per token) gets a small default and a real one (32 pixels per token)
a real one: images 32x32 tokens (1024x1024 on the released checkpoints), videos 20x12 tokens.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from omni_core.engine.params import int_param, number_param
from omni_core.errors import InvalidRequestError

TASKS = ("t2i", "t2v", "t2va", "policy", "inverse_dynamics")
ACTION_TASKS = ("policy", "inverse_dynamics")
RESOLUTION_TIERS = (256, 480, 704, 720)
VIEW_POINTS = ("ego_view", "third_person_view", "wrist_view", "concat_view")
DEFAULT_TIER = 480
MAX_CHUNK = 256
DEFAULT_STEPS = 35
DEFAULT_GUIDANCE = 6.0
DEFAULT_FPS = 24.0
DEFAULT_SECONDS = 1.0
IMAGE_TOKENS = (32, 32)  # (width, height) in transformer tokens
VIDEO_TOKENS = (20, 12)
MAX_N = 8


@attrs.frozen
class Request:
    """A validated Cosmos3 request (one or `n` samples with seeds ``seed``, ``seed + 1``, ...)."""

    task: str
    prompt: str
    width: int
    height: int
    num_frames: int
    fps: float
    num_inference_steps: int
    guidance_scale: float
    negative_prompt: str | None = None
    seed: int | None = None
    n: int = 1
    use_system_prompt: bool | None = None
    action: ActionSpec | None = None

    @property
    def sound(self) -> bool:
        return self.task == "t2va"


@attrs.frozen
class ActionSpec:
    """The action part of a ``policy``/``inverse_dynamics`` request (`diffusers`' `CosmosActionCondition`).

    `frames`: the conditioning frames as PIL images (one for a first frame, several for a video).
    """

    domain: str
    chunk_size: int
    resolution_tier: int
    view_point: str
    frames: list[Any] = attrs.field(repr=False)
    is_video: bool = False


def parse_request(data: dict[str, Any], params: dict[str, Any], pixels_per_token: int, temporal_factor: int) -> Request:
    """Stage input `data` (prompt, size, seconds, seed, n, task) and `params` -> a `Request`.

    Raises `InvalidRequestError` naming the parameter: unknown task, a size not divisible by
    `pixels_per_token` (VAE downsampling x patch size), zero or negative steps, a bad seed ...
    """
    unknown = sorted(set(params) - PARAMS)
    if unknown:
        raise InvalidRequestError(f"unknown Cosmos3 parameters {unknown}; known: {sorted(PARAMS)}", param=unknown[0])
    merged = {**data, **params}
    task = merged.get("task") or "t2i"
    if task not in TASKS:
        raise InvalidRequestError(f"unknown task {task!r}; Cosmos3 does: {', '.join(TASKS)}", param="task")
    prompt = merged.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequestError("Cosmos3 needs a non-empty text prompt", param="prompt")
    steps = int_param(merged.get("num_inference_steps", DEFAULT_STEPS), "num_inference_steps")
    if steps < 1:
        raise InvalidRequestError(f"num_inference_steps must be at least 1, got {steps}", param="num_inference_steps")
    guidance = number_param(merged.get("guidance_scale", DEFAULT_GUIDANCE), "guidance_scale")
    if guidance < 1.0:
        raise InvalidRequestError(f"guidance_scale must be >= 1.0 (1.0 turns guidance off), got {guidance}", param="guidance_scale")
    fps = number_param(merged.get("fps", DEFAULT_FPS), "fps")
    if fps <= 0:
        raise InvalidRequestError(f"fps must be positive, got {fps}", param="fps")
    width, height = _size(task, merged, pixels_per_token)
    action = None
    if task in ACTION_TASKS:
        action = _action(task, merged, temporal_factor)
        # The size comes from the conditioning frames and the tier (the model resolves it).
        num_frames = action.chunk_size + 1
    else:
        stray = sorted(k for k in ACTION_FIELDS if merged.get(k) is not None)
        if stray:
            raise InvalidRequestError(f"{stray} only apply to the action tasks {list(ACTION_TASKS)}, not {task!r}", param=stray[0])
        num_frames = _frames(task, merged, fps, temporal_factor)
    seed = merged.get("seed")
    if seed is not None:
        seed = int_param(seed, "seed")
        if not 0 <= seed < 2**63 - MAX_N:
            raise InvalidRequestError(f"seed must be a non-negative 63-bit integer, got {seed}", param="seed")
    n = int_param(merged.get("n", 1), "n")
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    negative = merged.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise InvalidRequestError("negative_prompt must be a string", param="negative_prompt")
    system = merged.get("use_system_prompt")
    if system is not None and not isinstance(system, bool):
        raise InvalidRequestError("use_system_prompt must be true or false", param="use_system_prompt")
    return Request(task, prompt, width, height, num_frames, fps, steps, guidance, negative, seed, n, system, action)


ACTION_FIELDS = ("domain", "chunk_size", "resolution_tier", "view_point", "image", "video")
# The generator stage's per-request parameters (`Cosmos3Model.request_params`).
PARAMS = frozenset(
    {"task", "num_inference_steps", "guidance_scale", "negative_prompt", "fps", "num_frames", "seed",
     "use_system_prompt", "size", "seconds", "n", *ACTION_FIELDS}
)


def _size(task: str, merged: dict[str, Any], pixels_per_token: int) -> tuple[int, int]:
    if task in ACTION_TASKS:
        for name in ("size", "num_frames", "seconds"):
            if merged.get(name) is not None:
                raise InvalidRequestError(
                    f"{name} does not apply to task {task!r}: the conditioning frames and resolution_tier set the size, "
                    "chunk_size the number of frames",
                    param=name,
                )
        return 0, 0
    default_tokens = IMAGE_TOKENS if task == "t2i" else VIDEO_TOKENS
    size = merged.get("size") or (default_tokens[0] * pixels_per_token, default_tokens[1] * pixels_per_token)
    if not (isinstance(size, (list, tuple)) and len(size) == 2):
        raise InvalidRequestError(f"size must be (width, height), got {size!r}", param="size")
    width, height = (int_param(v, "size") for v in size)
    if width < 1 or height < 1 or width % pixels_per_token or height % pixels_per_token:
        raise InvalidRequestError(
            f"size {width}x{height} is not a multiple of this model's patch of {pixels_per_token} pixels "
            f"(VAE downsampling x transformer patch); e.g. {_round(width, pixels_per_token)}x{_round(height, pixels_per_token)}",
            param="size",
        )
    return width, height


def _action(task: str, merged: dict[str, Any], temporal_factor: int) -> ActionSpec:
    domain = merged.get("domain")
    if not isinstance(domain, str) or not domain:
        raise InvalidRequestError(
            f"task {task!r} needs the embodiment `domain` (e.g. 'bridge_orig_lerobot'): it selects the action head and width",
            param="domain",
        )
    chunk = int_param(merged.get("chunk_size"), "chunk_size") if merged.get("chunk_size") is not None else None
    if chunk is None or not 1 <= chunk <= MAX_CHUNK or chunk % temporal_factor:
        raise InvalidRequestError(
            f"chunk_size (action steps; the video has chunk_size + 1 frames) must be a multiple of {temporal_factor} "
            f"(the VAE's temporal compression) between {temporal_factor} and {MAX_CHUNK}, got {merged.get('chunk_size')!r}",
            param="chunk_size",
        )
    tier = int_param(merged.get("resolution_tier", DEFAULT_TIER), "resolution_tier")
    if tier not in RESOLUTION_TIERS:
        raise InvalidRequestError(f"resolution_tier must be one of {list(RESOLUTION_TIERS)}, got {tier}", param="resolution_tier")
    view_point = merged.get("view_point", "ego_view")
    if view_point not in VIEW_POINTS:
        raise InvalidRequestError(f"view_point must be one of {list(VIEW_POINTS)}, got {view_point!r}", param="view_point")
    image, video = merged.get("image"), merged.get("video")
    if image is not None and video is not None:
        raise InvalidRequestError("give either `image` (a first frame) or `video`, not both", param="image")
    if task == "inverse_dynamics" and video is None:
        raise InvalidRequestError("task 'inverse_dynamics' needs a `video` (the frames whose actions it infers)", param="video")
    if image is None and video is None:
        raise InvalidRequestError(f"task {task!r} needs a first frame: `image` (or a `video`, whose first frame is used)", param="image")
    frames = [load_image(image)] if image is not None else load_video(video)
    return ActionSpec(domain, chunk, tier, view_point, frames, is_video=video is not None)


def load_image(value: Any) -> Any:
    """An image as a PIL RGB image: a PIL image, an HxWx3 uint8 array, encoded image bytes, a base64
    ``data:image/...`` URL or (offline only: JSON has no such type) a `pathlib.Path`.

    A string is never opened as a path or fetched: a request's string is its data (a server
    resolves what its operator allowed into a data URL first, `omni_core.media_access`). Sizes are
    checked from the header before decoding (`omni_core.media_decode`).
    """
    from PIL import Image

    from omni_core.media_decode import open_image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, (str, bytes, os.PathLike)):
        return open_image(_media_bytes(value, "image"), "image")
    array = _uint8_frames(value, 3, "image")
    return Image.fromarray(array)


def load_video(value: Any) -> list[Any]:
    """A video as PIL RGB frames: a list of images, a TxHxWx3 uint8 array, encoded video bytes, a
    base64 ``data:video/...`` URL or (offline only) a `pathlib.Path`; the frame size and count are
    checked from the container before decoding and while decoding."""
    from PIL import Image

    if isinstance(value, (str, bytes, os.PathLike)):
        frames = _decode_video(_media_bytes(value, "video"))
    elif isinstance(value, (list, tuple)):
        frames = [load_image(frame) for frame in value]
    else:
        frames = [Image.fromarray(frame) for frame in _uint8_frames(value, 4, "video")]
    if not frames:
        raise InvalidRequestError("the video has no frames", param="video")
    return frames


def _media_bytes(value: str | bytes | os.PathLike, name: str) -> bytes:
    """The encoded bytes of a medium given as a data URL, bytes or a `pathlib.Path`."""
    from omni_core.media_access import data_url_bytes

    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        if value[:5].lower() != "data:":
            shown = value if len(value) <= 60 else f"{value[:57]}..."
            raise InvalidRequestError(
                f"{name} must be a base64 data URL (data:{'image/png' if name == 'image' else 'video/mp4'};base64,...), got "
                f"{shown!r}: a string is never opened as a path or URL (offline, pass an array, PIL image(s) or a pathlib.Path)",
                param=name,
            )
        return data_url_bytes(value, name)[1]
    try:
        with open(value, "rb") as file:
            return file.read()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {name} {os.fspath(value)!r}: {exc.strerror}", param=name) from None


def _decode_video(raw: bytes) -> list[Any]:
    import io

    import av

    from omni_core.media_decode import check_frame_count, check_video_stream

    frames: list[Any] = []
    try:
        with av.open(io.BytesIO(raw)) as container:
            if not container.streams.video:
                raise InvalidRequestError("the video has no video stream", param="video")
            stream = container.streams.video[0]
            check_video_stream(stream, "video")
            for frame in container.decode(stream):
                check_frame_count(len(frames) + 1, frame.width, frame.height, "video")
                frames.append(frame.to_image().convert("RGB"))
    except (OSError, ValueError, av.error.FFmpegError) as exc:
        raise InvalidRequestError(f"cannot decode the video: {exc}", param="video") from None
    return frames


def _uint8_frames(value: Any, ndim: int, name: str) -> Any:
    import numpy as np

    array = np.asarray(value) if not isinstance(value, (int, float, dict)) else None
    shape = "TxHxWx3" if ndim == 4 else "HxWx3"
    if array is None or array.ndim != ndim or array.shape[-1] != 3 or array.dtype != np.uint8 or 0 in array.shape:
        got = f"an array of shape {array.shape} and dtype {array.dtype}" if array is not None else repr(value)
        raise InvalidRequestError(f"{name} must be a {shape} uint8 array, a data: URL or PIL image(s); got {got}", param=name)
    return array


def _frames(task: str, merged: dict[str, Any], fps: float, temporal_factor: int) -> int:
    if task == "t2i":
        return 1
    if merged.get("num_frames") is not None:
        frames = int_param(merged["num_frames"], "num_frames")
        if frames < 1 + temporal_factor or (frames - 1) % temporal_factor:
            raise InvalidRequestError(
                f"num_frames must be 1 + {temporal_factor} * k with k >= 1 (the VAE's temporal compression), got {frames}",
                param="num_frames",
            )
        return frames
    seconds = number_param(merged.get("seconds", DEFAULT_SECONDS), "seconds")
    if seconds <= 0 or seconds > 60:
        raise InvalidRequestError(f"seconds must be in (0, 60], got {seconds}", param="seconds")
    steps = max(1, round(seconds * fps / temporal_factor))
    return 1 + temporal_factor * steps


def _round(value: int, multiple: int) -> int:
    return max(multiple, round(value / multiple) * multiple)


