"""Media URLs in chat content parts: ``data:`` URLs (and what the operator allowed), and vLLM's
``audio_url`` part.

vLLM (and vLLM-Omni's example clients) send audio as ``{"type": "audio_url", "audio_url": {"url":
...}}``; OpenAI's part for it is ``input_audio`` (base64 data and a format). A ``data:`` URL is
turned into the ``input_audio`` part here, once for every model family, so that input processors
read one audio part. The server reads no path and fetches no URL for a client unless its operator
allowed it, with vLLM's flags (``--allowed-local-media-path DIR``, ``--allowed-media-domains HOST
...``: `omni_core.media_access`); an allowed ``file://`` or ``http(s)://`` URL is read here and
replaced by the equivalent ``data:`` URL, so input processors see one shape. Any other URL is a 400
naming the rule. `chat_messages` does blocking I/O for such URLs: call it in a thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from omni_core.errors import InvalidRequestError
from omni_core.media_access import MediaAccess, as_data_url, data_url_bytes
from omni_core.media_decode import check_image
from omni_core.server.errors import APIError
from omni_core.server.protocol import ChatMessage

URL_PARTS = ("image_url", "audio_url", "video_url")

# ``audio/<subtype>`` of a data URL -> the `input_audio` format name (the decoder sniffs the bytes;
# the format is informative).
AUDIO_FORMATS = {"mpeg": "mp3", "mp3": "mp3", "x-wav": "wav", "wave": "wav", "wav": "wav", "x-flac": "flac", "flac": "flac"}


def chat_messages(messages: Sequence[ChatMessage], access: MediaAccess = MediaAccess()) -> list[dict[str, Any]]:
    """Messages as plain data for the input processor, every media URL a checked ``data:`` URL
    (an allowed file or web resource read into one, `access`) and every ``audio_url`` part turned
    into ``input_audio``."""
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
            url = data_url(part[kind]["url"], access, where)  # (the family decodes and names a bad image: `last_user_images`)
            part[kind]["url"] = url
            if kind == "audio_url":
                content[j] = audio_part(url, where)
    return plain


def inline_media_params(params: dict[str, dict[str, Any]], media_params: Mapping[str, frozenset[str]], access: MediaAccess) -> None:
    """Every media URL among a request's stage parameters (`media_params`: stage -> the parameters
    its model part declares as media) as a checked ``data:`` URL, in place: an allowed file or web
    resource is read into one (blocking I/O: call it in a thread), anything else is a 400 naming
    the parameter. A list of URLs (video frames) is taken item by item; other types are left to
    the stage."""
    for stage, names in media_params.items():
        values = params.get(stage)
        for name in names & set(values or ()):
            where = f"stage_params.{stage}.{name}"
            value = values[name]
            if isinstance(value, str):
                values[name] = data_url(value, access, where)
            elif isinstance(value, list) and all(isinstance(item, str) for item in value):
                values[name] = [data_url(item, access, f"{where}[{i}]", param=where) for i, item in enumerate(value)]


def data_url(url: str, access: MediaAccess, where: str, param: str | None = None, image: bool = False) -> str:
    """`omni_core.media_access.as_data_url` with its refusal as a 400 (`param`: default `where`).
    With `image` (a field that holds an image), a ``data:image/...`` URL must be base64 of an image
    PIL reads (its header checked: `check_image`), so that a client learns which of its fields is
    not one under that field's name, not under the name the model family gives the image. There,
    a ``data:application/octet-stream`` URL (an upload whose type neither its client nor its file
    name gave) is typed by its bytes: an image's media type, else the same 400."""
    try:
        url = as_data_url(url, access, where)
        if image:
            media_type, raw = data_url_bytes(url, where)
            if media_type.startswith("image/") or media_type == "application/octet-stream":
                found = check_image(raw, where)
                if media_type == "application/octet-stream":
                    url = f"data:{found};base64,{url.partition(',')[2]}"
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=param or where) from None
    return url


def audio_part(url: str, where: str) -> dict[str, Any]:
    """A checked ``data:audio/...;base64,`` URL -> the equivalent ``input_audio`` part."""
    header, _, payload = url.partition(",")
    mime = header[len("data:") : -len(";base64")].split(";")[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    if kind != "audio":
        raise APIError(400, f"{where}: an audio_url must carry audio (data:audio/wav;base64,...), got {mime or 'no'} media type", param=where)
    return {"type": "input_audio", "input_audio": {"data": payload, "format": AUDIO_FORMATS.get(subtype, subtype)}}
