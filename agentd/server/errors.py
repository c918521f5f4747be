"""Every error the server answers is OpenAI-shaped: ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status that says who must act (4xx: the client, 5xx: the server) —
except on the Anthropic routes (``/v1/messages...``), where it is Anthropic-shaped:
``{"type": "error", "error": {"type", "message"}}`` with the same status.

Invariant: no exception reaches the client as Litestar's own error body or a traceback. Body
decoding errors (malformed JSON, invalid UTF-8, wrong field types) are 400 and name the field; a
prompt over the context is 400 ``context_length_exceeded``; JSON nested too deeply to decode is
400; a body over the size limit is 413; unknown routes are 404, and the OpenAI/Anthropic
endpoints agentd does not serve are a 404 that names them (``unsupported_endpoint``); a full
queue is 503 with ``Retry-After``; anything unexpected is a 500 that is also logged.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from agentd.server.protocol import RequestValidationError, error_body

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


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}
# Endpoints of the OpenAI and Anthropic APIs that agentd does not serve, by path pattern.
_UNSUPPORTED = tuple((re.compile(pattern), what) for pattern, what in (
    (r"^/v1/embeddings", "embeddings"), (r"^/v1/audio", "audio (speech and transcription)"),
    (r"^/v1/images", "image generation"), (r"^/v1/moderations", "moderations"),
    (r"^/v1/(files|uploads)", "file uploads"), (r"^/v1/batches", "the Batch API"),
    (r"^/v1/fine_tuning", "fine-tuning"), (r"^/v1/(assistants|threads)", "the Assistants API"),
    (r"^/v1/vector_stores", "vector stores"), (r"^/v1/realtime", "the Realtime API"),
    (r"^/v1/conversations", "the Conversations API"), (r"^/v1/evals", "evals"),
    (r"^/v1/responses/[^/]+/input_items", "listing a response's input items"),
    (r"^/v1/responses/[^/]+/cancel", "cancelling background responses"),
    (r"^/v1/responses/(input_tokens|compact)", "this Responses API helper"),
    (r"^/v1/messages/batches", "Anthropic message batches"),
    (r"^/v1/complete$", "Anthropic's legacy text completions (use /v1/messages)")))
SERVED = ("/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, "
          "/v1/messages/count_tokens and /v1/models")


def error_payload(error: APIError, path: str = "") -> Any:
    """The error body in the shape of the route at ``path``."""
    if path.startswith(ANTHROPIC_PREFIX):
        kind = _ANTHROPIC_TYPES.get(error.status) or (
            "api_error" if error.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    return error_body(error.message, type=error.type, param=error.param, code=error.code)


def error_response(error: APIError, path: str = "") -> Response[Any]:
    return Response(error_payload(error, path), status_code=error.status,
                    headers=error.headers)


def _api_error(request: Request, exc: APIError) -> Response[Any]:
    return error_response(exc, request.url.path)


def _validation_error(request: Request, exc: RequestValidationError) -> Response[Any]:
    return error_response(APIError(exc.status, exc.message, param=exc.param, code=exc.code),
                          request.url.path)


def _litestar_validation(request: Request, exc: ValidationException) -> Response[Any]:
    """Litestar's msgspec decoding failed: name the first bad field like OpenAI does."""
    path = request.url.path
    if (reason := _json_decode_reason(exc)) is not None:
        return error_response(APIError(400, f"the request body is not valid JSON: {reason}"),
                              path)
    problems: list[Any] = exc.extra if isinstance(exc.extra, list) else []
    first = problems[0] if problems and isinstance(problems[0], dict) else {}
    key = first.get("key")
    message = first.get("message") or exc.detail
    if key:
        message = f"invalid value for {key}: {message}"
    return error_response(APIError(400, str(message), param=key or None), path)


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


def _http_error(request: Request, exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    message = exc.detail
    path = request.url.path
    if status == 404 and (what := unsupported_endpoint(path)) is not None:
        return error_response(APIError(
            404, f"agentd does not serve {what} ({path}); it serves {SERVED}",
            code="unsupported_endpoint"), path)
    if status == 400 and (reason := _json_decode_reason(exc)) is not None:
        message = f"the request body is not valid JSON: {reason}"
    elif status == 413:
        message = "the request body is too large"
    elif status == 404:
        message = f"not found: {message}" if message and message != "Not Found" else "not found"
    headers = dict(exc.headers) if exc.headers else None
    return error_response(APIError(status, str(message), headers=headers), path)


def unsupported_endpoint(path: str) -> str | None:
    """What the OpenAI or Anthropic endpoint at ``path`` does, if agentd does not serve it."""
    return next((what for pattern, what in _UNSUPPORTED if pattern.search(path)), None)


def _too_deep(request: Request, exc: RecursionError) -> Response[Any]:
    """JSON nested past Python's recursion limit (msgspec decodes, and our canonicalising of
    tool schemas walks, recursively): the client's body, so a 400, not a crash."""
    return error_response(APIError(400, "the request body nests too deeply (JSON nested "
                                   f"hundreds of levels deep is refused): {exc}"),
                          request.url.path)


def _internal_error(request: Request, exc: Exception) -> Response[Any]:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"),
                          request.url.path)


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    APIError: _api_error,
    RequestValidationError: _validation_error,
    ValidationException: _litestar_validation,
    HTTPException: _http_error,
    RecursionError: _too_deep,
    Exception: _internal_error,
}
