"""Video jobs: ``POST /v1/videos`` starts one, ``GET`` polls it, ``/content`` downloads the MP4."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import attrs

from omni_core.media import encode_mp4
from omni_core.server.errors import APIError, to_api_error
from omni_core.server.generation import Tracked
from omni_core.server.protocol import ErrorDetail, VideoJob


@attrs.define
class _Entry:
    job: VideoJob
    task: asyncio.Task | None = None
    content: bytes | None = None


class VideoJobs:
    """The server's video jobs; keeps the newest `max_jobs` (older finished ones are dropped)."""

    def __init__(self, max_jobs: int = 64) -> None:
        self.max_jobs = max_jobs
        self.entries: OrderedDict[str, _Entry] = OrderedDict()

    def start(self, tracked: Tracked, model: str, prompt: str) -> VideoJob:
        job = VideoJob(id=tracked.request.request_id, created_at=int(time.time()), status="in_progress", model=model, prompt=prompt)
        entry = _Entry(job)
        entry.task = asyncio.create_task(self._run(entry, tracked))
        self.entries[job.id] = entry
        while len(self.entries) > self.max_jobs:
            oldest = next(iter(self.entries.values()))
            if oldest.task is not None and not oldest.task.done():
                break
            self.entries.popitem(last=False)
        return job

    async def _run(self, entry: _Entry, tracked: Tracked) -> None:
        try:
            result = await tracked.run()
            if result.video is None:
                raise APIError(500, "the pipeline produced no video", type="server_error")
            audio = result.audio
            entry.content = await asyncio.to_thread(encode_mp4, result.video, result.fps or 24.0, audio, result.sample_rate)
            entry.job = _with_status(entry.job, "completed")
        except Exception as exc:
            api = to_api_error(exc)
            entry.job = _with_status(entry.job, "failed", ErrorDetail(message=str(api), type=api.type, param=api.param, code=api.code))

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

    def content(self, video_id: str) -> bytes:
        entry = self._entry(video_id)
        if entry.content is None:
            raise APIError(409 if entry.job.status != "failed" else 400, f"video {video_id!r} is {entry.job.status}", param="video_id", code="video_not_ready")
        return entry.content


def _with_status(job: VideoJob, status: str, error: ErrorDetail | None = None) -> VideoJob:
    import msgspec

    return msgspec.structs.replace(job, status=status, error=error)
