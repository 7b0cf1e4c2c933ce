"""Video jobs, as OpenAI's Videos API has them: ``POST /v1/videos`` starts one, ``GET`` polls it
(``queued`` until the stage that draws starts it, e.g. behind others under its token budget, then
``in_progress``, its ``progress`` following the denoising steps), ``/content`` downloads the MP4
(``?variant=thumbnail``: its first frame as WebP; ``spritesheet``: frames across the clip as one JPEG),
``GET /v1/videos`` lists the jobs and ``DELETE`` cancels one (the request is aborted in every stage)
and forgets it."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Literal

import attrs
import msgspec

from omni_core.media import encode_mp4
from omni_core.server.encoding import encode_image
from omni_core.server.errors import APIError
from omni_core.server.generation import Tracked
from omni_core.server.protocol import ErrorDetail, VideoDeleted, VideoJob, VideoList
from omni_core.server.requests import video_field_error

# What ``GET /v1/videos/{id}/content?variant=`` returns, as OpenAI's Videos API has it.
VARIANT_MEDIA_TYPES = {"video": "video/mp4", "thumbnail": "image/webp", "spritesheet": "image/jpeg"}
VideoVariant = Literal["video", "thumbnail", "spritesheet"]
SPRITESHEET_FRAMES = 8  # evenly spaced over the clip, first and last included
SPRITESHEET_COLUMNS = 4
SPRITE_WIDTH = 256  # a wider frame is scaled down to this width in the spritesheet


@attrs.define
class _Entry:
    job: VideoJob
    task: asyncio.Task | None = None
    content: dict[str, bytes] | None = None  # by variant, once completed


class VideoJobs:
    """The server's video jobs: beyond `max_jobs`, the oldest finished ones are dropped (never a running one)."""

    def __init__(self, max_jobs: int = 64) -> None:
        self.max_jobs = max_jobs
        self.entries: OrderedDict[str, _Entry] = OrderedDict()

    def start(self, tracked: Tracked, model: str, prompt: str, seconds: str | None = None, size: str | None = None) -> VideoJob:
        job = VideoJob(
            id=tracked.request.request_id, created_at=int(time.time()), status="queued", model=model, prompt=prompt,
            seconds=seconds, size=size,
        )
        entry = _Entry(job)
        entry.task = asyncio.create_task(self._run(entry, tracked))
        self.entries[job.id] = entry
        self._evict()
        return job

    def _evict(self) -> None:
        """Drop the oldest finished jobs beyond `max_jobs`; running ones stay (however old), so one job
        that runs long does not keep the finished ones behind it."""
        excess = len(self.entries) - self.max_jobs
        if excess <= 0:
            return
        finished = [key for key, entry in self.entries.items() if entry.task is None or entry.task.done()]
        for key in finished[:excess]:
            del self.entries[key]

    async def _run(self, entry: _Entry, tracked: Tracked) -> None:
        try:
            async for delta in tracked.deltas():
                if delta.step_progress is not None:  # the stage that draws has started it: in progress
                    step, total = delta.step_progress
                    # (99 at most: the VAE decode and the MP4 encoding come after the last step)
                    percent = min(99, 100 * step // total)
                    entry.job = msgspec.structs.replace(entry.job, status="in_progress", progress=max(entry.job.progress, percent))
            result = tracked.result
            if result.video is None:
                raise APIError(500, "the pipeline produced no video", type="server_error")
            fps = result.fps or 24.0
            mp4 = await asyncio.to_thread(encode_mp4, result.video, fps, result.audio, result.sample_rate)
            entry.content = {"video": mp4, **await asyncio.to_thread(_stills, result.video)}
            frames, height, width = _video_shape(result.video)
            entry.job = msgspec.structs.replace(
                entry.job, status="completed", progress=100, completed_at=int(time.time()),
                seconds=f"{frames / fps:.3f}".rstrip("0").rstrip("."), size=f"{width}x{height}",
            )
        except Exception as exc:
            api = video_field_error(exc)  # (a stage's refusal names its request field: named as /v1/videos names it)
            error = ErrorDetail(message=str(api), type=api.type, param=api.param, code=api.code)
            entry.job = msgspec.structs.replace(entry.job, status="failed", completed_at=int(time.time()), error=error)

    def shutdown(self) -> None:
        for entry in self.entries.values():
            if entry.task is not None:
                entry.task.cancel()

    def _entry(self, video_id: str) -> _Entry:
        entry = self.entries.get(video_id)
        if entry is None:
            raise APIError(404, f"no video job {video_id!r}", param="video_id", code="not_found")
        return entry

    def job(self, video_id: str) -> VideoJob:
        return self._entry(video_id).job

    def content(self, video_id: str, variant: VideoVariant = "video") -> bytes:
        """The finished job's MP4, or its ``thumbnail`` or ``spritesheet`` (`VARIANT_MEDIA_TYPES`)."""
        entry = self._entry(video_id)
        if entry.content is None:
            raise APIError(409 if entry.job.status != "failed" else 400, f"video {video_id!r} is {entry.job.status}", param="video_id", code="video_not_ready")
        return entry.content[variant]

    def list(self, limit: int = 20, after: str | None = None, order: Literal["asc", "desc"] = "desc") -> VideoList:
        """A page of jobs by creation, newest first for ``desc``; `after` is the last id of the
        previous page."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
        jobs = [entry.job for entry in self.entries.values()]
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                raise APIError(404, f"no video job {after!r} (after)", param="after", code="not_found")
            jobs = jobs[ids.index(after) + 1 :]
        page = jobs[:limit]
        return VideoList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None, has_more=len(jobs) > limit)

    async def delete(self, video_id: str) -> VideoDeleted:
        """Forget the job; one still running is cancelled first (its request aborted in every stage)."""
        entry = self._entry(video_id)
        del self.entries[video_id]
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
        return VideoDeleted(id=video_id)


def _stills(video: Any) -> dict[str, bytes]:
    """A (T, H, W, 3) uint8 video's ``thumbnail`` (its first frame, WebP) and ``spritesheet`` (up to
    `SPRITESHEET_FRAMES` frames evenly spaced, `SPRITESHEET_COLUMNS` a row, each at most
    `SPRITE_WIDTH` wide, one JPEG)."""
    import numpy as np
    from PIL import Image

    frames = np.asarray(video)
    count = min(SPRITESHEET_FRAMES, len(frames))
    picked = [Image.fromarray(frames[i]) for i in np.linspace(0, len(frames) - 1, count).round().astype(int)]
    width, height = picked[0].size
    if width > SPRITE_WIDTH:
        width, height = SPRITE_WIDTH, max(1, round(height * SPRITE_WIDTH / width))
    columns = min(SPRITESHEET_COLUMNS, count)
    sheet = Image.new("RGB", (columns * width, -(-count // columns) * height))
    for i, frame in enumerate(picked):
        sheet.paste(frame.resize((width, height), Image.Resampling.BICUBIC), ((i % columns) * width, (i // columns) * height))
    return {"thumbnail": encode_image(frames[0], "webp"), "spritesheet": encode_image(np.asarray(sheet), "jpeg")}


def _video_shape(video: Any) -> tuple[int, int, int]:
    """(frames, height, width) of a (T, H, W, 3) video (a tensor or an array)."""
    frames, height, width = (int(n) for n in tuple(video.shape)[:3])
    return frames, height, width
