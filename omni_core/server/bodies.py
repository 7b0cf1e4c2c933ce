"""Request bodies a route cannot read: an empty body, or one that is not JSON under another content
type, answered with what the route takes rather than a parse error of JSON the client never sent.

`JSONRequest` (the app's ``request_class``) names the content types its routes take (`body_types`:
JSON; `omni_core.server.forms.FormRequest` adds ``multipart/form-data``). A body that does not parse
as JSON under one of those is a 400 (malformed JSON); under another type (a form that ``curl -d
model=...`` posts as ``application/x-www-form-urlencoded``, plain text) it is a 415 naming the types
the route takes. A JSON body under another type is still read (``curl -d '{...}'`` labels its JSON
that way). `check_body` (before a route's handler) refuses an empty body with a 400 saying so.
"""

from __future__ import annotations

from typing import Any, ClassVar

from litestar import Request
from litestar.exceptions import SerializationException

from omni_core.server.errors import APIError


class JSONRequest(Request):
    """A request to routes reading a JSON body: one of another type is a 415 naming `body_types`."""

    body_types: ClassVar[tuple[str, ...]] = ("application/json",)

    async def json(self) -> Any:
        try:
            return await super().json()
        except SerializationException:
            media_type = self.content_type[0]
            if media_type in self.body_types or media_type.endswith("+json"):
                raise
            sent = f"Content-Type {media_type}" if media_type else "no Content-Type"
            raise APIError(
                415, f"{self.url.path} takes {body_types_text(self.body_types)}; got {sent} and a body that is not JSON",
                code="unsupported_media_type",
            ) from None


async def check_body(request: Request) -> None:
    """A 400 for an empty body sent to a route that reads one (a required ``data`` parameter)."""
    data = getattr(request.route_handler, "parsed_data_field", None)
    if data is None or data.is_optional or data.has_default or await request.body():
        return
    types = getattr(type(request), "body_types", JSONRequest.body_types)
    raise APIError(400, f"the request body is empty: {request.url.path} takes {body_types_text(types)}", code="empty_body")


_DESCRIBED = {
    "application/json": "a JSON object (Content-Type: application/json)",
    "multipart/form-data": "a form (Content-Type: multipart/form-data)",
}


def body_types_text(types: tuple[str, ...]) -> str:
    """What a route with `body_types` takes, in words: ``a JSON object (Content-Type: application/json)``."""
    return " or ".join(_DESCRIBED.get(kind, f"a {kind} body") for kind in types)
