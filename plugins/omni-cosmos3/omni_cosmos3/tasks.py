"""Cosmos3 request parameters: parsing and validation, before any work starts (no torch here).

Tasks: ``t2i`` (text -> image), ``t2v`` (text -> video), ``t2va`` (text -> video with a
synchronized audio track). Where a request gives no size, it gets one in transformer tokens, so a
tiny checkpoint (few pixels per token) gets a small default and a real one (32 pixels per token)
a real one: images 32x32 tokens (1024x1024 on the released checkpoints), videos 20x12 tokens.
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.errors import InvalidRequestError

TASKS = ("t2i", "t2v", "t2va")
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

    @property
    def sound(self) -> bool:
        return self.task == "t2va"


def parse_request(data: dict[str, Any], params: dict[str, Any], pixels_per_token: int, temporal_factor: int) -> Request:
    """Stage input `data` (prompt, size, seconds, seed, n, task) and `params` -> a `Request`.

    Raises `InvalidRequestError` naming the parameter: unknown task, a size not divisible by
    `pixels_per_token` (VAE downsampling x patch size), zero or negative steps, a bad seed ...
    """
    known = {"task", "num_inference_steps", "guidance_scale", "negative_prompt", "fps", "num_frames", "seed",
             "use_system_prompt", "size", "seconds", "n"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise InvalidRequestError(f"unknown Cosmos3 parameters {unknown}; known: {sorted(known)}", param=unknown[0])
    merged = {**data, **params}
    task = merged.get("task") or "t2i"
    if task not in TASKS:
        raise InvalidRequestError(f"unknown task {task!r}; Cosmos3 does: {', '.join(TASKS)}", param="task")
    prompt = merged.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequestError("Cosmos3 needs a non-empty text prompt", param="prompt")
    steps = _int(merged.get("num_inference_steps", DEFAULT_STEPS), "num_inference_steps")
    if steps < 1:
        raise InvalidRequestError(f"num_inference_steps must be at least 1, got {steps}", param="num_inference_steps")
    guidance = _number(merged.get("guidance_scale", DEFAULT_GUIDANCE), "guidance_scale")
    if guidance < 1.0:
        raise InvalidRequestError(f"guidance_scale must be >= 1.0 (1.0 turns guidance off), got {guidance}", param="guidance_scale")
    fps = _number(merged.get("fps", DEFAULT_FPS), "fps")
    if fps <= 0:
        raise InvalidRequestError(f"fps must be positive, got {fps}", param="fps")
    default_tokens = IMAGE_TOKENS if task == "t2i" else VIDEO_TOKENS
    size = merged.get("size") or (default_tokens[0] * pixels_per_token, default_tokens[1] * pixels_per_token)
    if not (isinstance(size, (list, tuple)) and len(size) == 2):
        raise InvalidRequestError(f"size must be (width, height), got {size!r}", param="size")
    width, height = (_int(v, "size") for v in size)
    if width < 1 or height < 1 or width % pixels_per_token or height % pixels_per_token:
        raise InvalidRequestError(
            f"size {width}x{height} is not a multiple of this model's patch of {pixels_per_token} pixels "
            f"(VAE downsampling x transformer patch); e.g. {_round(width, pixels_per_token)}x{_round(height, pixels_per_token)}",
            param="size",
        )
    num_frames = _frames(task, merged, fps, temporal_factor)
    seed = merged.get("seed")
    if seed is not None:
        seed = _int(seed, "seed")
        if not 0 <= seed < 2**63 - MAX_N:
            raise InvalidRequestError(f"seed must be a non-negative 63-bit integer, got {seed}", param="seed")
    n = _int(merged.get("n", 1), "n")
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    negative = merged.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise InvalidRequestError("negative_prompt must be a string", param="negative_prompt")
    system = merged.get("use_system_prompt")
    if system is not None and not isinstance(system, bool):
        raise InvalidRequestError("use_system_prompt must be true or false", param="use_system_prompt")
    return Request(task, prompt, width, height, num_frames, fps, steps, guidance, negative, seed, n, system)


def _frames(task: str, merged: dict[str, Any], fps: float, temporal_factor: int) -> int:
    if task == "t2i":
        return 1
    if merged.get("num_frames") is not None:
        frames = _int(merged["num_frames"], "num_frames")
        if frames < 1 + temporal_factor or (frames - 1) % temporal_factor:
            raise InvalidRequestError(
                f"num_frames must be 1 + {temporal_factor} * k with k >= 1 (the VAE's temporal compression), got {frames}",
                param="num_frames",
            )
        return frames
    seconds = _number(merged.get("seconds", DEFAULT_SECONDS), "seconds")
    if seconds <= 0 or seconds > 60:
        raise InvalidRequestError(f"seconds must be in (0, 60], got {seconds}", param="seconds")
    steps = max(1, round(seconds * fps / temporal_factor))
    return 1 + temporal_factor * steps


def _round(value: int, multiple: int) -> int:
    return max(multiple, round(value / multiple) * multiple)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    return float(value)
