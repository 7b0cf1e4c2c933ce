"""The core's default input processor: a text prompt (or chat messages) for the entry stages."""

from __future__ import annotations

import functools
from typing import Any

from omni_core.config.tasks import request_entries
from omni_core.engine.request import OmniRequest
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.parts import InputProcessor, PartContext


class TextPromptProcessor(InputProcessor):
    """Gives every entry stage of the request (of its task, if the pipeline has tasks)
    ``{"prompt": text}`` or ``{"messages": [...]}``.

    Families with multimodal input provide their own processor (`PipelineConfig.input_processor`).
    """

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.entries = functools.lru_cache(maxsize=None)(functools.partial(request_entries, context.pipeline))

    def process(self, request: OmniRequest) -> dict[str, StageInput]:
        if request.prompt is not None:
            if not isinstance(request.prompt, str):
                raise InvalidRequestError("prompt must be a string", param="prompt")
            data = {"prompt": request.prompt}
        elif request.messages is not None:
            data = {"messages": request.messages}
        else:
            raise InvalidRequestError("a request needs a prompt or messages", param="prompt")
        return {name: StageInput(data=dict(data), final=True) for name in self.entries(request.task)}


def last_user_text(messages: list[dict[str, Any]], reads: tuple[str, ...] = ()) -> str | None:
    """The text of the last user message in OpenAI chat `messages` (its text parts joined with
    spaces), or None: what an image or video family takes as its prompt.

    A content part of another type than ``text`` and `reads` (the part types the family reads on its
    own, e.g. ``("image_url",)``), in any message, is an `InvalidRequestError`: never silently dropped.
    """
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" and kind not in reads:
                takes = ", ".join(("text", *reads))
                raise InvalidRequestError(f"messages[{index}]: a {kind!r} content part; this model reads {takes}", param="messages")
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            return " ".join(texts) or None
    return None
