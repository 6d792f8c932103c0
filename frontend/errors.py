"""OpenAI-style API errors: one exception type for handlers to raise and the JSON body every error response carries.

The body is `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status, as vLLM answers, so the
official `openai` client raises the matching exception class (BadRequestError, NotFoundError, RateLimitError, ...).
"""

from __future__ import annotations

import re
from http import HTTPStatus

import msgspec
from aiohttp import web

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised anywhere below a handler; the error middleware turns it into a JSON error response."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


RETRY_AFTER_S = 1


def engine_rejection(message: str, kind: str | None, param: str | None = None) -> APIError:
    """The error for a request the engine refused, its message verbatim: 429 with Retry-After when the engine is
    overloaded (kind "overloaded"), 503 with Retry-After when it waited past --max-queue-time, else 400."""
    if kind == "overloaded":
        return APIError(429, message, headers={"Retry-After": str(RETRY_AFTER_S)})
    if kind == "queue_timeout":
        return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=msgspec.json.encode(error_body(status, message, param)),
        content_type="application/json",
        headers=headers,
    )


_PATH_AT_END = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING_FIELD = re.compile(r"missing required field `(?P<field>[^`]+)`")


def validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """A 400 naming the offending field: msgspec says `... - at `$.messages[0].role``, which becomes `param`."""
    message = str(exc)
    param: str | None = None
    match = _PATH_AT_END.search(message)
    if match:
        param = match.group("path") or None
    missing = _MISSING_FIELD.search(message)
    if missing:
        param = f"{param}.{missing.group('field')}" if param else missing.group("field")
    if isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"Invalid request: {message}", param)
    return APIError(400, f"The request body is not valid JSON: {message}")
