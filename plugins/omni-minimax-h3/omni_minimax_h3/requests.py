"""MiniMax-H3 request parameters: parsed and validated before any model work (no torch here).

The rules are diffusers' (``before_denoise.py`` / ``before_encoder.py``), with the fix in each message:

- 24 fps; a frame count is snapped *up* to the next ``17 n + 5`` the video VAE encodes (``clip_length
  n + tokens_chunk_size``), and that aligned count must last between 5 and 15 seconds; ``seconds``
  becomes ``round(seconds * fps)`` frames, then the same rule.
- width and height are multiples of the canvas multiple (the VAE's spatial compression times the
  transformer's patch: 32 on the release), with an aspect ratio between 1:4 and 4:1.
- ours, not diffusers' (which takes any size, however large): a video holds at most the checkpoint's
  canvas area (``canvas_max_pixels``, 768x1344 on the release) times the longest clip's frames, so one
  request cannot take the memory every other request needs; a shorter clip may be larger.
- ``num_inference_steps`` counts sigma grid points, the terminal zero included (diffusers'
  `MiniMaxH3Scheduler`): at least 2, which is one transformer forward.

Every number comes from the checkpoint (`Geometry`), read once by whoever validates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

from omni_core.engine.params import int_param, number_param
from omni_core.errors import InvalidRequestError

DEFAULT_STEPS = 50
MAX_STEPS = 1000
# The dit stage's per-request parameters a user sets (its runtime adds ``cache``); the input processor
# hands the dit more of its own (the presentation's token tags, keyframes, references).
USER_PARAMS = frozenset({"seed", "size", "num_frames", "seconds", "num_inference_steps"})


@attrs.frozen
class Geometry:
    """What a request is checked against, from the checkpoint's configs and the pipeline's facts."""

    canvas_multiple: int  # VAE spatial compression x transformer patch
    frames_per_chunk: int  # the VAE's clip_length (17)
    latents_per_chunk: int  # the VAE's tokens_chunk_size (5)
    fps: int
    min_duration: float
    max_duration: float
    canvas_short_edge: int
    canvas_max_pixels: int
    audio_sample_rate: int = 32000
    min_aspect_ratio: float = 1 / 4
    max_aspect_ratio: float = 4.0
    # The largest canvas `default_canvas` gives over the aspect ratios (rounding may lift it a little
    # above canvas_max_pixels): with `max_frames`, the bound on a video's pixels x frames.
    largest_canvas: tuple[int, int] = attrs.field()

    @largest_canvas.default
    def _largest_canvas(self) -> tuple[int, int]:
        low, high = math.log(self.min_aspect_ratio), math.log(self.max_aspect_ratio)
        ratios = [math.exp(low + (high - low) * i / 400) for i in range(401)]
        return max((self.default_canvas(ratio, 1) for ratio in ratios), key=lambda size: (size[0] * size[1], size))

    @classmethod
    def from_checkpoint(cls, model_path: str | Path) -> Geometry:
        """Read the geometry of a diffusers-layout checkpoint (JSON files; diffusers' pipeline facts)."""
        from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as facts

        root = Path(model_path)
        vae = json.loads((root / "vae" / "config.json").read_text())
        transformer = json.loads((root / "transformer" / "config.json").read_text())
        audio_vae = json.loads((root / "audio_vae" / "config.json").read_text())
        index = json.loads((root / "modular_model_index.json").read_text())
        temporal = math.prod(vae.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
        clip_length = int(vae.get("clip_length", 17))
        pipe = facts.MiniMaxH3ModularPipeline  # its facts are properties of an instance without components
        probe = pipe.__new__(pipe)
        return cls(
            canvas_multiple=math.prod(vae.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1))) * int(transformer.get("patch_size", (1, 2, 2))[2]),
            frames_per_chunk=clip_length,
            latents_per_chunk=math.ceil(clip_length / temporal),  # AutoencoderKLMiniMaxH3.tokens_chunk_size
            fps=int(probe.fps),
            min_duration=float(probe.min_duration),
            max_duration=float(probe.max_duration),
            canvas_short_edge=int(index.get("canvas_short_edge", 768)),
            canvas_max_pixels=int(index.get("canvas_max_pixels", 768 * 1344)),
            audio_sample_rate=int(audio_vae.get("sampling_rate", 32000)),
            min_aspect_ratio=facts.MINIMAX_H3_MIN_ASPECT_RATIO,
            max_aspect_ratio=facts.MINIMAX_H3_MAX_ASPECT_RATIO,
        )

    def align(self, frames: int) -> int:
        """The next ``frames_per_chunk * n + latents_per_chunk`` at or above `frames` (diffusers' `align_num_frames`)."""
        remainder = (frames - self.latents_per_chunk) % self.frames_per_chunk
        return frames if remainder == 0 else frames + self.frames_per_chunk - remainder

    @property
    def min_frames(self) -> int:
        return self.align(math.ceil(self.min_duration * self.fps))

    @property
    def max_frames(self) -> int:
        frames = self.align(math.ceil(self.max_duration * self.fps))
        return frames if frames / self.fps <= self.max_duration else frames - self.frames_per_chunk

    @property
    def max_pixel_frames(self) -> int:
        """The most pixels x frames a video may hold: the canvas area (the larger of ``canvas_max_pixels``
        and the largest canvas rounding gives) for the longest clip."""
        width, height = self.largest_canvas
        return max(self.canvas_max_pixels, width * height) * self.max_frames

    def default_canvas(self, aspect_width: float = 16, aspect_height: float = 9) -> tuple[int, int]:
        """(width, height) of the pipeline's own canvas for an aspect ratio (diffusers' `resolve_canvas_size`)."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            resolve_canvas_size,
        )

        height, width = resolve_canvas_size(
            aspect_width, aspect_height, self.canvas_multiple, self.canvas_short_edge, self.canvas_max_pixels
        )
        return width, height


@attrs.frozen
class Request:
    """A validated request's generation settings (the conditioning travels beside it)."""

    width: int
    height: int
    num_frames: int  # aligned
    num_inference_steps: int
    seed: int | None


