"""``multipart/form-data`` bodies for JSON routes.

OpenAI's client posts ``/v1/videos`` as a form (``client.videos.create``: the first frame,
``input_reference``, as a file upload; what ``extra_body`` adds flattened to bracketed keys such as
``stage_params[dit][num_inference_steps]``). `FormRequest` (a Litestar ``request_class``) hands such a
body to the route as the JSON object it stands for, so the route's one body schema validates both:

- a file upload becomes a base64 ``data:`` URL of its bytes and content type (the request's own data:
  nothing local is opened);
- ``a[b][c]`` builds nested objects, ``a[]`` a list of values (a list of objects, such as Omni's
  ``references``, goes as one JSON text field: OpenAI's client sends ``a[][k]`` grouped by key, which
  cannot be told apart);
- texts stay texts, except the top-level fields a subclass lists in `json_fields` and the leaves of
  bracketed keys, which read as JSON where they parse (``"2"`` -> 2, ``"true"`` -> true).
"""

from __future__ import annotations

import base64
import mimetypes
import re
from typing import Any, ClassVar

import msgspec
from litestar.datastructures import UploadFile
from litestar.enums import RequestEncodingType

from omni_core.server.bodies import JSONRequest
from omni_core.server.errors import APIError

_KEY = re.compile(r"\[([^\[\]]*)\]")
_FORM_BODY = "omni_form_body"


class FormRequest(JSONRequest):
    """A request whose `json()` also reads a ``multipart/form-data`` body (see the module), once: the
    route's body and the server's scan for fields it ignores read the same object."""

    body_types = (*JSONRequest.body_types, RequestEncodingType.MULTI_PART.value)
    json_fields: ClassVar[frozenset[str]] = frozenset()

    async def json(self) -> Any:
        if self.content_type[0] != RequestEncodingType.MULTI_PART:
            return await super().json()
        # (kept in the request's state, which every Request built on this connection's scope shares)
        state = self.state
        if _FORM_BODY not in state:
            state[_FORM_BODY] = await self._form_body()
        return state[_FORM_BODY]

    async def _form_body(self) -> dict[str, Any]:
        form = await self.form()
        body: dict[str, Any] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                value = await _data_url(value)
            elif "[" not in key and key in self.json_fields:
                value = _json_text(value, key, strict=True)
            _assign(body, key, value)
        return body


async def _data_url(upload: UploadFile) -> str:
    content_type = upload.content_type
    if not content_type or content_type == "application/octet-stream":
        content_type = mimetypes.guess_type(upload.filename or "")[0] or "application/octet-stream"
    return f"data:{content_type};base64,{base64.b64encode(await upload.read()).decode()}"


def _json_text(text: str, key: str, strict: bool) -> Any:
    try:
        return msgspec.json.decode(text)  # (nesting past its limit: a RecursionError, the server's 400)
    except msgspec.DecodeError:
        if strict:
            raise APIError(400, f"form field {key!r} must be JSON, got {text[:80]!r}", param=key) from None
        return text


def _assign(body: dict[str, Any], key: str, value: Any) -> None:
    """Put `value` at the place form key `key` names: ``name``, ``name[a][b]`` or ``name[]``."""
    head = key.split("[", 1)[0]
    path = [head, *_KEY.findall(key[len(head) :])]
    if not head or "".join(f"[{p}]" for p in path[1:]) != key[len(head) :]:
        raise APIError(400, f"form field name {key!r} is not name, name[key] or name[]", param=key)
    if "" in path[1:-1]:
        # (OpenAI's client sends a list of objects grouped by key, which cannot be told apart)
        raise APIError(400, f"form field {key!r}: send a list of objects as one JSON text field ({head}=[...])", param=head)
    if len(path) > 1 and isinstance(value, str):
        value = _json_text(value, key, strict=False)
    *parents, leaf = path
    node: Any = body
    for index, part in enumerate(parents):
        wants_list = index == len(parents) - 1 and leaf == ""
        node = node.setdefault(part, [] if wants_list else {})
        if not isinstance(node, list if wants_list else dict):
            raise APIError(400, f"form field {key!r} mixes an object, a list and a value at one place", param=head)
    if leaf == "":
        node.append(value)
    elif leaf in node:
        raise APIError(400, f"form field {key!r} is given twice (or both as a value and as an object)", param=head)
    else:
        node[leaf] = value
