"""`OmniRequest`: one user request as the engine takes it."""

from __future__ import annotations

import uuid
from typing import Any

import attrs


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


@attrs.define
class OmniRequest:
    """A request: a prompt or chat messages, wanted modalities and per-stage parameters.

    - `messages`: OpenAI chat format (content parts for text, image, audio, video).
    - `modalities`: outputs wanted (``None``: the pipeline's defaults).
    - `params`: per named stage, overriding that stage's defaults key by key.
    - `task`: the pipeline task to run (`omni_core.config.pipeline.TaskSpec`; ``None``: chosen
      from the modalities). The engine sets it to the chosen task before the input processor runs.
    - `extra`: family-specific request fields (e.g. ``voice``, ``size``), read by the input processor.
    """

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    modalities: tuple[str, ...] | None = None
    params: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    task: str | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)
    request_id: str = attrs.field(factory=new_request_id)