def parse_request(params: dict[str, Any], geometry: Geometry, default_size: tuple[int, int] | None = None) -> Request:
    """The ``dit`` stage's per-request parameters -> a `Request`, or `InvalidRequestError` naming the rule.

    `params`: ``size`` ([width, height]), ``num_frames`` or ``seconds``, ``num_inference_steps``,
    ``seed``. `default_size`: the canvas when no size is given (a keyframe's aspect ratio, or the
    pipeline's 16:9 canvas).
    """
    size = params.get("size")
    if size is None:
        width, height = default_size or geometry.default_canvas()
    else:
        width, height = check_size(size, geometry)
    num_frames = check_duration(params.get("num_frames"), params.get("seconds"), geometry)
    if size is not None:
        check_volume(width, height, num_frames, geometry, "size")
    steps = int_param(params.get("num_inference_steps", DEFAULT_STEPS), "num_inference_steps")
    if not 2 <= steps <= MAX_STEPS:
        raise InvalidRequestError(
            f"num_inference_steps counts MiniMax-H3's sigma grid points, the final zero included: it must be between 2 "
            f"(one transformer forward) and {MAX_STEPS}, got {steps}; e.g. {min(max(steps, 2), MAX_STEPS)}",
            param="num_inference_steps",
        )
    seed = params.get("seed")
    if seed is not None:
        seed = int_param(seed, "seed")
        if not 0 <= seed < 2**63:
            raise InvalidRequestError(f"seed must be a non-negative 63-bit integer, got {seed}", param="seed")
    return Request(width=width, height=height, num_frames=num_frames, num_inference_steps=steps, seed=seed)


