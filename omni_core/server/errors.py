"""OpenAI-style error bodies for every failure: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, NotAuthorizedException, ValidationException

from omni_core.errors import InvalidRequestError, OmniError, RequestCancelledError, StageError
from omni_core.server.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an HTTP status and OpenAI error fields, raised by route handlers."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.param = param
        self.code = code


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> Response[bytes]:
    body = msgspec.json.encode(ErrorResponse(ErrorDetail(message=message, type=type, param=param, code=code)))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the `APIError` a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, RequestCancelledError):
        return APIError(499, str(exc), type="cancelled")
    if isinstance(exc, StageError):
        return APIError(500, str(exc), type="server_error", code="stage_failed")
    if isinstance(exc, OmniError):
        return APIError(500, str(exc), type="server_error")
    return APIError(500, "internal server error", type="server_error")


# msgspec's words for a missing field, and Litestar's name for the body's root.
_MISSING_FIELD = re.compile(r"Object missing required field `([^`]+)`")
_BODY_ROOT = "data"


def _validation_message(exc: ValidationException) -> tuple[str, str | None, str | None]:
    """The message, param and code of a body that does not fit the route's schema; a missing field
    is named as OpenAI names it ("Missing required parameter: 'messages'.", param ``messages``)."""
    extra: Any = exc.extra
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        first = extra[0]
        key = first.get("key")
        key = None if key == _BODY_ROOT else key
        message = str(first.get("message") or exc.detail)
        missing = _MISSING_FIELD.match(message)
        if missing:
            param = f"{key}.{missing[1]}" if key else missing[1]
            return f"Missing required parameter: {param!r}.", param, "missing_required_parameter"
        return (f"{message} (at {key})" if key else message), key, None
    return str(exc.detail), None, None


def handle_exception(request: Request, exc: Exception) -> Response[bytes]:
    """Litestar exception handler: every error leaves as an OpenAI error body."""
    if isinstance(exc, ValidationException):
        message, param, code = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param, code)
    if isinstance(exc, RecursionError) and "deserializing" in str(exc):
        # msgspec's JSON decoder refuses nesting deeper than its recursion limit (``[[[[...``).
        return error_response(400, "the request body's JSON is nested too deeply", "invalid_request_error", code="json_too_deep")
    if isinstance(exc, NotAuthorizedException):
        return error_response(401, str(exc.detail), "authentication_error", code="invalid_api_key")
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        # Keep the exception's headers: a 405 must say which methods are allowed (``Allow``).
        return error_response(exc.status_code, str(exc.detail), kind, code=code, headers=dict(exc.headers or {}))
    api = to_api_error(exc)
    if api.status >= 500:
        logger.error("request %s %s failed: %s", request.method, request.url.path, exc, exc_info=not isinstance(exc, OmniError))
    return error_response(api.status, str(api), api.type, api.param, api.code)
