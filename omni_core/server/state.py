"""`ServerState`: what the server's route handlers share, injected by name (Litestar DI)."""

from __future__ import annotations

import time

import attrs

from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.media_access import MediaAccess
from omni_core.server.metrics import ServerMetrics
from omni_core.server.videos import VideoJobs


@attrs.define
class ServerState:
    """What the routes share: the engine, the served name, metrics, video jobs, what media URLs may
    reach (`media`, the operator's ``--allowed-local-media-path`` / ``--allowed-media-domains``) and
    the largest prompt in characters (`max_prompt_chars`, checked before tokenizing)."""

    engine: AsyncOmniEngine
    model_name: str
    metrics: ServerMetrics
    api_key: str | None
    videos: VideoJobs = attrs.field(factory=VideoJobs)
    media: MediaAccess = attrs.field(factory=MediaAccess)
    max_prompt_chars: int | None = None
    created: int = attrs.field(factory=lambda: int(time.time()))
    ignored_fields: set[str] = attrs.field(factory=set)  # request fields no route reads, logged once each
