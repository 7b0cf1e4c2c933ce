"""Media URLs in chat content parts: ``data:`` URLs only, and vLLM's ``audio_url`` part.

vLLM (and vLLM-Omni's example clients) send audio as ``{"type": "audio_url", "audio_url": {"url":
...}}``; OpenAI's part for it is ``input_audio`` (base64 data and a format). A ``data:`` URL is
turned into the ``input_audio`` part here, once for every model family, so that input processors
read one audio part. The server fetches no URL and reads no path for a client: vLLM does so only
where its operator allowed it (``--allowed-local-media-path``, ``--allowed-media-domains``), which
Omni does not implement yet, so any other URL is a 400 that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from omni_core.server.errors import APIError
from omni_core.server.protocol import ChatMessage

URL_PARTS = ("image_url", "audio_url", "video_url")

# ``audio/<subtype>`` of a data URL -> the `input_audio` format name (the decoder sniffs the bytes;
# the format is informative).
AUDIO_FORMATS = {"mpeg": "mp3", "mp3": "mp3", "x-wav": "wav", "wave": "wav", "wav": "wav", "x-flac": "flac", "flac": "flac"}


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain data for the input processor, every media URL checked and every
    ``audio_url`` part turned into ``input_audio``."""
    plain: list[dict[str, Any]] = msgspec.to_builtins(messages)
    for i, message in enumerate(plain):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind not in URL_PARTS:
                continue
            where = f"messages[{i}].content[{j}].{kind}.url"
            url = part[kind]["url"]
            check_data_url(url, where)
            if kind == "audio_url":
                content[j] = audio_part(url, where)
    return plain


def check_data_url(url: str, where: str) -> None:
    """Raise a 400 unless `url` is a base64 ``data:`` URL."""
    if not url.startswith("data:"):
        shown = url if len(url) <= 80 else f"{url[:77]}..."
        raise APIError(
            400,
            f"{where}: only data: URLs are accepted (data:<mime type>;base64,<data>), got {shown!r}. Fetching URLs "
            "and reading local files is off unless the operator allows it, and Omni does not implement vLLM's "
            "--allowed-local-media-path / --allowed-media-domains yet: send the media inline as a data: URL",
            param=where,
        )
    header, comma, _ = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise APIError(400, f"{where}: data: URLs must be base64 encoded (data:<mime type>;base64,<data>)", param=where)


def audio_part(url: str, where: str) -> dict[str, Any]:
    """A checked ``data:audio/...;base64,`` URL -> the equivalent ``input_audio`` part."""
    header, _, payload = url.partition(",")
    mime = header[len("data:") : -len(";base64")].split(";")[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    if kind != "audio":
        raise APIError(400, f"{where}: an audio_url must carry audio (data:audio/wav;base64,...), got {mime or 'no'} media type", param=where)
    return {"type": "input_audio", "input_audio": {"data": payload, "format": AUDIO_FORMATS.get(subtype, subtype)}}
