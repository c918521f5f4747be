"""Every error the server answers is OpenAI-shaped: ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status that says who must act (4xx: the client, 5xx: the server).

Invariant: no exception reaches the client as Litestar's own error body or a traceback. Body
decoding errors (malformed JSON, invalid UTF-8, wrong field types) are 400 and name the field; a
prompt over the context is 400 ``context_length_exceeded``; JSON nested too deeply to decode is
400; a body over the size limit is 413;
unknown routes are 404; a full queue is 503 with ``Retry-After``; anything unexpected is a 500
that is also logged.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from agentd.server.protocol import ErrorResponse, RequestValidationError, error_body

logger = logging.getLogger("agentd.server")

_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
          413: "request_too_large", 503: "service_unavailable"}


class APIError(Exception):
    """An error a handler raises to answer ``status`` with the OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        self.type = type or error_type(status)
        self.headers = headers


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_response(error: APIError) -> Response[ErrorResponse]:
    body = error_body(error.message, type=error.type, param=error.param, code=error.code)
    return Response(body, status_code=error.status, headers=error.headers)


def _api_error(_: Request, exc: APIError) -> Response[ErrorResponse]:
    return error_response(exc)


def _validation_error(_: Request, exc: RequestValidationError) -> Response[ErrorResponse]:
    return error_response(APIError(exc.status, exc.message, param=exc.param, code=exc.code))


def _litestar_validation(_: Request, exc: ValidationException) -> Response[ErrorResponse]:
    """Litestar's msgspec decoding failed: name the first bad field like OpenAI does."""
    if (reason := _json_decode_reason(exc)) is not None:
        return error_response(APIError(400, f"the request body is not valid JSON: {reason}"))
    problems: list[Any] = exc.extra if isinstance(exc.extra, list) else []
    first = problems[0] if problems and isinstance(problems[0], dict) else {}
    key = first.get("key")
    message = first.get("message") or exc.detail
    if key:
        message = f"invalid value for {key}: {message}"
    return error_response(APIError(400, str(message), param=key or None))


def _json_decode_reason(exc: BaseException) -> str | None:
    """msgspec's reason if ``exc`` was caused by a body that is not JSON at all."""
    seen: BaseException | None = exc
    while seen is not None:
        not_json = isinstance(seen, SerializationException) or (
            isinstance(seen, msgspec.DecodeError) and not isinstance(seen, msgspec.ValidationError))
        if not_json:
            return str(seen).removeprefix("JSON is malformed: ")
        seen = seen.__cause__ or seen.__context__
    return None


def _http_error(_: Request, exc: HTTPException) -> Response[ErrorResponse]:
    status = exc.status_code
    message = exc.detail
    if status == 400 and (reason := _json_decode_reason(exc)) is not None:
        message = f"the request body is not valid JSON: {reason}"
    elif status == 413:
        message = "the request body is too large"
    elif status == 404:
        message = f"not found: {message}" if message and message != "Not Found" else "not found"
    headers = dict(exc.headers) if exc.headers else None
    return error_response(APIError(status, str(message), headers=headers))


def _too_deep(_: Request, exc: RecursionError) -> Response[ErrorResponse]:
    """JSON nested past Python's recursion limit (msgspec decodes, and our canonicalising of
    tool schemas walks, recursively): the client's body, so a 400, not a crash."""
    return error_response(APIError(400, "the request body nests too deeply (JSON nested "
                                   f"hundreds of levels deep is refused): {exc}"))


def _internal_error(request: Request, exc: Exception) -> Response[ErrorResponse]:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    APIError: _api_error,
    RequestValidationError: _validation_error,
    ValidationException: _litestar_validation,
    HTTPException: _http_error,
    RecursionError: _too_deep,
    Exception: _internal_error,
}