def check_size(size: Any, geometry: Geometry) -> tuple[int, int]:
    """(width, height): multiples of the canvas multiple, aspect ratio within the trained range."""
    if isinstance(size, str):
        width_text, sep, height_text = size.lower().partition("x")
        size = (int(width_text), int(height_text)) if sep and width_text.isdigit() and height_text.isdigit() else size
    if not (isinstance(size, (list, tuple)) and len(size) == 2):
        raise InvalidRequestError(f"size must be [width, height], got {size!r}", param="size")
    width, height = (int_param(v, "size") for v in size)
    multiple = geometry.canvas_multiple
    if width < 1 or height < 1 or width % multiple or height % multiple:
        raise InvalidRequestError(
            f"MiniMax-H3's width and height must be multiples of {multiple} (the VAE's spatial compression times the "
            f"transformer's patch), got {width}x{height}; nearest valid: {_nearest(width, multiple)}x{_nearest(height, multiple)}",
            param="size",
        )
    ratio = width / height
    if not geometry.min_aspect_ratio <= ratio <= geometry.max_aspect_ratio:
        low, high = geometry.min_aspect_ratio, geometry.max_aspect_ratio
        if ratio > high:
            nearest = (width, _nearest(math.ceil(width / high), multiple, up=True))
        else:
            nearest = (_nearest(math.ceil(height * low), multiple, up=True), height)
        raise InvalidRequestError(
            f"MiniMax-H3 takes aspect ratios from 1:{1 / low:g} to {high:g}:1, got {width}x{height} ({ratio:g}); "
            f"nearest valid: {nearest[0]}x{nearest[1]}",
            param="size",
        )
    return width, height


def check_volume(width: int, height: int, num_frames: int, geometry: Geometry, param: str) -> None:
    """A 400 for a video of more pixels x frames than `Geometry.max_pixel_frames`, naming the largest
    size at this duration and the longest duration at this size (where one is valid)."""
    limit = geometry.max_pixel_frames
    if width * height * num_frames <= limit:
        return
    multiple = geometry.canvas_multiple
    scale = math.sqrt(limit / (width * height * num_frames))
    options = [f"{max(multiple, int(width * scale) // multiple * multiple)}x{max(multiple, int(height * scale) // multiple * multiple)} for {num_frames} frames"]
    frames = geometry.max_frames
    while frames >= geometry.min_frames and width * height * frames > limit:
        frames -= geometry.frames_per_chunk
    if frames >= geometry.min_frames:
        options.append(f"{width}x{height} for {frames} frames ({frames / geometry.fps:.3f} s)")
    raise InvalidRequestError(
        f"MiniMax-H3 draws at most {limit:,} pixels x frames a video (the checkpoint's canvas, {limit // geometry.max_frames:,} "
        f"pixels, for the longest clip, {geometry.max_frames} frames); got {width}x{height} for {num_frames} frames "
        f"({width * height * num_frames:,}); nearest valid: {' or '.join(options)}",
        param=param,
    )


def check_duration(num_frames: Any, seconds: Any, geometry: Geometry) -> int:
    """The aligned frame count of a request (``num_frames`` wins over ``seconds``; default: the shortest)."""
    if num_frames is not None and seconds is not None:
        raise InvalidRequestError("give num_frames or seconds, not both", param="num_frames")
    param = "num_frames"
    if num_frames is not None:
        frames = int_param(num_frames, "num_frames")
    elif seconds is not None:
        param = "seconds"
        if isinstance(seconds, str):
            try:
                seconds = float(seconds)
            except ValueError:
                raise InvalidRequestError(f"seconds must be a number, got {seconds!r}", param="seconds") from None
        value = number_param(seconds, "seconds")
        frames = max(1, round(value * geometry.fps))
    else:
        return geometry.min_frames
    if frames < 1:
        raise InvalidRequestError(f"num_frames must be positive, got {frames}", param=param)
    aligned = geometry.align(frames)
    if not geometry.min_duration <= aligned / geometry.fps <= geometry.max_duration:
        nearest = geometry.min_frames if aligned < geometry.min_frames else geometry.max_frames
        raise InvalidRequestError(
            f"MiniMax-H3 generates {geometry.min_duration:g} to {geometry.max_duration:g} seconds at {geometry.fps} fps: "
            f"the frame count, rounded up to the next {geometry.frames_per_chunk}n+{geometry.latents_per_chunk}, must be "
            f"between {geometry.min_frames} and {geometry.max_frames}; got {frames} frames (rounded up to {aligned}, "
            f"{aligned / geometry.fps:.3f} s); nearest valid: {nearest} frames ({nearest / geometry.fps:.3f} s)",
            param=param,
        )
    return aligned


def _nearest(value: int, multiple: int, up: bool = False) -> int:
    if up:
        return max(multiple, -(-value // multiple) * multiple)
    return max(multiple, round(value / multiple) * multiple)


