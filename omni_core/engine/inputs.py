"""The core's default input processor: a text prompt (or chat messages) for the entry stages."""

from __future__ import annotations

import functools
from typing import Any

from omni_core.config.tasks import request_entries
from omni_core.engine.request import OmniRequest
from omni_core.engine.vllm_inputs import VLLM_PROMPT
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.parts import InputProcessor, PartContext


class TextPromptProcessor(InputProcessor):
    """Gives every entry stage of the request (of its task, if the pipeline has tasks)
    ``{"prompt": text}``, ``{"messages": [...]}``, or a vLLM prompt's ``{"prompt_token_ids": [...]}``
    (`omni_core.engine.vllm_inputs`: its text is the ``prompt``; it may carry no media here).

    Families with multimodal input provide their own processor (`PipelineConfig.input_processor`).
    """

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.entries = functools.lru_cache(maxsize=None)(functools.partial(request_entries, context.pipeline))

    def process(self, request: OmniRequest) -> dict[str, StageInput]:
        vllm_prompt = request.extra.get(VLLM_PROMPT) or {}
        if vllm_prompt.get("multi_modal_data"):
            raise InvalidRequestError("this model takes no multi_modal_data: give a text prompt or token ids", param="multi_modal_data")
        if vllm_prompt.get("prompt_token_ids") is not None:
            data: dict[str, Any] = {"prompt_token_ids": list(vllm_prompt["prompt_token_ids"])}
        elif request.prompt is not None:
            if not isinstance(request.prompt, str):
                raise InvalidRequestError("prompt must be a string", param="prompt")
            data = {"prompt": request.prompt}
        elif request.messages is not None:
            data = {"messages": request.messages}
        else:
            raise InvalidRequestError("a request needs a prompt or messages", param="prompt")
        return {name: StageInput(data=dict(data), final=True) for name in self.entries(request.task)}


# What a chat content part of each type carries, in words.
PART_MEDIA = {"text": "text", "image_url": "image", "image": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}


def last_user_text(messages: list[dict[str, Any]], reads: tuple[str, ...] = (), hint: str = "") -> str | None:
    """The text of the last user message in OpenAI chat `messages` (its text parts joined with
    spaces), or None: what an image or video family takes as its prompt.

    A content part of another type than ``text`` and `reads` (the part types the family reads on its
    own, e.g. ``("image_url",)``), in any message, is an `InvalidRequestError` naming the part, never
    silently dropped; `hint` ends its message (where the family takes such a medium instead).
    """
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for number, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" and kind not in reads:
                where = f"messages[{index}].content[{number}]"
                what = PART_MEDIA.get(kind, f"{kind!r} content part") if isinstance(kind, str) else "content part without a type"
                takes = " and ".join(dict.fromkeys(PART_MEDIA.get(r, repr(r)) for r in ("text", *reads)))
                raise InvalidRequestError(
                    f"{where}: this model takes no {what} in a chat message (the part is of type {kind!r}; it reads {takes}){hint}",
                    param=where,
                )
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


def last_user_images(messages: list[dict[str, Any]] | None, limit: int, reader: str) -> list[Any]:
    """The images of the last user message in OpenAI chat `messages`, in order, as PIL RGB images:
    ``image_url`` parts with base64 ``data:`` URLs (a server has already read any URL its operator
    allows into one; a string is never opened as a path) or ``image`` parts holding a PIL image.

    More than `limit`, or an image in an earlier message (it would be lost), is an
    `InvalidRequestError` naming `reader` (the model, e.g. ``"Cosmos3"``)."""
    from omni_core.media_access import data_url_bytes
    from omni_core.media_decode import open_image

    listed = list(messages or ())
    last = next((i for i in range(len(listed) - 1, -1, -1) if isinstance(listed[i], dict) and listed[i].get("role") == "user"), None)
    parts: list[tuple[str, dict[str, Any]]] = []  # (the part's path, the part)
    for number, message in enumerate(listed):
        content = message.get("content") if isinstance(message, dict) else None
        found = [
            (f"messages[{number}].content[{index}]", part) for index, part in enumerate(content if isinstance(content, list) else ())
            if isinstance(part, dict) and part.get("type") in ("image_url", "image")
        ]
        if found and number != last:
            raise InvalidRequestError(f"messages[{number}]: {reader} reads the images of the last user message only", param=f"messages[{number}]")
        parts += found
    if len(parts) > limit:
        raise InvalidRequestError(f"messages: {len(parts)} images; {reader} takes at most {limit} per request", param="messages")
    images: list[Any] = []
    for path, part in parts:
        if part["type"] == "image_url":
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            where = f"{path}.image_url.url" if isinstance(value, dict) else f"{path}.image_url"
            if not isinstance(url, str):
                raise InvalidRequestError(f"{path}.image_url: needs a url (a base64 data: URL)", param=f"{path}.image_url")
            images.append(open_image(data_url_bytes(url, where)[1], where))
        else:
            from PIL import Image

            if not isinstance(part.get("image"), Image.Image):
                raise InvalidRequestError(f"{path}.image: must be a PIL image", param=f"{path}.image")
            images.append(part["image"].convert("RGB"))
    return images
